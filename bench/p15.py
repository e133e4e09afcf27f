"""P15's rows: the machinery at 2 to 32 ranks (bench/scale.py), counted where a count can be
trusted and timed with the caveat that 2 cores make times at 16 and 32 ranks contention."""

from __future__ import annotations

import statistics
from typing import Any

from bench import scale, slurmctl
from bench.core import Bench, Row

# What ddpjob's own SLURM commands send slurmctld (ddpjob/slurm.py: scontrol show job / requeue /
# update, squeue, sinfo, sbatch, scancel). srun, slurmstepd and slurmd send the rest.
OURS = ("REQUEST_JOB_INFO_SINGLE", "REQUEST_JOB_INFO", "REQUEST_JOB_REQUEUE", "REQUEST_UPDATE_JOB",
        "REQUEST_KILL_JOB", "REQUEST_CANCEL_JOB_STEP", "REQUEST_NODE_INFO", "REQUEST_PARTITION_INFO",
        "REQUEST_SUBMIT_BATCH_JOB")


def ours(result: dict[str, Any]) -> dict[str, int]:
    """The result's RPCs of ddpjob's kinds, less the driver's own (submit, signal, release)."""
    return {k: n - scale.DRIVER_RPCS.get(k, 0) for k, n in result["rpcs"].items()
            if k in OURS and n - scale.DRIVER_RPCS.get(k, 0) > 0}


def rows_of(results: list[dict[str, Any]]) -> list[Row]:
    sizes = [r["ranks"] for r in results]
    by_size = " / ".join(str(s) for s in sizes)
    mine = [ours(r) for r in results]
    # none grows with the size: if every rank sent one, it would (at 32 ranks, 16 times 2's)
    flat_rpcs = all(n <= mine[0].get(k, 0) for m in mine for k, n in m.items())
    kinds = sorted({k for r in results for k in r["rpcs"]})
    growing = [k for k in kinds if k not in OURS and len({r["rpcs"].get(k, 0) for r in results}) > 1]  # or shrinking
    rpc_text = "; ".join(f"{k} {' / '.join(str(m.get(k, 0)) for m in mine)}" for k in sorted({k for m in mine for k in m}))
    slurm_text = "; ".join(f"{k} {' / '.join(str(r['rpcs'].get(k, 0)) for r in results)}" for k in growing)
    per_s = [statistics.median(r["store_segments_per_s"]) if r["store_segments_per_s"] else 0.0 for r in results]
    top_s = [max(r["store_segments_per_s"], default=0.0) for r in results]
    flat_store = all(t <= 1.5 * max(top_s[0], 0.5) for t in top_s)
    files = [r["files_per_rank"] for r in results]
    flat_files = all(f is not None and f <= files[0] for f in files)

    def col(key: str, fmt: str = "{}") -> str:
        return " / ".join("-" if r.get(key) is None else fmt.format(r[key]) for r in results)

    step_med = " / ".join(f"{statistics.median(r['store_segments_per_step']):.2f}" if r["store_segments_per_step"]
                          else "-" for r in results)
    recov = " / ".join(f"{sum(r['recovery'].values()):.1f}" if r["recovery"] else "-" for r in results)
    return [
        Row("P15", f"slurmctld RPCs of ddpjob's kinds per run (2 attempts), at {by_size} ranks (sdiag; the "
            "driver's submit, signal and release taken off)", "none grows with the rank count (so no rank but 0 sends any)",
            (rpc_text or "none") + ("" if flat_rpcs else " (GROWS)"), flat_rpcs,
            {"by_size": {r["ranks"]: r["rpcs"] for r in results}}),
        Row("P15", "slurmctld RPCs that change with the node count (SLURM's own: srun, slurmstepd, slurmd)",
            "report", slurm_text or "none", None),
        Row("P15", f"TCPStore requests per rank (TCP segments to rank 0's store, ss -ti), at {by_size} ranks",
            "flat per second (the hang watch polls on a clock)",
            f"median {' / '.join(f'{v:.2f}' for v in per_s)} per s, most {' / '.join(f'{v:.2f}' for v in top_s)}; "
            f"per step median {step_med}",
            flat_store, {"clients": [r["store_clients"] for r in results]}),
        Row("P15", f"files per checkpoint per rank, at {by_size} ranks", "flat",
            " / ".join(str(f) for f in files), flat_files),
        Row("P15", f"times at {by_size} ranks (2 cores: at 16 and 32 ranks mostly contention): start to first "
            "step s; stop vote us/step; checkpoint blocking s (median); recovery after the stop s; "
            "`ddpjob status` s", "report",
            f"first step {col('first_step_s')}; vote {col('vote_us')}; checkpoint {col('checkpoint_block_s')}; "
            f"recovery {recov}; status {col('status_s')}", None,
            {"recovery": {r["ranks"]: r["recovery"] for r in results}}),
    ]


def p15(b: Bench) -> list[Row]:
    if not slurmctl.up():
        raise RuntimeError("P15 needs the SLURM test cluster (sinfo fails): bash tests/cluster/start.sh")
    sizes = scale.TINY if b.sizes.tiny else scale.FULL
    work = b.base / "P15"
    work.mkdir(parents=True, exist_ok=True)
    need = max(3, max(sizes) // 2)  # partition `wide` exists from 3 nodes on (start.sh)
    with slurmctl.at_least(need, b.log):
        results = [scale.one(work, n, b.log) for n in sizes]
    return rows_of(results)
