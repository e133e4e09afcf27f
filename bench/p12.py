"""P12's rows: run the kill storm (bench/killstorm.py), compare with the uninterrupted reference
(bench/storm.py), and say it in table rows."""

from __future__ import annotations

import statistics
from typing import Any

from bench import killstorm, slurmctl, storm
from bench.core import Bench, Row
from bench.storm_ledger import loss_mismatches, train_records
from ddpjob.fileio import read_jsonl
from ddpjob.store import snaproom


def phase_text(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {phases[name]:.2f}" for name in killstorm.PHASES if name in phases)


def rows_of(measured: list[dict[str, Any]], size: killstorm.KillSize, same: bool, same_text: str,
            ratio: tuple[float, float, float], shm: dict[str, Any], details: dict[str, Any],
            intervals: list[int]) -> list[Row]:
    """`intervals`: the snapshot interval "auto" chose in each attempt (the default settings)."""
    kills = [m for m in measured if m["failure"].startswith("kill")]
    node = [m for m in measured if not m["failure"].startswith("kill")]
    every = max(intervals, default=0)
    lost_ok = sum(1 for m in measured if m["steps_lost"] <= every)
    med = statistics.median([m["total_s"] for m in kills]) if kills else 0.0
    where = (f"{len(kills)} kill -9 of a random rank at random steps{' + 1 node down' if node else ''}, "
             f"2 nodes x 1 task{' + 1 spare' if size.node_down else ''}, default failure settings (max_failures, "
             f"snapshot_every = \"auto\"), {size.steps} steps")
    lost_text = (f"within the snapshot interval in {lost_ok} of {len(measured)} failures (the kills: "
                 f"{', '.join(str(m['steps_lost']) for m in kills)}; \"auto\" chose "
                 f"{', '.join(map(str, intervals)) or 'none'})")
    if node:
        lost_text += (f"; the node loss: {node[0]['steps_lost']} (resumed at step {node[0]['resumed_step']}; the "
                      f"spare's rank got its RNG file from the survivor's snapshot)")
    return [
        Row("P12", f"hard-kill storm ({where}): final state vs the uninterrupted run", "bit-identical",
            same_text, same, details),
        Row("P12", "steps lost per failure", "<= the snapshot interval in every failure", lost_text,
            bool(intervals) and lost_ok == len(measured)),
        Row("P12", "the same job id throughout (restarts inside the allocation, never requeued)", "yes",
            "yes" if all(m["same_job"] for m in measured) and details.get("requeued") == 0 else "NO",
            all(m["same_job"] for m in measured) and details.get("requeued") == 0),
        Row("P12", "recovery by phase, median of the kills, s (kill -> first step done)", "<= 5 s",
            f"{phase_text(killstorm.medians(kills))}; total {med:.2f} (median)"
            + (f"; the node loss: total {node[0]['total_s']:.2f} ({phase_text(node[0]['phases'])})" if node else ""),
            med <= 5.0, {"failures": [f"{m['failure']}: last step {m['last_step']}, resumed {m['resumed_step']}; "
                                      f"{phase_text(m['phases'])}; total {m['total_s']:.2f}" for m in measured]}),
        Row("P12", "effective training time ratio: time in the step loops / wall time", "report",
            f"{ratio[2]:.3f} ({ratio[0]:.0f} s of {ratio[1]:.0f} s)", None),
        Row("P12", "/dev/shm: most snapshot folders one rank held at once, most bytes; left after the end",
            f"<= {snaproom.KEEP + 1} per rank; nothing left",
            f"{shm['max_per_rank']} per rank, {shm['max_bytes'] / 2**20:.1f} MiB; left: {shm['left'] or 'nothing'}",
            shm["max_per_rank"] <= snaproom.KEEP + 1 and not shm["left"]),
    ]


def p12(b: Bench) -> list[Row]:
    if not slurmctl.up():
        raise RuntimeError("P12 needs the SLURM test cluster (sinfo fails): bash tests/cluster/start.sh")
    size = killstorm.TINY if b.sizes.tiny else killstorm.FULL
    work = b.base / "P12"
    work.mkdir(parents=True, exist_ok=True)
    sets = [a for o in killstorm.overrides(size) for a in ("--set", o)]
    with slurmctl.at_least(3, b.log):  # 2 nodes + the spare
        run, script, key = storm.prepare(work, sets)
        job, failures, shm = killstorm.run_storm(work, run, script, size, b.log)
    ref, reused = storm.reference(work, sets, key, b.log)
    if (ref / "config.json").read_bytes() != (run / "config.json").read_bytes():
        raise RuntimeError(f"P12: {ref} was made from another config than {run}")  # key collision
    events = read_jsonl(run / "events.jsonl")
    records = train_records(run)
    measured = killstorm.measure(failures, events, records, job)
    diff, tensors = storm.compare_state(run, ref)
    problems = loss_mismatches(records, train_records(ref), size.steps)
    evals_equal = bool(storm.evals(ref)) and storm.evals(run) == storm.evals(ref)
    same = not diff and not problems and evals_equal
    same_text = (f"bit-identical: {tensors} model + optimizer tensors (torch.equal), all {len(records)} "
                 f"per-step losses, final accuracy" if same else
                 "DIFFERS: " + "; ".join(diff[:3] + problems[:3] + ([] if evals_equal else ["evaluation differs"])))
    acct = slurmctl._run(["sacct", "-X", "-D", "-n", "-P", "-o", "State", "-j", job], check=False).stdout.split()
    details = {"job": job, "run_dir": str(run), "reference": str(ref), "reference_reused": reused,
               "sacct_starts": acct, "requeued": sum(1 for s in acct if s == "REQUEUED")}
    for m in measured:
        b.log(f"  P12: {m['failure']}: last step {m['last_step']}, resumed {m['resumed_step']}, "
              f"{phase_text(m['phases'])}; total {m['total_s']:.2f} s")
    ratio = killstorm.loop_ratio(events, records)
    logs = "".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("rank-0*")))
    return rows_of(measured, size, same, same_text, ratio,
                   {"max_per_rank": shm.max_per_rank, "max_bytes": shm.max_bytes, "left": shm.left()}, details,
                   killstorm.auto_intervals(logs))
