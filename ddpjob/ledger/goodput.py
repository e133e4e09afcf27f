"""The goodput ledger: where a run's wall time went, across every attempt (requeues, restarts
inside the allocation, successor jobs, `ddpjob resume`), from the first submission to the end
or to now. Pure arithmetic over what the run already records, never imports torch, so both
sides use it and the training step pays nothing for it: `ddpjob status`, `status --json` and
`ddpjob plot` with the scheduler's starts of each job (launch/goodput.py asks sacct), rank 0's
experiment trackers without them (rank/trackers.py: the ranks have no sacct).

  sacct (Submit, Start, End per start of each job, through the backend)   queue wait
  events.jsonl  start (launched_time, load_s, time), local_start, signal,  start-up, load,
                stop, exit, checkpoint (block_s, snapshot_s: rank 0 at     stop and save, checkpoint
                each save)
  metrics.jsonl train records (step, time, data_ms), eval records (eval_s) replayed, data stall, eval

The wall time is painted interval by interval, each second to one category (the highest
PRIORITY that covers it; a second nothing covers is "other"), so the categories always add up to
the wall time. Then the data stall and the in-memory snapshots' blocking, which are spread over
the steps, move from "productive" to their own categories.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ddpjob.ledger import events, metricslines, phases, policy
from ddpjob.slurm import Incarnation

CATEGORIES = ("productive", "queue", "start-up", "load", "replayed", "checkpoint", "eval",
              "data stall", "stop and save", "other")
# Where spans overlap, the narrower, more specific one wins (a checkpoint inside the steps).
# "idle": between a job that ended for good and a later `ddpjob resume`; not part of the wall.
PRIORITY = {"idle": 0, "queue": 1, "start-up": 2, "productive": 2, "load": 3, "replayed": 3, "checkpoint": 4,
            "eval": 4, "stop and save": 5}


def _num(rec: Mapping[str, Any] | None, key: str) -> float | None:
    v = (rec or {}).get(key)  # a loop's own eval_s or data_ms may be anything: numbers only
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


@dataclass
class Attempt:
    """One start of the ranks: (job id, restart number within the run)."""

    job_id: str
    restart: int
    begin: float  # SLURM's start of the job for its first attempt, else the previous attempt's end
    end: float | None  # None: still running
    resumed_step: int
    last_step: int  # the newest step it is known to have reached
    replayed_steps: int  # steps an earlier attempt had already run (the work a crash lost)
    ended_by: str | None  # the stop's reason ("preemption", "crash", "finished", ...)


@dataclass
class Ledger:
    begin: float
    end: float
    seconds: dict[str, float]  # per CATEGORIES: they add up to wall_s
    attempts: list[Attempt] = field(default_factory=list)
    idle_s: float = 0.0  # no job queued or running (a failed run before its `ddpjob resume`)

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        """The share of the wall time that trained: productive steps only."""
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def replayed_steps(self) -> int:
        return sum(a.replayed_steps for a in self.attempts)

    def record(self) -> dict[str, Any]:
        """status --json's `goodput` (docs/status-json.md)."""
        return {"wall_s": round(self.wall_s, 3), "goodput": round(self.goodput, 4), "idle_s": round(self.idle_s, 3),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "replayed_steps": self.replayed_steps, "begin": self.begin, "end": self.end,
                "attempts": [asdict(a) for a in self.attempts]}

    def describe(self) -> str:
        """'74.1% of 3 min 05 s trained; queue 9.8%, start-up 7.7%, ...' (the rest above 0.05%)."""
        wall = max(self.wall_s, 1e-9)
        rest = [f"{k} {100 * v / wall:.1f}%" for k, v in self.seconds.items()
                if k != "productive" and v / wall >= 0.0005]
        return (f"{100 * self.goodput:.1f}% of {duration(self.wall_s)} trained"
                + (f"; {', '.join(rest)}" if rest else "")
                + (f"; {self.replayed_steps} step(s) replayed" if self.replayed_steps else ""))


def duration(s: float) -> str:
    s = max(0, int(round(s)))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h} h {m:02d} min" if h else f"{m} min {sec:02d} s" if m else f"{sec} s"


def _same(e: Mapping[str, Any], job_id: str, restart: int) -> bool:
    return str(e.get("job_id")) == job_id and e.get("restart") == restart


def _at_step(points: Sequence[tuple[int, float]], step: int) -> float | None:
    """When `step` was done, interpolated between the (step, time) points (ascending)."""
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s1 >= step:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0) if s1 > s0 else t1
    return None


