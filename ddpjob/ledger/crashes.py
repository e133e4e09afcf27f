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

from ddpjob import fileio, rundir
from ddpjob.ledger import budget, events, metricslines, policy, requests

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
    started), one that SIGTERM ended ("Terminated") only when no other is named: srun ends the
    whole step with SIGTERM once a task failed (--kill-on-bad-exit), so those are the step's end,
    not its cause. An exit with a code is the program's own end (a Python exception exits 1): not
    the host's fault; any other end (Killed, Segmentation fault, Bus error) is a death by a signal."""
    lost = NODE_FAILURE.search(text)
    if lost is not None:  # the node itself failed: its tasks and the others' ends follow from it
        return Culprit(None, lost["host"], "node failure", True)
    found = list(SRUN_ERROR.finditer(text))
    m = next((m for m in found if not terminated(m["what"].strip())), found[0] if found else None)
    if m is None:
        return None
    what = m["what"].strip()
    return Culprit(int(m["task"]), m["host"], what, _EXITED.fullmatch(what) is None)


def terminated(how: str) -> bool:
    """srun's word for a task SIGTERM ended."""
    return how == "Terminated"


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
    errors = [e for e in evs if events.is_rank_crash(e) and isinstance(e.get("error"), str)
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


def peer_crash(evs: Sequence[dict[str, Any]], job_id: Any, restart: int, rank: int) -> dict[str, Any] | None:
    """Another rank's crash record in this attempt (the first), or None. srun ends the whole step
    with SIGTERM once one task failed (--kill-on-bad-exit), the signal a preemption sends: a rank
    that stops on it after such a record ends with the peer's crash, it was not preempted."""
    return next((e for e in evs if events.is_rank_crash(e) and events.of_attempt(e, job_id, restart)
                 and e.get("rank") != rank), None)


# srun's words for a task a signal ended, and the signal
_SRUN_SIGNALS = {"Killed": "SIGKILL", "Out Of Memory": "SIGKILL", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS", "Aborted": "SIGABRT",
                 "Terminated": "SIGTERM", "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


def signal_of(culprit: Culprit | None) -> str | None:
    """The signal that ended the culprit ("SIGKILL"), where one did."""
    if culprit is None or not culprit.host_fault:
        return None
    if m := re.search(r"\bSIG[A-Z0-9]+\b", culprit.how):
        return m.group(0)
    return next((sig for words, sig in _SRUN_SIGNALS.items() if culprit.how.startswith(words)), None)


def _rank_class(e: dict[str, Any]) -> str:
    """A rank's crash record's class (runner.py writes `error_class`; a record of an older
    ddpjob is told by its words)."""
    cls = e.get("error_class")
    if cls in policy.CLASSES:
        return str(cls)
    return policy.USER if "your code raised" in str(e.get("error")) else policy.INFRASTRUCTURE


def classify(culprit: Culprit | None, evs: Sequence[dict[str, Any]], job_id: Any, restart: int
             ) -> tuple[str, str, str | None]:
    """(the crash's class, what failed in words, the user's file:line where known). An exception
    a rank raised in its own code (or inside ddpjob) is the root cause whichever rank ended
    first: its peers' failed collectives follow from it. Without one, a death by a signal, a
    lost node, a peer gone or a stall the hang watch ended: what the cluster broke."""
    records = [e for e in evs if events.is_rank_crash(e) and events.of_attempt(e, job_id, restart)]
    for e in records:
        cls = _rank_class(e)
        if cls in (policy.USER, policy.INTERNAL, policy.TRANSIENT):
            where = e.get("where") if isinstance(e.get("where"), str) else None
            exc = e.get("exception") if isinstance(e.get("exception"), str) else None
            step = e.get("step") if isinstance(e.get("step"), int) else None
            # the exception at the user's line, else the rank's one line (a setting ddpjob refused)
            what = f"{exc} at {where}" if exc and where else _short(str(e.get("error")))
            rank = e.get("rank") if isinstance(e.get("rank"), int) else "?"
            return cls, f"rank {rank}'s {what}" + ("" if step is None else f" at step {step}"), where
    if culprit is not None:
        return policy.INFRASTRUCTURE, culprit.describe(), None
    return policy.INFRASTRUCTURE, "a rank ended without a record", None


def facts(evs: Sequence[dict[str, Any]], job_id: Any, restart: int, culprit: Culprit | None, *,
          resume_at: int, steps_lost: int | None, from_snapshot: bool, here: bool, hosts_left: bool = True,
          lost_hosts: Sequence[str] = (), run: str = "RUN", stop_requested: bool = False,
          exclude_after: int = 0, own_checkpoint: bool = False, progressed: bool | None = None,
          evidence: str = "") -> policy.Facts:
    """What the policy needs to know about a crash of attempt (job_id, restart), from the run's
    ledger and what the decider saw (the culprit, the resume point, the hosts left; with
    `exclude_after`, the decider can leave a failing host out of the restart). A [train] command
    that logs no steps: `progressed` (ledger/progress.py) says whether the attempt got on, by
    `evidence`; None: nothing tells, and no loop rule fires."""
    chain = budget.job_chain(evs, job_id)
    requeues, failures = budget.used(evs, job_id)
    if lost_hosts:
        cls, what, where = policy.INFRASTRUCTURE, f"node(s) {','.join(lost_hosts)} left the allocation", None
    else:
        cls, what, where = classify(culprit, evs, job_id, restart)
    streak, _ = no_progress(evs, chain, (job_id, restart, resume_at, progressed))
    # the same failure as the crash before, at the same step, with nothing gained in between
    prev = [e for e in _crashes(evs, chain) if not events.of_attempt(e, job_id, restart)]
    same = (where or (culprit.how if culprit else None))
    died = None if steps_lost is None else resume_at + steps_lost
    before = prev[-1] if prev else {}
    before_died = (before["step"] + before["steps_lost"] if isinstance(before.get("step"), int)
                   and isinstance(before.get("steps_lost"), int) else None)
    again = (streak >= 1 and bool(prev) and before.get("verdict") == cls and same is not None
             and (before.get("where") or before.get("failed_how")) == same
             and (died is None or before_died is None or died == before_died))
    same_host = culprit is not None and culprit.host is not None and before.get("failed_host") == culprit.host
    return policy.Facts("node_failure" if lost_hosts else "crash", cls, what, stop_requested, requeues, failures,
                        streak, again, here, hosts_left, resume_at, steps_lost, from_snapshot, run,
                        signal_of(culprit) if not lost_hosts else None, where,
                        quarantine=again and same_host and exclude_after > 0, own_checkpoint=own_checkpoint,
                        cancelled=requests.cancelled(evs, job_id), evidence=evidence if progressed is False else "")


def _short(error: str) -> str:
    """The rank's one line without what the culprit says already (ddpjob's prefix, "rank N on
    HOST:", the hint)."""
    text = error.removeprefix("ddpjob: error: ").split(" Hint: ")[0]
    return re.sub(r"^rank [0-9]+(?: on [^:\s]+)?: ", "", text).rstrip(".")[:200]


def _crashes(evs: Iterable[dict[str, Any]], chain: set[str] | None) -> list[dict[str, Any]]:
    # a node lost inside the allocation (on_node_loss = "continue") is the decision's record too
    return [e for e in evs if events.is_decision(e)
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


def no_progress(evs: Sequence[dict[str, Any]], chain: set[str] | None,
                now: tuple[Any, ...] | None) -> tuple[int, int | None]:
    """(how many attempts in a row ended in a crash without getting past the point they resumed
    from, the step they keep resuming from). An attempt's point is its start record's
    resumed_step (0: from scratch; no start record: it died before its first step, where it
    began); it got nowhere when the newest checkpoint after it is no newer. A command that logs
    no steps: its decision's `progress` (ledger/progress.py) says, and a crash whose progress
    nothing tells ends the streak. Any other stop (preemption, time limit) or a crash after
    progress ends it too. `now` = (job id, restart, resume step, progress) of a crash not
    recorded yet, counted last."""
    starts = {(str(e.get("job_id")), e.get("restart")): e.get("resumed_step") or 0
              for e in evs if e.get("event") == "start"}
    stops: list[tuple[str, Any, Any, Any, Any]] = [
        (str(e.get("job_id")), e.get("restart"), e.get("reason"), e.get("step"), e.get("progress"))
        for e in events.final_decisions(evs) if chain is None or str(e.get("job_id")) in chain]
    if now is not None:
        stops.append((str(now[0]), now[1], "crash", now[2], now[3] if len(now) > 3 else None))
    streak, point, last_from = 0, None, None
    for job_id, restart, reason, step, progressed in stops:
        began = starts.get((job_id, restart), step if last_from is None else last_from)
        if reason == "crash" and isinstance(progressed, bool):
            streak, point = (0, None) if progressed else (streak + 1, step)
        elif reason != "crash" or not isinstance(step, int):
            streak, point = 0, None
        elif began is not None and step <= began:
            streak, point = streak + 1, step
        else:
            streak, point = 0, None
        last_from = step if isinstance(step, int) else last_from
    return streak, point


def command_saved(run_dir: Path) -> int | None:
    """A [train] command run's resume point as far as ddpjob can see: the newest step its program
    said it saved (a "checkpoint" line), else the newest step it logged (docs/commands.md; it
    resumes from its own checkpoint, at most there), so that a crash after progress is no crash
    loop. None: it logs no steps."""
    tail = fileio.read_jsonl(run_dir / rundir.METRICS)[-200:]
    saved = metricslines.newest_checkpoint(tail)
    return saved if saved is not None else metricslines.newest_step(tail)


def command_point(run_dir: Path) -> tuple[int | None, int | None]:
    """A [train] command run's (resume step, steps lost past it) as its metrics lines tell: its
    newest "checkpoint" line and the steps it logged after it; without checkpoint lines the newest
    step it logged and an unknown loss (None: what it saved is its own secret); (None, None) for
    a program that logs no steps."""
    tail = fileio.read_jsonl(run_dir / rundir.METRICS)[-200:]
    newest, saved = metricslines.newest_step(tail), metricslines.newest_checkpoint(tail)
    if saved is None:
        return newest, None
    return saved, max(0, (newest or saved) - saved)


def resume_point(run_dir: Path, saved: int | None) -> tuple[int, int | None]:
    """(the step the next start resumes from: `saved`, what the caller found (store/memsnap.py:
    newest_saved), else 0; steps trained past it that are lost, None: no metrics to tell)."""
    resume_at = saved or 0
    trained = metricslines.newest_step(fileio.read_jsonl(run_dir / rundir.METRICS)[-200:])
    return resume_at, (max(0, trained - resume_at) if trained is not None else None)
