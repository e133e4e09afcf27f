"""What a run's crashes add up to: who failed and where (the culprit of one crash), the per-host
failure ledger (a host with QUARANTINE_AFTER host failures is excluded at the next restart) and
the no-progress streak (slurm.max_no_progress crashes in a row that got nowhere end the job).

Everything is read from events.jsonl: the decision's crash records (rank/requeue.py, the local
supervisor) carry `failed_rank`, `failed_host`, `failed_how` and `host_fault`, so the ledger is
the run's own history, shown by `status`, with no second file to keep in step. Login side and
node side read it alike: no torch here.
"""

from __future__ import annotations

import collections
import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpjob import rundir

# Two failures on one host by default ([slurm] exclude_after): once may be the job's bad luck,
# twice is the host (NVRx and Llama 3's operators exclude on repeats too). Preemptions, time limits and the job's own exceptions never
# count: only a rank that died by a signal (kill -9, the OOM killer, a segfault, a bus error)
# or a node that failed under it.
QUARANTINE_AFTER = 2

# srun's own line for a task that ended badly, e.g. "srun: error: n2: task 2: Killed" or
# "srun: error: n1: tasks 0-1: Exited with exit code 1". srun writes them as the tasks' ends
# reach it: the first one is the task that failed first (--kill-on-bad-exit ends the rest after).
# "srun: error: Node failure on n2" (a node of the step failed; with sbatch --no-kill the job goes on)
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<host>[A-Za-z0-9][A-Za-z0-9._-]{0,254})[ \t]*$",
                          re.M | re.ASCII)
SRUN_ERROR = re.compile(r"srun: error: (?P<host>[A-Za-z0-9][A-Za-z0-9._-]{0,254}): tasks? "
                        r"(?P<task>[0-9]{1,7})(?:[-,][0-9,-]*)?: (?P<what>[^\r\n]{1,200})", re.ASCII)
_EXITED = re.compile(r"Exited with exit code [0-9]{1,3}", re.ASCII)
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", re.ASCII)


@dataclass(frozen=True)
class Culprit:
    """The rank that failed first: where, how, and whether that counts against its host."""

    rank: int | None
    host: str | None
    how: str
    host_fault: bool

    def fields(self) -> dict[str, Any]:
        """For the decision's stop record. Not `rank`: a record with `rank` is a rank's own."""
        return {"failed_rank": self.rank, "failed_host": self.host, "failed_how": self.how,
                "host_fault": self.host_fault}

    def describe(self) -> str:
        if self.how == "node failure" and self.host:
            return f"node {self.host} failed"
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        return f"{who}{'' if self.host is None else f' on {self.host}'}{f': {self.how}' if self.how else ''}"


def from_srun(text: str) -> Culprit | None:
    """The first task srun reported as failed in `text` (the batch log since this attempt's srun
    started). An exit with a code is the program's own end (a Python exception exits 1): not the
    host's fault; any other end (Killed, Segmentation fault, Bus error) is a death by a signal."""
    lost = NODE_FAILURE.search(text)
    if lost is not None:  # the node itself failed: its tasks and the others' ends follow from it
        return Culprit(None, lost["host"], "node failure", True)
    m = SRUN_ERROR.search(text)
    if m is None:
        return None
    what = m["what"].strip()
    return Culprit(int(m["task"]), m["host"], what, _EXITED.fullmatch(what) is None)


def from_returncode(rank: int, host: str, code: int) -> Culprit:
    """A rank the local supervisor saw end (Popen's returncode: negative for a signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Culprit(rank, host, f"killed by {name}", True)
    return Culprit(rank, host, f"exited with status {code}", False)


def with_rank_error(culprit: Culprit | None, evs: Sequence[dict[str, Any]], job_id: Any,
                    restart: int) -> Culprit | None:
    """The culprit, told in the rank's own words where it recorded its error (runner.py writes
    one for an exception, OOM included): the first such record of this attempt is the root cause.
    Without srun's line (a custom template, the local backend) that record names the rank."""
    errors = [e for e in evs if e.get("event") == "stop" and "rank" in e and isinstance(e.get("error"), str)
              and str(e.get("job_id")) == str(job_id) and e.get("restart") == restart]
    if culprit is not None and culprit.rank is not None:
        mine = [e for e in errors if e.get("rank") == culprit.rank]
        if mine:
            return Culprit(culprit.rank, culprit.host, _short(mine[0]["error"]), culprit.host_fault)
        return culprit
    if errors:
        first = errors[0]
        rank = first["rank"] if isinstance(first.get("rank"), int) else None
        host = first["host"] if isinstance(first.get("host"), str) and HOST.fullmatch(first["host"]) else None
        return Culprit(rank, host, _short(first["error"]), False)
    return culprit


