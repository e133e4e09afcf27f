"""bench/: the --tiny smoke run prints every benchmark id with measured numbers (CI keeps the
harness working; the real figures are never asserted), plus the pieces it is made of."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a top-level folder of the repository, not installed
    sys.path.insert(0, str(REPO))

from bench import harness, run  # noqa: E402
from bench.core import Row  # noqa: E402
from bench.suite import BENCHMARKS, ON_DEMAND  # noqa: E402
IDS = [f"P{i}" for i in range(1, 11)] + ["P13", "P14"]  # the default set; P11 (the cluster storm) only by name


def test_unknown_id_is_a_usage_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "P99", "--work", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown benchmark id(s) P99" in out.stderr


def test_table_marks_pass_fail_and_unmeasured() -> None:
    rows = [Row("P1", "m1", ">= 1x", "1.20x", True), Row("P2", "m2", ">= 2x", "1.00x", False),
            Row("P8", "m8", "report", "not measured: no GPU lent", None)]
    lines = run.table(rows)
    assert [ln.split("|")[5].strip() for ln in lines[2:]] == ["pass", "FAIL", "-"]
    assert len({len(ln) for ln in lines}) == 1  # aligned columns


def test_step_times_skip_gate_waits_and_take_the_slowest_rank() -> None:
    # marks: [wall end, CPU end, wall go-on, CPU go-on]; rank 0 waited 0.5 s at gate 1
    r0 = {"marks": {"0": [100.0, 10.0, 100.0, 10.0], "1": [101.0, 10.9, 101.5, 10.9],
                    "2": [103.0, 12.0, 103.0, 12.0]}}
    r1 = {"marks": {"0": [100.0, 20.0, 100.0, 20.0], "1": [101.2, 21.0, 101.5, 21.0],
                    "2": [103.0, 22.5, 103.0, 22.5]}}
    assert harness.step_costs([r0, r1], 0, 2) == pytest.approx([1.2, 1.5])
    assert harness.step_costs([r0, r1], 0, 2, "cpu") == pytest.approx([1.0, 1.5])
    assert harness.rate([r0, r1], 0, 2) == pytest.approx(1 / 1.35)
    assert harness.median([3.0, 1.0, 2.0]) == 2.0


def test_every_id_has_a_benchmark_and_the_job_file_exists() -> None:
    assert list(BENCHMARKS) == IDS[:10] + ["P11", "P12", "P13", "P14", "P15", "P16", "P17"]
    # never in the default set nor CI's --tiny run: the cluster, many runs (P16), the trainer packages (P17)
    assert ON_DEMAND == {"P11", "P12", "P15", "P16", "P17"}
    assert harness.JOB.is_file()
    # the benchmark's config is the user's job file plus overrides, and it validates
    from ddpjob import jobfile

    cfg = jobfile.from_json(harness.job_config(Path("/data"), harness.FULL, 2))
    assert (cfg.train.model, cfg.train.batch_size, cfg.train.threads) == ("resnet18", 128, 1)
    assert cfg.train.amp == "auto" and cfg.train.channels_last  # the job file's recipe, kept


# ------------------------------------------------------------------ P11: the preemption storm
from bench import p11 as p11_rows, storm_ledger  # noqa: E402

STORM_EVENTS = REPO / "tests" / "golden" / "p11-storm-events.jsonl"  # recorded: `bench P11 --tiny`


def test_storm_figures_from_a_recorded_ledger() -> None:
    events = storm_ledger.read_jsonl(STORM_EVENTS)
    f = storm_ledger.figures(events, list(range(1, 1501)))
    assert [(r.restart, r.stop_step, r.resumed_step, r.steps_lost) for r in f.recoveries] == \
        [(0, 433, 433, 0), (1, 574, 574, 0)]
    assert f.steps_lost == 0 and f.unknown_lost == 0 and f.resumed_where_stopped and f.replayed_steps == 0
    first = f.recoveries[0].phases
    assert list(first) == ["stop vote", "save", "exit", "requeue", "start-up", "load", "first step"]
    # the earliest rank's signal (rank 1) to the vote; rank 0's exit to the next process start
    assert first["stop vote"] == pytest.approx(1795604583.253516 - 1795604583.2189524, abs=1e-3)
    assert first["requeue"] == pytest.approx(1795604589.3022904 - 1795604583.3248732, abs=1e-3)
    assert f.median_phases["requeue"] == pytest.approx((5.978 + 5.910) / 2, abs=2e-3)
    # loops: each start's loop to its stop's decision, the last one to the finished stop
    assert f.loop_s == pytest.approx([12.301, 5.109, 21.408], abs=1e-3)
    assert f.wall_s == pytest.approx(1795604630.4187195 - 1795604567.1524684, abs=1e-3)
    assert f.ratio == pytest.approx(sum(f.loop_s) / f.wall_s)
    # the wall time is the cold start, the loops and the gaps between them, nothing left over
    assert f.cold_s + sum(f.loop_s) + sum(f.between_s) == pytest.approx(f.wall_s, abs=5e-3)
    assert f.recoveries[0].total_s == pytest.approx(sum(first.values()), abs=1e-3)


def test_storm_figures_count_replays_and_refuse_an_unfinished_run() -> None:
    events = storm_ledger.read_jsonl(STORM_EVENTS)
    f = storm_ledger.figures(events, [1, 2, 3, 2, 3, 4])  # a resume from step 1: 2 and 3 again
    assert f.replayed_steps == 2
    with pytest.raises(ValueError, match="did not complete"):
        storm_ledger.figures(events[:-1], [1])
    lost = [dict(e, steps_lost=1) if e.get("reason") == "preemption" else e for e in events]
    assert storm_ledger.figures(lost, [1]).steps_lost == 2


def test_storm_losses_are_compared_bit_for_bit_replays_included() -> None:
    ref = [{"step": s, "loss": 1.0 / s} for s in range(1, 5)]
    run = [{"step": s, "loss": 1.0 / s, "restart": 0} for s in (1, 2, 3)] + \
        [{"step": s, "loss": 1.0 / s, "restart": 1} for s in (3, 4)]
    assert storm_ledger.loss_mismatches(run, ref, 4) == []
    run[3]["loss"] = 1.0 / 3 + 1e-16  # the replayed step 3 differs in the last bit
    assert storm_ledger.loss_mismatches(run, ref, 4) == [
        f"step 3 (restart 1): {1.0 / 3 + 1e-16!r} vs {1.0 / 3!r}"]
    assert "lacks 1 step(s), first [4]" in storm_ledger.loss_mismatches(run[:3], ref, 4)[0]


def test_storm_rows_pass_only_when_identical_and_nothing_lost() -> None:
    f = storm_ledger.figures(storm_ledger.read_jsonl(STORM_EVENTS), list(range(1, 1501)))
    rows = p11_rows.rows_of(f, [], 40, [], 1500, True, {}, p11_rows.storm.TINY)
    assert [r.id for r in rows] == ["P11"] * 4
    assert rows[0].passed is True and rows[0].measured.startswith("bit-identical")
    assert rows[1].passed is True and rows[1].measured.startswith("0 ")
    assert rows[2].passed is None and rows[2].measured.startswith(f"{f.ratio:.3f}")
    assert "requeue 5.94" in rows[3].measured
    bad = p11_rows.rows_of(f, [".model.fc.weight"], 40, [], 1500, True, {}, p11_rows.storm.TINY)
    assert bad[0].passed is False and "DIFFERS: .model.fc.weight" in bad[0].measured
    replayed = storm_ledger.figures(storm_ledger.read_jsonl(STORM_EVENTS), [1, 2, 2])
    assert p11_rows.rows_of(replayed, [], 40, [], 3, True, {}, p11_rows.storm.TINY)[1].passed is False


# ------------------------------------------------------------------ P12: the kill storm
from bench import killstorm, p12 as p12_rows  # noqa: E402

def _kill_ledger() -> tuple[list[dict], list[dict]]:
    """Two attempts: rank 1 killed at t=100 after step 43 was logged; the decision's record at
    100.6, the new ranks started at 100.7, their loop at 108.0 after a 0.05 s snapshot load,
    the first step at 108.1; resumed at the snapshot of step 40; finished at 120."""
    events = [
        {"event": "start", "job_id": "9", "restart": 0, "launched_time": 90.0, "time": 97.0, "load_s": 0.0,
         "resumed_step": None},
        {"event": "first_step", "job_id": "9", "restart": 0, "step": 1, "time": 97.1},
        {"event": "stop", "job_id": "9", "rank": 0, "restart": 0, "reason": "crash", "time": 100.2},  # a rank's own
        {"event": "stop", "job_id": "9", "restart": 0, "reason": "crash", "step": 40, "time": 100.6},
        {"event": "start", "job_id": "9", "restart": 1, "launched_time": 100.7, "time": 108.0, "load_s": 0.05,
         "resumed_step": 40},
        {"event": "first_step", "job_id": "9", "restart": 1, "step": 41, "time": 108.1},
        {"event": "stop", "job_id": "9", "restart": 1, "reason": "finished", "step": 80, "time": 120.0},
    ]
    records = ([{"kind": "train", "step": s, "restart": 0, "time": 97.0 + 0.05 * s} for s in range(1, 44)]
               + [{"kind": "train", "step": s, "restart": 1, "time": 108.0 + 0.1 * (s - 40)} for s in range(41, 81)])
    return events, records


def test_kill_storm_figures_come_from_the_ledger_and_the_kill_times() -> None:
    events, records = _kill_ledger()
    fail = killstorm.Failure("kill -9 rank 1 on n2", attempt=0, target=41, killed_at=100.0)
    (m,) = killstorm.measure([fail], events, records, "9")
    assert (m["last_step"], m["resumed_step"], m["steps_lost"], m["same_job"]) == (43, 40, 3, True)
    assert m["phases"] == {"detect and tear down": 0.6, "restart": 0.1, "start-up": 7.25, "load": 0.05,
                           "first step": 0.1}
    assert m["total_s"] == 8.1
    loops, wall, ratio = killstorm.loop_ratio(events, records)
    assert (loops, wall) == (round(43 * 0.05 + 12.0, 3), 30.0) and abs(ratio - loops / 30.0) < 1e-12
    with pytest.raises(ValueError, match="no decision record"):
        killstorm.measure([killstorm.Failure("x", 1, 0, 0.0)], events, records, "9")


def test_kill_storm_rows_fail_on_a_lost_interval_a_slow_recovery_or_memory_left() -> None:
    events, records = _kill_ledger()
    fail = killstorm.Failure("kill -9 rank 1 on n2", attempt=0, target=41, killed_at=100.0)
    measured = killstorm.measure([fail], events, records, "9")
    shm = {"max_per_rank": 2, "max_bytes": 2 << 20, "left": []}
    rows = p12_rows.rows_of(measured, killstorm.TINY, True, "bit-identical", (10.0, 30.0, 1 / 3), shm,
                            {"requeued": 0}, [5, 7])
    assert [r.id for r in rows] == ["P12"] * 6
    assert [r.passed for r in rows] == [True, True, True, False, None, True]  # 8.1 s > 5 s
    assert "in 1 of 1 failures (the kills: 3; \"auto\" chose 5, 7)" in rows[1].measured
    assert "total 8.10 (median)" in rows[3].measured
    measured[0]["steps_lost"] = 8
    again = p12_rows.rows_of(measured, killstorm.TINY, True, "", (10.0, 30.0, 1 / 3),
                             {**shm, "left": ["/dev/shm/ddpjob-0/9-abc"]}, {"requeued": 1}, [5, 7])
    assert again[1].passed is False and again[2].passed is False and again[5].passed is False
    log = 'in-memory snapshots every 72 steps (snapshot_every = "auto"): one costs 20.3 ms\nother\n'
    assert killstorm.auto_intervals(log * 2) == [72, 72] and killstorm.auto_intervals("") == []


# ------------------------------------------------------------------ P15: the machinery at 2-32 ranks
from bench import p15 as p15_rows, scale  # noqa: E402

SDIAG = """Remote Procedure Call statistics by message type
\tREQUEST_SUBMIT_BATCH_JOB                ( 4003) count:1      ave_time:900    total_time:900
\tREQUEST_STEP_COMPLETE                   ( 5016) count:{steps}      ave_time:300    total_time:600
\tREQUEST_JOB_REQUEUE                     ( 4024) count:1      ave_time:300    total_time:300
\tREQUEST_KILL_JOB                        ( 5032) count:1      ave_time:300    total_time:300
\tREQUEST_UPDATE_JOB                      ( 3001) count:1      ave_time:300    total_time:300

