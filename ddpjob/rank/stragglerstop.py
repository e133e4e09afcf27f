"""Rank 0 acting on a straggler its watch named ([slurm] on_straggler; rank/straggler.py names it,
rank/steptimer.for_job calls here). "exclude": every rank stops at one step with a checkpoint (a
stop code through the StopFlag, node/preemption.STRAGGLER, the weakest: a time limit or a
preemption at the same step wins), rank 0 records the decision (rank/requeue.after_stop) and the
batch shell's restart loop runs the ranks again inside the allocation without the host, as it
leaves out a host [slurm] exclude_after quarantined (rank/requeue.restart_layout): a spare takes
its place, else fewer nodes carry on. "requeue": the same stop, then the job is requeued with the
host excluded through SLURM. At most once per [slurm] straggler_exclude_every steps of the run's
progress (ledger/stragglers.py). A host the watch names as oversubscribed is never acted on: its
ranks wait for a core, the rank is not slow.

Where nothing can be done (the local backend: one host; no other node to run on; too soon after
the last action) the straggler is only reported, and why is said once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpjob import console
from ddpjob.config import JobConfig
from ddpjob.ledger import events, stragglers
from ddpjob.node import preemption
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank.straggler import Flag

_said: set[str] = set()  # the reasons for not acting said by this process (once each)


def consider(cfg: JobConfig, env: ClusterEnv, run_dir: Path, flag: Flag, stop: preemption.StopFlag) -> bool:
    """Rank 0, on `flag`: request the stop that acts on it where the policy allows; whether it did."""
    mode = cfg.slurm.on_straggler
    if mode not in ("exclude", "requeue") or flag.cause not in ("compute", "data") or stop.code != preemption.NONE:
        return False
    why = why_not(cfg, env, run_dir, flag)
    if why is not None:
        if why not in _said:
            _said.add(why)
            console.warn(f"slurm.on_straggler = \"{mode}\": {flag.host} is not left out: {why}")
        return False
    line = stragglers.describe(flag.rank, flag.host, flag.cause, flag.busy_s, flag.median_s)
    stop.request(preemption.STRAGGLER, host=flag.host, line=line, straggler_rank=flag.rank, cause=flag.cause,
                 **_srun_attempt())
    what = "restart in place" if mode == "exclude" else "requeue the job"
    console.warn(f"{line}: every rank stops at the next step with a checkpoint to {what} without {flag.host}")
    return True


def _srun_attempt() -> dict[str, int]:
    """The batch shell's count of the sruns it ran (DDPJOB_ATTEMPT, exported to the ranks): the
    decision names the srun it ended, so the batch shell tells it from a later srun's crash."""
    n = os.environ.get("DDPJOB_ATTEMPT", "")
    return {"srun_attempt": int(n)} if n.isdigit() else {}


def why_not(cfg: JobConfig, env: ClusterEnv, run_dir: Path, flag: Flag) -> str | None:
    """Why rank 0 cannot act on `flag` now, None where it can."""
    s = cfg.slurm
    if env.source in ("local", "single"):
        return (f"the {env.source} backend runs every rank on this host, none other to run on "
                "(the straggler is only reported)")
    if env.source != "slurm" or not env.job_id or (s.on_straggler == "exclude" and "DDPJOB_ATTEMPT" not in os.environ):
        return ("the ranks were not started by ddpjob's batch script, whose restart loop runs them "
                "again without the host (expected `ddpjob submit`)")
    evs = events.read(run_dir)
    last = stragglers.blocked(evs, flag.last, s.straggler_exclude_every)
    if last is not None:
        return (f"the last straggler was left out at step {last}, fewer than slurm.straggler_exclude_every = "
                f"{s.straggler_exclude_every} steps ago")
    if s.on_straggler == "exclude":
        from ddpjob.rank import requeue  # its SLURM queries: only here, once per named straggler

        hosts = requeue.allocation_now(cfg, env)
        if flag.host not in hosts:
            return f"it is not a node of the allocation ({','.join(hosts) or 'unknown'})"
        if requeue.restart_layout(run_dir, env, cfg, straggler=flag.host) is None:
            return ("no node of the allocation would be left to run on, expected a spare "
                    "(slurm.spare_nodes = 1 with on_node_loss = \"continue\") or more nodes")
    return None

