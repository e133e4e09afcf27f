"""P11's figures from what a run recorded: RUN_DIR/events.jsonl and the train lines of
RUN_DIR/metrics.jsonl. Pure functions over parsed JSON (no torch, no SLURM), so that
tests/unit/test_bench.py can check them on a hand-written ledger.

Definitions (bench/README.md, P11, says the same):
  attempt        one start of the job: a `start` event of rank 0 up to its end
  loop time      of an attempt: from its `start` event (`time`: the step loop is about to begin)
                 to the end of its loop: the stop's `decided_time` (the ranks agreed to stop; the
                 save begins) or, for the last attempt, the `finished` stop (after the final save)
  wall time      from the first attempt's process start (`launched_time`) to the `finished` stop
  ratio          sum of the loop times / wall time (the effective training time ratio)
  steps lost     the ledger's `steps_lost` of each preemption stop (steps run after the signal
                 beyond the step in flight and the overlapped vote's lag); separately, the steps
                 trained twice (a resume from before the stop step) from metrics.jsonl
  phases         ddpjob.ledger.phases.recovery() of each preemption stop
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpjob.ledger import phases as phases_mod
from ddpjob.fileio import read_jsonl


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


@dataclass
class Recovery:
    restart: int  # the attempt that was stopped
    stop_step: int
    resumed_step: int | None  # where the next attempt began (None: it never started)
    steps_lost: int | None  # the ledger's figure (None: no signal was recorded)
    phases: dict[str, float]  # PHASES order, seconds; a phase not recorded is missing

    @property
    def total_s(self) -> float:
        return round(sum(self.phases.values()), 3)


@dataclass
class Figures:
    recoveries: list[Recovery]
    loop_s: list[float]  # per attempt
    wall_s: float
    replayed_steps: int  # steps with more than one train record (trained twice)
    cold_s: float  # first process start to the first loop: wall = cold + loops + between loops
    between_s: list[float]  # per stop: its loop's end to the next loop's start
    median_phases: dict[str, float] = field(default_factory=dict)

    @property
    def training_s(self) -> float:
        return round(sum(self.loop_s), 3)

    @property
    def ratio(self) -> float:
        return self.training_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steps_lost(self) -> int:
        """Ledger steps lost over all recoveries; a stop without the figure counts as lost
        work we cannot rule out, so it is reported apart (`unknown_lost`), not as 0."""
        return sum(r.steps_lost or 0 for r in self.recoveries)

    @property
    def unknown_lost(self) -> int:
        return sum(1 for r in self.recoveries if r.steps_lost is None)

    @property
    def resumed_where_stopped(self) -> bool:
        return all(r.resumed_step == r.stop_step for r in self.recoveries)


def _rank0_stops(events: list[dict[str, Any]]) -> list[int]:
    return [i for i, e in enumerate(events) if e.get("event") == "stop" and "rank" not in e]


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def figures(events: list[dict[str, Any]], train_steps: list[int],
            reasons: tuple[str, ...] = ("preemption",)) -> Figures:
    """The storm's figures. `train_steps`: the step of every train line of metrics.jsonl, in
    order (replays included). Raises ValueError when the ledger lacks what a figure needs (the
    run did not finish, an attempt has no recorded end): a benchmark must not guess."""
    stops = _rank0_stops(events)
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not starts:
        raise ValueError("events.jsonl has no start event")
    finished = [i for i in stops if events[i].get("reason") == "finished"]
    if not finished:
        raise ValueError("events.jsonl has no finished stop: the run did not complete")
    end = _num(events[finished[-1]], "time")
    first = events[starts[0]]
    begin = _num(first, "launched_time") or _num(first, "time")
    if end is None or begin is None:
        raise ValueError("the first start or the finished stop has no time")

    loops: list[float] = []
    between: list[float] = []
    for n, i in enumerate(starts):
        nxt = starts[n + 1] if n + 1 < len(starts) else len(events)
        ends = [j for j in stops if i < j < nxt]
        loop_start = _num(events[i], "time")
        if not ends or loop_start is None:
            raise ValueError(f"attempt {events[i].get('restart')} has no recorded end")
        stop = events[ends[0]]
        loop_end = _num(stop, "decided_time") or _num(stop, "time")
        assert loop_end is not None
        loops.append(round(max(0.0, loop_end - loop_start), 3))
        following = _num(events[nxt], "time") if nxt < len(events) else None
        if following is not None:
            between.append(round(following - loop_end, 3))

    recoveries: list[Recovery] = []
    for i in stops:
        stop = events[i]
        if stop.get("reason") not in reasons:
            continue
        resumed = next((events[j] for j in starts if j > i), None)
        lost = stop.get("steps_lost")
        recoveries.append(Recovery(
            restart=int(stop.get("restart") or 0), stop_step=int(stop["step"]),
            resumed_step=None if resumed is None else resumed.get("resumed_step"),
            steps_lost=lost if isinstance(lost, int) else None,
            phases=phases_mod.recovery(events, i)))
    medians = {name: round(statistics.median(vals), 3) for name in phases_mod.PHASES
               if (vals := [r.phases[name] for r in recoveries if name in r.phases])}
    replayed = len(train_steps) - len(set(train_steps))
    cold = (_num(first, "time") or begin) - begin
    return Figures(recoveries, loops, round(end - begin, 3), replayed, round(cold, 3), between, medians)


def loss_mismatches(run: list[dict[str, Any]], ref: list[dict[str, Any]],
                    steps: int) -> list[str]:
    """Every per-step loss of `run` (replayed steps too) against the uninterrupted `ref`, bit
    for bit (JSON keeps a float's full repr); [] when all equal and both cover steps 1..steps."""
    expected = {r["step"]: r["loss"] for r in ref}
    problems: list[str] = []
    if sorted(expected) != list(range(1, steps + 1)):
        problems.append(f"the reference logged {len(expected)} distinct steps, not 1..{steps}")
    seen = {r["step"] for r in run}
    if seen != set(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - seen)
        problems.append(f"the storm run lacks {len(missing)} step(s), first {missing[:5]}")
    problems += [f"step {r['step']} (restart {r.get('restart')}): {r['loss']!r} vs {expected[r['step']]!r}"
                 for r in run if r["step"] in expected and r["loss"] != expected[r["step"]]]
    return problems
