"""P11's rows: run the storm (bench/storm.py), read its ledger (bench/storm_ledger.py), compare
with the uninterrupted reference, and say it in four table rows."""

from __future__ import annotations

import statistics
from typing import Any

from bench import slurmctl, storm
from bench.core import Bench, Row
from bench.storm_ledger import Figures, figures, loss_mismatches, train_records
from ddpjob.fileio import read_jsonl
from ddpjob.ledger import phases as phases_mod


def phase_text(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {phases[name]:.2f}" for name in phases_mod.PHASES if name in phases)


def rows_of(f: Figures, state_diff: list[str], tensors: int, loss_problems: list[str], losses: int,
            evals_equal: bool, details: dict[str, Any], size: storm.StormSize) -> list[Row]:
    """The table rows from the measured pieces (split from p11() so a test can build them)."""
    n = len(f.recoveries)
    same = not state_diff and not loss_problems and evals_equal
    if same:
        measured = (f"bit-identical: {tensors} model + optimizer tensors (torch.equal), all {losses} "
                    f"per-step losses, final accuracy")
    else:
        what = state_diff[:3] + loss_problems[:3] + ([] if evals_equal else ["evaluation differs"])
        measured = "DIFFERS: " + "; ".join(what)
    lost = f.steps_lost
    lost_text = (f"{lost} (ledger steps_lost per stop: {', '.join(str(r.steps_lost) for r in f.recoveries)}; "
                 f"resumed at the stop step: {'all' if f.resumed_where_stopped else 'NOT all'}; "
                 f"steps trained twice: {f.replayed_steps})")
    lost_ok = lost == 0 and f.unknown_lost == 0 and f.resumed_where_stopped and f.replayed_steps == 0
    median_total = statistics.median([r.total_s for r in f.recoveries]) if f.recoveries else 0.0
    pace = f"{size.every_steps} steps" if size.every_steps else f"~{size.every_s:.0f} s"
    where = f"{n} preemptions {pace} apart, 2 nodes x 1 task, {size.steps} steps"
    return [
        Row("P11", f"preemption storm ({where}): final state vs the uninterrupted run", "bit-identical",
            measured, same, {"state_differences": state_diff[:20], "loss_differences": loss_problems[:20]}),
        Row("P11", "steps lost over the storm", "0", lost_text, lost_ok),
        Row("P11", "effective training time ratio: time in the step loops / wall time (first start to end)",
            "report", f"{f.ratio:.3f} ({f.training_s:.0f} s of {f.wall_s:.0f} s)", None,
            {"loop_s": f.loop_s, "cold_start_s": f.cold_s, "between_loops_s": f.between_s, **details}),
        Row("P11", "recovery phases, median of the preemptions, s", "report",
            f"{phase_text(f.median_phases)}; total {median_total:.2f} (median)", None,
            {"recoveries": [f"stop at {r.stop_step}: {phase_text(r.phases)}; total {r.total_s:.2f}"
                            for r in f.recoveries]}),
    ]


def p11(b: Bench) -> list[Row]:
    if not slurmctl.up():
        raise RuntimeError("P11 needs the SLURM test cluster (sinfo fails): bash tests/cluster/start.sh")
    size = storm.TINY if b.sizes.tiny else storm.FULL
    work = b.base / "P11"
    work.mkdir(parents=True, exist_ok=True)
    run, script, key = storm.prepare(work, storm.sets(size))
    job, highs, held = storm.storm(work, run, script, size, b.log)
    ref, reused = storm.reference(work, storm.sets(size), key, b.log)
    if (ref / "config.json").read_bytes() != (run / "config.json").read_bytes():
        raise RuntimeError(f"P11: {ref} was made from another config than {run}")  # key collision
    events = read_jsonl(run / "events.jsonl")
    records = train_records(run)
    f = figures(events, [r["step"] for r in records])
    if len(f.recoveries) != size.preemptions:
        raise RuntimeError(f"P11: {len(f.recoveries)} preemption stops recorded, expected {size.preemptions}")
    diff, tensors = storm.compare_state(run, ref)
    problems = loss_mismatches(records, train_records(ref), size.steps)
    evals_equal = bool(storm.evals(ref)) and storm.evals(run) == storm.evals(ref)
    ref_f = figures(read_jsonl(ref / "events.jsonl"), [r["step"] for r in train_records(ref)], ())
    details = {"job": job, "high_jobs": " ".join(highs), "run_dir": str(run), "reference": str(ref),
               "reference_reused": reused,
               "reference_loop_s": ref_f.training_s, "reference_wall_s": ref_f.wall_s,
               # the driver's own share of SLURM's requeue phase: the 2 s it waits before a release
               "release_wait_s": round(held, 2)}
    for r in f.recoveries:
        b.log(f"  P11: stop at step {r.stop_step}: {phase_text(r.phases)}; total {r.total_s:.2f} s")
    return rows_of(f, diff, tensors, problems, len(records), evals_equal, details, size)