def _short(error: str) -> str:
    """The rank's one line without what the culprit says already (ddpjob's prefix, "rank N on
    HOST:", the hint)."""
    text = error.removeprefix("ddpjob: error: ").split(" Hint: ")[0]
    return re.sub(r"^rank [0-9]+(?: on [^:\s]+)?: ", "", text).rstrip(".")[:200]


def _crashes(evs: Iterable[dict[str, Any]], chain: set[str] | None) -> list[dict[str, Any]]:
    # a node lost inside the allocation (on_node_loss = "continue") is the decision's record too
    return [e for e in evs if e.get("event") == "stop" and "rank" not in e
            and e.get("reason") in ("crash", "node_failure")
            and (chain is None or str(e.get("job_id")) in chain)]


def host_failures(evs: Iterable[dict[str, Any]], chain: set[str] | None = None) -> dict[str, int]:
    """host -> failures counted against it (the decision's crash records with host_fault)."""
    count: collections.Counter[str] = collections.Counter()
    for e in _crashes(evs, chain):
        host = e.get("failed_host")
        if e.get("host_fault") is True and isinstance(host, str) and HOST.fullmatch(host):
            count[host] += 1
    return dict(count)


def excluded(evs: Iterable[dict[str, Any]], chain: set[str] | None = None,
             after: int = QUARANTINE_AFTER) -> list[str]:
    """The hosts a restart leaves out (`after` failures each; 0: none), in name order."""
    return [] if after <= 0 else sorted(h for h, n in host_failures(evs, chain).items() if n >= after)


def no_progress(evs: Sequence[dict[str, Any]], chain: set[str] | None, now: tuple[Any, int, int] | None
                ) -> tuple[int, int | None]:
    """(how many attempts in a row ended in a crash without getting past the point they resumed
    from, the step they keep resuming from). An attempt's point is its start record's
    resumed_step (0: from scratch; no start record: it died before its first step, where it
    began); it got nowhere when the newest checkpoint after it is no newer. Any other stop
    (preemption, time limit) or a crash after progress ends the streak. `now` = (job id,
    restart, resume step) of a crash not recorded yet, counted last."""
    starts = {(str(e.get("job_id")), e.get("restart")): e.get("resumed_step") or 0
              for e in evs if e.get("event") == "start"}
    stops: list[tuple[str, Any, Any, Any]] = [
        (str(e.get("job_id")), e.get("restart"), e.get("reason"), e.get("step"))
        for e in evs if e.get("event") == "stop" and "rank" not in e
        and (chain is None or str(e.get("job_id")) in chain)]
    if now is not None:
        stops.append((str(now[0]), now[1], "crash", now[2]))
    streak, point, last_from = 0, None, None
    for job_id, restart, reason, step in stops:
        began = starts.get((job_id, restart), step if last_from is None else last_from)
        if reason != "crash" or not isinstance(step, int):
            streak, point = 0, None
        elif began is not None and step <= began:
            streak, point = streak + 1, step
        else:
            streak, point = 0, None
        last_from = step if isinstance(step, int) else last_from
    return streak, point


def resume_point(run_dir: Path, saved: int | None) -> tuple[int, int | None]:
    """(the step the next start resumes from: `saved`, what the caller found (store/memsnap.py:
    newest_saved), else 0; steps trained past it that are lost, None: no metrics to tell)."""
    resume_at = saved or 0
    trained = [int(r["step"]) for r in rundir.read_jsonl(run_dir / rundir.METRICS)[-50:]
               if isinstance(r.get("step"), int)]
    return resume_at, (max(0, max(trained) - resume_at) if trained else None)


def crash_loop(limit: int, streak: int, resume_at: int, lost: int | None, culprit: Culprit | None) -> str | None:
    """The one line that ends a crash loop (slurm.max_no_progress = `limit` attempts in a row
    got nowhere): where it keeps dying and who. None: not a loop (yet)."""
    if streak < limit:
        return None
    died = "" if lost is None else f", the last after step {resume_at + lost}"
    who = f" ({culprit.describe()})" if culprit else ""
    return (f"crash loop: {streak} attempts in a row crashed without getting past the checkpoint at "
            f"step {resume_at}{died}{who}; not retrying (slurm.max_no_progress = {limit})")
