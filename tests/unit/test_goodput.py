"""The goodput ledger (ddpjob/ledger/goodput.py) on made-up records: which second goes where.
The real-SLURM checks (a preemption, a time limit and a killed rank against sacct; a kill -9
restarted inside the allocation) are in tests/cluster/test_preemption_slurm.py and
test_requeue_slurm.py."""

from __future__ import annotations

from typing import Any

import pytest

from ddpjob.ledger import goodput
from ddpjob.slurm import Incarnation


def start(t: float, restart: int, *, job: str = "7", resumed: int | None = None, load: float = 1.0,
          launched: float | None = None) -> dict[str, Any]:
    return {"event": "start", "job_id": job, "restart": restart, "time": t, "load_s": load,
            "launched_time": t - load - 4 if launched is None else launched, "resumed_step": resumed}


def steps(restart: int, first: int, last: int, t0: float, step_s: float = 1.0,
          data_ms: float = 0.0) -> list[dict[str, Any]]:
    """One train record per step from `first` to `last`, `step_s` apart from t0."""
    return [{"kind": "train", "step": s, "restart": restart, "time": t0 + (s - first + 1) * step_s,
             "data_ms": data_ms} for s in range(first, last + 1)]


def test_one_clean_attempt_splits_queue_start_up_load_steps_and_the_tail() -> None:
    # submitted at 0, SLURM start at 10, process at 12, load 1 s, loop at 17, 20 steps of 1 s
    evs = [start(17, 0, launched=12), {"event": "first_step", "job_id": "7", "restart": 0, "time": 18},
           {"event": "checkpoint", "job_id": "7", "restart": 0, "step": 10, "time": 27.5, "block_s": 0.5,
            "snapshot_s": 0.25},
           {"event": "stop", "reason": "finished", "job_id": "7", "restart": 0, "step": 20, "time": 37}]
    metrics = [*steps(0, 1, 20, 17, data_ms=100.0),
               {"kind": "eval", "step": 20, "restart": 0, "time": 37, "eval_s": 2.0, "eval_acc": 0.5}]
    ledger = goodput.build(evs, metrics, {"7": [Incarnation("COMPLETED", 10, 40, 0)]}, now=99, running=False)
    assert ledger is not None
    sec = ledger.seconds
    assert (ledger.begin, ledger.end, ledger.wall_s) == (0, 40, 40)
    assert sec["queue"] == 10
    assert sec["start-up"] == pytest.approx(6)  # SLURM's start to the loop, but the load
    assert sec["load"] == 1
    assert sec["eval"] == 2 and sec["checkpoint"] == pytest.approx(0.75)  # its block + the snapshots
    assert sec["data stall"] == pytest.approx(2.0)  # 100 ms x 20 steps
    assert sec["productive"] == pytest.approx(20 - 2 - 0.75 - 2.0)
    assert sec["other"] == 3  # the finished record to SLURM's end
    assert sum(sec.values()) == pytest.approx(40)
    assert ledger.goodput == pytest.approx(15.25 / 40)
    (a,) = ledger.attempts
    assert (a.begin, a.end, a.resumed_step, a.last_step, a.replayed_steps, a.ended_by) == (10, 40, 0, 20, 0, "finished")


def test_a_preemption_is_stop_and_save_then_queue_and_no_step_is_replayed() -> None:
    evs = [start(15, 0, launched=11),
           {"event": "signal", "job_id": "7", "restart": 0, "rank": 1, "signal_time": 24.5},
           {"event": "signal", "job_id": "7", "restart": 0, "rank": 0, "signal_time": 25.0},
           {"event": "stop", "reason": "preemption", "job_id": "7", "restart": 0, "step": 10, "requeued": True,
            "decided_time": 25.2, "saved_time": 26, "signal_time": 25.0, "time": 26.1},
           {"event": "exit", "job_id": "7", "restart": 0, "step": 10, "time": 26.5},
           start(50, 1, resumed=10, launched=45),
           {"event": "stop", "reason": "finished", "job_id": "7", "restart": 1, "step": 20, "time": 60}]
    metrics = [*steps(0, 1, 10, 15), *steps(1, 11, 20, 50)]
    incs = {"7": [Incarnation("REQUEUED", 10, 27, 0), Incarnation("COMPLETED", 44, 61, 27)]}
    ledger = goodput.build(evs, metrics, incs, now=99, running=False)
    assert ledger is not None
    sec = ledger.seconds
    assert sec["queue"] == pytest.approx(10 + 17)  # the first wait and the requeue's
    assert sec["stop and save"] == pytest.approx(26.5 - 24.5)  # the first rank's signal to the exit
    assert sec["replayed"] == 0 and ledger.replayed_steps == 0
    assert sec["productive"] == pytest.approx((24.5 - 15) + (60 - 50))
    assert sum(sec.values()) == pytest.approx(61)
    assert [(a.begin, a.end, a.ended_by) for a in ledger.attempts] == [(10, 27, "preemption"), (44, 61, "finished")]