Remote Procedure Call statistics by user
\troot            (       0) count:9      ave_time:405    total_time:3645
"""

SS = """0      0      127.0.0.1:40001 127.0.0.2:15870 users:(("python",pid=101,fd=5))
\t cubic wscale:7,7 rto:204 bytes_sent:900 segs_out:40 data_segs_out:30 data_segs_in:28
0      0      127.0.0.1:40002 127.0.0.2:15870 users:(("python",pid=101,fd=9))
\t cubic wscale:7,7 rto:204 bytes_sent:90 segs_out:10 data_segs_out:4 data_segs_in:4
0      0      127.0.0.3:40003 127.0.0.2:15870 users:(("python",pid=202,fd=5))
\t cubic wscale:7,7 rto:204 bytes_sent:900 segs_out:40 data_segs_out:31 data_segs_in:28
"""


def test_scale_reads_sdiag_by_type_and_store_segments_by_process() -> None:
    assert scale.parse_sdiag(SDIAG.format(steps=2)) == {
        "REQUEST_SUBMIT_BATCH_JOB": 1, "REQUEST_STEP_COMPLETE": 2, "REQUEST_JOB_REQUEUE": 1,
        "REQUEST_KILL_JOB": 1, "REQUEST_UPDATE_JOB": 1}  # not the "by user" section
    assert scale.parse_ss(SS) == {101: 34, 202: 31}  # both of a rank's connections


def _scale_result(ranks: int, requeues: int = 1, per_s: float = 0.5, files: float = 1.5) -> dict:
    rpcs = scale.parse_sdiag(SDIAG.format(steps=2 * ranks))
    rpcs["REQUEST_JOB_REQUEUE"] = requeues
    return {"ranks": ranks, "rpcs": rpcs, "store_segments_per_s": [per_s] * ranks,
            "store_segments_per_step": [0.1] * ranks, "store_clients": ranks, "files_per_rank": files,
            "first_step_s": 9.0, "vote_us": 800, "checkpoint_block_s": 0.05,
            "recovery": {"stop vote": 0.1, "requeue": 3.0}, "status_s": 0.6}


def test_scale_rows_pass_when_ddpjobs_rpcs_store_requests_and_files_stay_flat() -> None:
    rows = p15_rows.rows_of([_scale_result(2), _scale_result(32)])
    assert [r.passed for r in rows] == [True, None, True, True, None]
    assert rows[0].measured == "REQUEST_JOB_REQUEUE 1 / 1"  # the driver's submit, signal, release: off
    assert rows[1].measured == "REQUEST_STEP_COMPLETE 4 / 64"  # SLURM's own, per node
    assert "recovery 3.1 / 3.1" in rows[4].measured
    bad = p15_rows.rows_of([_scale_result(2), _scale_result(32, requeues=16, per_s=4.0, files=2.0)])
    assert [r.passed for r in bad] == [False, None, False, False, None]
    assert "REQUEST_JOB_REQUEUE 1 / 16 (GROWS)" in bad[0].measured
    fewer = p15_rows.rows_of([_scale_result(2, requeues=2), _scale_result(32, requeues=1)])
    assert fewer[0].passed is True  # fewer at more ranks is no growth


def test_p16_counts_false_flags_detections_and_the_slowdown_s_cause() -> None:
    from bench import p16

    host = {"event": "straggler", "cause": "host", "rank": 0, "step": 50}
    found = {"clean": [[host], []],
             "30%": [[{"event": "straggler", "cause": "compute", "rank": 1, "step": 60}], [host]],
             "1.5x": [[{"event": "slowdown", "state": "began", "step": 90, "cause": "data", "ratio": 0.66}]]}
    clean, share, slow = p16.rows(found)
    assert clean.measured == "0 in 2 runs (host line in 1, slowdown line in 0)" and clean.passed
    assert share.measured.startswith("1/2, median 30 steps (1.5 windows)") and not share.passed
    assert slow.measured == "1/1, median 30 steps (1.5 windows), most 30; cause data in 1" and slow.passed
