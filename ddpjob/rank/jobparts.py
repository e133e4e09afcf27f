"""The parts a Job (job.py) is built from, made in one place: the control group's collectives,
the loop's records (loopevents.py), the checkpoint store with its in-memory snapshots, the save
schedule, the deadline watch, the sample log, rank 0's metric log with its trackers, and ddpjob
verify's probe. The Job holds them and acts; this only builds them, in the order they need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpjob.config import JobConfig
from ddpjob.rank.loopevents import LoopEvents
from ddpjob.rank.records import MetricLog, SampleLog
from ddpjob.rank.trackers import Trackers
from ddpjob.rank.usertable import UserTable

if TYPE_CHECKING:  # torch behind them: loaded by build(), not at import
    from ddpjob.node.dist import Control
    from ddpjob.node.preemption import DeadlineWatch
    from ddpjob.rank.probe import Probe
    from ddpjob.store.schedule import SaveSchedule
    from ddpjob.store.state import StateStore


@dataclass
class Parts:
    control: Control
    events: LoopEvents
    store: StateStore
    schedule: SaveSchedule
    deadline: DeadlineWatch
    samples: SampleLog
    metrics: MetricLog | None  # rank 0's
    probe: Probe | None  # ddpjob verify's, when it runs this rank


def build(cfg: JobConfig, ctx: Any, run_dir: Path, stop: Any, user: UserTable, *, restart: int,
          end_time: float | None, code: Callable[[], tuple[str, tuple[str, ...]]] | None,
          allow_code_change: bool, from_scratch: bool) -> Parts:
    """A Job's parts (Job.__init__ documents the arguments). `ctx`: the rank's DistContext;
    `stop`: its stop flag, whose steps the hang watch follows from here on."""
    # torch loads here, not at import: `import ddpjob` stays light on a login node
    from ddpjob.node import dist, preemption
    from ddpjob.rank import probe
    from ddpjob.store import memsnap
    from ddpjob.store.schedule import SaveSchedule
    from ddpjob.store.state import StateStore

    env = ctx.env
    control = dist.Control(ctx)
    dist.watch_steps(stop)
    events = LoopEvents(cfg, env, run_dir, stop, control, user, restart=restart)
    store = StateStore(cfg, env, run_dir, control=control, restart=restart, code=code,
                       allow_code_change=allow_code_change, from_scratch=from_scratch,
                       snapshots=memsnap.for_rank(cfg, env, run_dir))
    schedule = SaveSchedule(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes)
    deadline = preemption.DeadlineWatch(end_time)
    samples = SampleLog(run_dir, rank=env.rank, restart=restart, world_size=env.world_size)
    metrics = MetricLog(
        run_dir, restart, job_id=env.job_id, textfile=cfg.train.metrics_textfile,
        trackers=Trackers(cfg, run_dir, job_id=env.job_id, attempt=restart) if cfg.train.trackers else None,
    ) if env.is_rank0 else None  # rank 0 writes them
    return Parts(control, events, store, schedule, deadline, samples, metrics,
                 probe.Probe.for_rank(env.ddpjob_vars, run_dir, env.rank, restart))