def test_a_crash_restarted_in_place_replays_the_steps_it_lost_from_the_crash_record_on() -> None:
    # attempt 0 reached step 14 and died; the crash record (batch shell) at 30; attempt 1 resumes
    # from 10: steps 11..14 are run again (4 steps, 1 s each), then 15..20 are new
    evs = [start(10, 0, launched=5),
           {"event": "stop", "reason": "crash", "job_id": "7", "restart": 0, "step": 10, "steps_lost": 4,
            "requeued": True, "requeued_by": "in_allocation", "time": 30},
           start(36, 1, resumed=10, launched=31),
           {"event": "stop", "reason": "finished", "job_id": "7", "restart": 1, "step": 20, "time": 46}]
    metrics = [*steps(0, 1, 14, 10), *steps(1, 11, 20, 36)]
    ledger = goodput.build(evs, metrics, {"7": [Incarnation("COMPLETED", 5, 46, 5)]}, now=99, running=False)
    assert ledger is not None
    first, second = ledger.attempts
    assert (first.last_step, first.ended_by, second.replayed_steps) == (14, "crash", 4)
    assert first.end == second.begin == 30  # in place: no queue, from the crash's record on
    sec = ledger.seconds
    assert sec["replayed"] == pytest.approx(4)
    assert sec["start-up"] == pytest.approx((10 - 1 - 5) + (36 - 1 - 30))
    assert sec["other"] == pytest.approx(30 - 24)  # the last step's record to the crash record
    assert sec["productive"] == pytest.approx(14 + 6)
    assert sec["queue"] == 0 and sum(sec.values()) == pytest.approx(41)


def test_a_person_s_resume_days_later_is_idle_not_part_of_the_wall() -> None:
    evs = [start(10, 0, job="7", launched=5),
           {"event": "stop", "reason": "crash", "job_id": "7", "restart": 0, "step": 0, "requeued": False,
            "time": 20},
           start(100_010, 1, job="8", resumed=0, launched=100_005),
           {"event": "stop", "reason": "finished", "job_id": "8", "restart": 1, "step": 10, "time": 100_020}]
    metrics = [*steps(0, 1, 8, 10), *steps(1, 1, 10, 100_010)]
    incs = {"7": [Incarnation("FAILED", 5, 21, 4)], "8": [Incarnation("COMPLETED", 100_003, 100_021, 100_000)]}
    ledger = goodput.build(evs, metrics, incs, now=200_000, running=False)
    assert ledger is not None
    assert ledger.idle_s == pytest.approx(100_000 - 21)  # the failed job's end to the resume's submission
    assert ledger.wall_s == pytest.approx(100_021 - 4 - ledger.idle_s)
    assert ledger.attempts[1].replayed_steps == 8  # the first attempt's 8 steps, its checkpoint-less work
    assert ledger.seconds["queue"] == pytest.approx(1 + 3)


def test_a_running_job_counts_up_to_now_and_a_pending_one_is_all_queue() -> None:
    evs = [start(10, 0, launched=6)]
    ledger = goodput.build(evs, steps(0, 1, 5, 10), {"7": [Incarnation("RUNNING", 5, None, 0)]}, now=30,
                           running=True)
    assert ledger is not None
    assert ledger.end == 30 and ledger.attempts[0].end is None
    assert ledger.seconds["productive"] == pytest.approx(20) and ledger.seconds["queue"] == 5
    # requeued, waiting again: the wait since the requeue is queue, up to now
    evs.append({"event": "stop", "reason": "preemption", "job_id": "7", "restart": 0, "step": 5, "requeued": True,
                "signal_time": 14.5, "decided_time": 14.6, "time": 15})
    requeued = goodput.build(evs, steps(0, 1, 5, 10), {"7": [Incarnation("REQUEUED", 5, 16, 0),
                                                             Incarnation("PENDING", None, None, 16)]},
                             now=40, running=True)
    assert requeued is not None and requeued.seconds["queue"] == pytest.approx(5 + 24)
    pending = goodput.build([], [], {"9": [Incarnation("PENDING", None, None, 100)]}, now=130, running=True)
    assert pending is None  # nothing started yet: status says PENDING, no ledger
    assert goodput.build([], [], {}, now=1, running=False) is None


def test_painting_gives_each_second_to_the_most_specific_span_once() -> None:
    spans = [(0, 10, "productive"), (2, 3, "checkpoint"), (2.5, 4, "eval"), (8, 12, "stop and save"),
             (-5, 1, "queue")]
    out = goodput.paint(spans, -2, 14)
    assert out["queue"] == 2 and out["productive"] == pytest.approx(10 - 1 - 1 - 2)
    assert out["checkpoint"] + out["eval"] == pytest.approx(2)  # the overlap counted once
    assert out["stop and save"] == 4 and out["other"] == 2 and sum(out.values()) == pytest.approx(16)