def build(evs: list[dict[str, Any]], metrics: list[dict[str, Any]],
          incarnations: Mapping[str, Sequence[Incarnation]], *, now: float, running: bool,
          submitted: float | None = None, queue_unknown: bool = False) -> Ledger | None:
    """The ledger of one run (None when no attempt started and SLURM knows no start either).
    `incarnations`: every start of each of the run's jobs (sacct; {} on the local backend);
    `running`: the run's job is pending or running, so the wall time ends now;
    `queue_unknown`: nobody asked the scheduler (rank 0's trackers), so the time from an
    attempt's end to the next attempt's process start, unless the next is a restart inside the
    allocation, is a wait nothing here can measure (a requeue's or a successor job's queue, or a
    person's resume): idle, out of the wall, instead of the next attempt's start-up."""
    starts = [e for e in evs if e.get("event") == "start" and _num(e, "time") is not None
              and isinstance(e.get("restart"), int) and not isinstance(e.get("restart"), bool)]
    incs = [(jid, i) for jid, rows in incarnations.items() for i in rows if i.start is not None]
    if not starts and not incs:
        return None
    spans: list[tuple[float, float, str]] = []
    moved = {"data stall": 0.0, "checkpoint": 0.0}
    # ---- SLURM's queue: each start of each job waited from its submission (or requeue) on
    for jid, rows in incarnations.items():
        for row in rows:
            if row.submit is not None:  # one still pending waits until now (or its cancel)
                spans.append((row.submit, row.start if row.start is not None else row.end or now, "queue"))

    def incarnation_of(job_id: str, t: float) -> Incarnation | None:
        for inc in incarnations.get(job_id, ()):
            if inc.start is not None and inc.start <= t + 1 and (inc.end is None or t <= inc.end + 1):
                return inc
        return None

    train: dict[int, list[tuple[int, float, dict[str, Any]]]] = {}
    for r in metrics:
        t, step = _num(r, "time"), r.get("step")
        if t is None or not isinstance(step, int) or not isinstance(r.get("restart"), int):
            continue
        if metricslines.is_word(r):
            continue  # a program's word on its save or its end, not a step it trained
        if r.get("kind") == "eval":
            if (took := _num(r, "eval_s")) is not None and took > 0:
                spans.append((t - took, t, "eval"))
        else:
            train.setdefault(r["restart"], []).append((step, t, r))

    attempts: list[Attempt] = []
    stops: list[Mapping[str, Any] | None] = []
    high = 0  # the newest step any earlier attempt reached
    prev_end: tuple[str, float] | None = None  # (job id, time) the previous attempt's records end
    for n, st in enumerate(starts):
        jid, restart = str(st.get("job_id")), st["restart"]
        later = evs[evs.index(st) + 1:]
        nxt = next((i for i, e in enumerate(later) if e is starts[n + 1]), len(later)) if n + 1 < len(starts) else len(later)
        mine = [e for e in later[:nxt] if _same(e, jid, restart)]
        s_time = float(st["time"])
        load = max(0.0, _num(st, "load_s") or 0.0)
        launched = _num(st, "launched_time") or s_time - load
        started = phases.launched(evs, evs.index(st)) or launched  # a local warm start from its local_start
        rs = st.get("resumed_step")
        resumed: int = rs if isinstance(rs, int) and not isinstance(rs, bool) else 0
        inc = incarnation_of(jid, launched)
        # the previous attempt went back to the queue (its decision's action, ledger/policy.py)
        queued = queue_unknown and bool(stops) and (stops[-1] or {}).get("action") == policy.REQUEUE
        if prev_end is not None and prev_end[0] == jid and not queued and (inc is None or inc.start is None or prev_end[1] >= inc.start):
            begin = prev_end[1]  # a restart inside the allocation: from the crash's record on
        elif inc is not None and inc.start is not None:
            begin = inc.start
        else:  # no queue known (the local backend): its first attempt starts up from the submission on
            begin = min(started, submitted) if n == 0 and submitted is not None else started
        spans.append((begin, s_time - load, "start-up"))
        spans.append((s_time - load, s_time, "load"))

        stop = next(iter(events.final_decisions(mine)), None)  # the attempt's one decision
        exited = next((e for e in mine if e.get("event") == "exit"), None)
        signals = [t for e in mine if e.get("event") == "signal" if (t := _num(e, "signal_time")) is not None]
        signalled = min(signals, default=_num(stop, "signal_time") if stop and stop.get("reason") != "crash" else None)
        recs = sorted(train.get(restart, []), key=lambda r: r[0])
        recs = [r for r in recs if r[0] > resumed and r[1] >= s_time - 1]
        last_rec = recs[-1][1] if recs else None
        reached = max([resumed, *(r[0] for r in recs),
                       *(e["step"] for e in (stop, exited) if e and isinstance(e.get("step"), int)
                         and (e.get("reason") != "crash"))])
        # when the steps end: the stop signal, the vote, the finish, else the last sign of life
        if signalled is not None:
            steps_end = signalled
        elif stop is not None and _num(stop, "decided_time") is not None:
            steps_end = float(stop["decided_time"])
        elif stop is not None and stop.get("reason") == "finished":
            steps_end = float(stop["time"])
        elif stop is None and exited is None and running and n == len(starts) - 1:
            steps_end = now
        else:
            steps_end = max([s_time, *([last_rec] if last_rec else [])])
        spans.append((s_time, steps_end, "productive"))
        # replayed: the steps up to the newest an earlier attempt had reached, run again
        replayed = max(0, min(high, reached) - resumed)
        if replayed:
            t_hw = _at_step([(resumed, s_time), *((s, t) for s, t, _ in recs)], resumed + replayed)
            spans.append((s_time, t_hw if t_hw is not None else steps_end, "replayed"))
        # checkpoints: each save blocked the loop block_s; snapshots are summed since the last one
        for e in mine:
            if e.get("event") == "checkpoint" and (t := _num(e, "time")) is not None:
                spans.append((t - max(0.0, _num(e, "block_s") or 0.0), t, "checkpoint"))
                moved["checkpoint"] += max(0.0, _num(e, "snapshot_s") or 0.0)
        # data stall: each train record's window waited data_ms per step (replayed ones excepted)
        prev_step = resumed
        for step, _, r in recs:
            if step > resumed + replayed and (ms := _num(r, "data_ms")) is not None and ms > 0:
                moved["data stall"] += ms / 1000 * (step - max(prev_step, resumed + replayed))
            prev_step = step
        if signalled is not None or (stop is not None and stop.get("reason") != "crash"
                                     and stop.get("reason") != "finished" and _num(stop, "decided_time")):
            stop_from = signalled if signalled is not None else float(stop["decided_time"])  # type: ignore[index]
            stop_to = _num(exited, "time") or _num(stop, "time") or stop_from
            spans.append((stop_from, stop_to, "stop and save"))
        ends = [t for e in mine if (t := _num(e, "time")) is not None]
        end: float | None = max([steps_end, *ends])
        if stop is None and exited is None and running and n == len(starts) - 1:
            end = None
        elif inc is not None and inc.end is not None and not any(
                str(s.get("job_id")) == jid and (_num(s, "launched_time") or 0) > launched and
                (_num(s, "launched_time") or 0) <= inc.end for s in starts[n + 1:]):
            # the last attempt of this start of the job: SLURM's end (a requeue's is when the
            # controller requeued it, while the ranks may still be exiting: their records after
            # it overlap the next queue wait, and the painting gives them to "stop and save")
            end = inc.end
        attempts.append(Attempt(jid, restart, round(begin, 3), None if end is None else round(end, 3),
                                resumed, reached, replayed, (stop or {}).get("reason")))
        stops.append(stop)
        high = max(high, reached)
        prev_end = (jid, max([steps_end, *ends]))
    for (a, stop), b in zip(zip(attempts, stops), attempts[1:]):
        # another job that nothing queued for this one: the run waited for a person's resume
        if a.end is not None and (queue_unknown or a.job_id != b.job_id
                                  and str((stop or {}).get("next_job_id")) != b.job_id):
            spans.append((a.end, b.begin, "idle"))

    times = [t for a in attempts for t in (a.begin, a.end) if t is not None]
    times += [t for rows in incarnations.values() for i in rows for t in (i.submit, i.start, i.end) if t is not None]
    begin = min([*times, *([submitted] if submitted is not None else [])])
    end = now if running else max(times)
    seconds = paint(spans, begin, end)
    idle = seconds.pop("idle")
    for cat, amount in moved.items():  # spread over the steps: out of productive
        take = min(amount, seconds["productive"])
        seconds["productive"] -= take
        seconds[cat] += take
    return Ledger(begin, end, seconds, attempts, idle)


def paint(spans: Iterable[tuple[float, float, str]], begin: float, end: float) -> dict[str, float]:
    """Seconds per category over [begin, end]: each instant to the highest-priority span that
    covers it, "other" where none does. A sweep over the span ends: O(n log n)."""
    marks: list[tuple[float, int, str]] = []
    for a, b, cat in spans:
        a, b = max(a, begin), min(b, end)
        if b > a:
            marks += [(a, 1, cat), (b, -1, cat)]
    marks.sort(key=lambda m: (m[0], m[1]))
    out = dict.fromkeys((*CATEGORIES, "idle"), 0.0)
    active = dict.fromkeys(PRIORITY, 0)
    t = begin
    for when, delta, cat in [*marks, (end, 0, "")]:
        if when > t:
            on = [c for c, k in active.items() if k > 0]
            out[max(on, key=PRIORITY.__getitem__) if on else "other"] += when - t
            t = when
        if cat:
            active[cat] += delta
    return out