def test_damaged_or_missing_fields_are_left_out_not_raised() -> None:
    evs = [{"event": "start", "job_id": "7", "restart": 0, "time": 10},  # no load, no launched time
           {"event": "checkpoint", "job_id": "7", "restart": 0, "time": "soon", "block_s": "x"},
           {"event": "stop", "reason": "finished", "job_id": "7", "restart": 0, "step": 3, "time": 13}]
    metrics = [{"kind": "eval", "step": 3, "restart": 0, "time": 13, "eval_s": float("nan")},
               {"kind": "train", "step": 3, "restart": 0, "time": 13, "data_ms": "slow"}]
    ledger = goodput.build(evs, metrics, {}, now=99, running=False)
    assert ledger is not None and ledger.wall_s == pytest.approx(3)
    assert ledger.seconds["productive"] == pytest.approx(3) and ledger.seconds["eval"] == 0


def test_the_summary_line_and_the_json_record() -> None:
    ledger = goodput.Ledger(0, 200, dict.fromkeys(goodput.CATEGORIES, 0.0) | {"productive": 150.0, "queue": 50.0})
    assert ledger.describe() == "75.0% of 3 min 20 s trained; queue 25.0%"
    rec = ledger.record()
    assert rec["goodput"] == 0.75 and rec["wall_s"] == 200 and rec["seconds"]["queue"] == 50 and rec["attempts"] == []


def test_a_local_warm_start_is_start_up_from_the_submission_not_other() -> None:
    """The local backend: submitted at 0, the supervisor's local_start at 0.5, the warm server
    imports torch and forks the rank at 4 (its launched_time), the loop at 5 after a 0.5 s load.
    Everything before the loop but the load is start-up; before, 0 to 4 was "other". A local
    requeue's recovery starts up from its local_start too (ledger/phases.py)."""
    evs = [{"event": "local_start", "job_id": "local-9", "restart": 0, "time": 0.5},
           start(5, 0, job="local-9", load=0.5, launched=4.0),
           {"event": "stop", "reason": "time_limit", "job_id": "local-9", "restart": 0, "step": 10,
            "signal_time": 14.0, "decided_time": 14.2, "saved_time": 14.5, "requeued": True,
            "requeued_by": "supervisor", "time": 14.6},
           {"event": "exit", "job_id": "local-9", "restart": 0, "step": 10, "time": 15.0},
           {"event": "local_start", "job_id": "local-9", "restart": 1, "time": 15.6},
           start(20, 1, job="local-9", resumed=10, load=0.5, launched=19.0),
           {"event": "stop", "reason": "finished", "job_id": "local-9", "restart": 1, "step": 20, "time": 30}]
    metrics = [*steps(0, 1, 9, 5), *steps(1, 11, 20, 20)]
    ledger = goodput.build(evs, metrics, {}, now=99, running=False, submitted=0.0)
    assert ledger is not None
    sec = ledger.seconds
    # the requeue starts up from the exit on (the same job: as a restart inside an allocation)
    assert sec["start-up"] == pytest.approx((5 - 0.5 - 0) + (20 - 0.5 - 15.0))
    assert sec["other"] == 0 and sum(sec.values()) == pytest.approx(30)
    from ddpjob.ledger import phases

    took = phases.recovery(evs, 2)
    assert took["requeue"] == pytest.approx(15.6 - 15.0) and took["start-up"] == pytest.approx(19.5 - 15.6)


def test_without_the_schedulers_record_a_requeues_wait_is_left_out_not_start_up() -> None:
    """Rank 0's trackers have no sacct (queue_unknown): from a requeued attempt's end to the next
    process start is the queue, which nothing the ranks record measures: idle, out of the wall.
    A restart inside the allocation still starts up from the crash's record on."""
    evs = [start(17, 0, launched=12),
           {"event": "stop", "reason": "preemption", "job_id": "7", "restart": 0, "step": 10, "signal_time": 27.0,
            "decided_time": 27.2, "saved_time": 27.5, "time": 27.6, "action": "requeue"},
           {"event": "exit", "job_id": "7", "restart": 0, "step": 10, "time": 28},
           start(110, 1, resumed=10, launched=105),  # requeued: back in the queue from 28 to 105
           {"event": "stop", "reason": "crash", "job_id": "7", "restart": 1, "step": 15, "time": 121,
            "action": "restart"},
           start(130, 2, resumed=15, launched=125),  # restarted in place: starts up from 121 on
           {"event": "stop", "reason": "finished", "job_id": "7", "restart": 2, "step": 25, "time": 140}]
    metrics = [*steps(0, 1, 10, 17), *steps(1, 11, 20, 110), *steps(2, 16, 25, 130)]
    known = goodput.build(evs, metrics, {}, now=999, running=False)
    unknown = goodput.build(evs, metrics, {}, now=999, running=False, queue_unknown=True)
    assert known is not None and unknown is not None
    assert known.seconds["start-up"] == pytest.approx((16 - 12) + (109 - 28) + (129 - 121))
    assert unknown.seconds["start-up"] == pytest.approx((16 - 12) + (109 - 105) + (129 - 121))
    assert unknown.idle_s == pytest.approx(105 - 28) and unknown.wall_s == pytest.approx(140 - 12 - 77)
    assert unknown.seconds["replayed"] == pytest.approx(5) == known.seconds["replayed"]  # steps 16-20 again
    assert unknown.seconds["queue"] == 0 and sum(unknown.seconds.values()) == pytest.approx(unknown.wall_s)
