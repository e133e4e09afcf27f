"""The Job: one rank's handle on the job, what `ddpjob.init()` returns (start.py builds it).

It wraps the model (DDP or FSDP2), resumes the newest checkpoint, runs the step loop with the
stop/save decision between steps (decide.py), writes the metric records and the sample log
(records.py), the final model and the COMPLETED marker, and tears the rank down. A rank's
exceptions leave through `explain()`, which the runner and a script run alone both use.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ddpjob import console, exitcodes, fileio, rundir, runlock
from ddpjob.ledger import events, requests
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.rank.records import MetricLog, SampleLog
from ddpjob.rank.trackers import Trackers
from ddpjob.rank.usertable import UserTable


class StopForRequeue(SystemExit):
    """Raised out of `job.steps()` once every rank agreed to stop and the checkpoint is written:
    the process ends with exitcodes.REQUEUE (3). A SystemExit, so `except Exception` in user code
    lets it through and `finally` blocks still run."""

    def __init__(self, step: int) -> None:
        super().__init__(exitcodes.REQUEUE)
        self.step = step


class Job:
    """One rank's handle on the job. Attributes: rank, local_rank, world_size, device, run_dir,
    is_rank0, config (the JobConfig; `config.user` is the job file's [user] table), user."""

    def __init__(self, cfg: JobConfig, ctx: Any, run_dir: Path, stop: Any, *, standalone: bool,
                 restart: int = 0, lock: runlock.RunLock | None = None, end_time: float | None = None,
                 code: Callable[[], tuple[str, tuple[str, ...]]] | None = None,
                 allow_code_change: bool = False, from_scratch: bool = False,
                 on_close: Callable[[Job], None] | None = None) -> None:
        """`end_time`: the allocation's end, for the deadline watch; `code`: the hash of the
        code this rank runs (for the checkpoints' code check); `allow_code_change`,
        `from_scratch`: `ddpjob run`'s flags; `on_close`: told when close() ran."""
        self._standalone, self._lock, self._on_close = standalone, lock, on_close
        # torch loads here, not at import: `import ddpjob` stays light on a login node
        from ddpjob.node import dist, preemption
        from ddpjob.rank import probe, straggler
        from ddpjob.store import memsnap
        from ddpjob.store.schedule import SaveSchedule
        from ddpjob.store.state import StateStore

        self.config, self.env, self._ctx, self.run_dir, self._stop = cfg, ctx.env, ctx, run_dir, stop
        self.rank, self.local_rank = ctx.env.rank, ctx.env.local_rank
        self.world_size, self.device, self.is_rank0 = ctx.env.world_size, ctx.device, ctx.env.is_rank0
        self.user = UserTable(cfg.user)
        self._checked_user = False  # the [user] keys never read: said once, before the first checkpoint
        self.restart, self.job_id = restart, ctx.env.job_id  # restart: the attempt's number in the run (ledger/attempts.py)
        self.finished = False
        self.stopped_at: int | None = None
        self._control = dist.Control(ctx)
        dist.watch_steps(stop)
        c = cfg.checkpoint
        self._store = StateStore(run_dir / rundir.CHECKPOINTS, keep_last=c.keep_last,
                                 config_hash=cfg.hash(), async_save=c.async_save, rank=self.rank,
                                 world_size=self.world_size, restart=self.restart,
                                 job_id=self.job_id, control=self._control,
                                 init_from=c.init_from, init_keys=c.init_keys,
                                 code=code, allow_code_change=allow_code_change, from_scratch=from_scratch,
                                 sharded=cfg.train.strategy == "fsdp",
                                 snapshots=memsnap.for_rank(cfg, ctx.env, run_dir), identity=cfg.identity())
        self._schedule = SaveSchedule(c.every_steps, c.every_minutes)
        self._deadline = preemption.DeadlineWatch(end_time)
        self._step: int | None = None  # set by resume()
        self.resumed_world_size: int | None = None  # the checkpoint's, after resume()
        self._samples = SampleLog(run_dir, rank=self.rank, restart=restart, world_size=self.world_size)
        self._metrics = MetricLog(
            run_dir, restart, job_id=self.job_id, textfile=cfg.train.metrics_textfile,
            trackers=Trackers(cfg, run_dir, job_id=self.job_id, attempt=restart) if cfg.train.trackers else None,
        ) if self.is_rank0 else None  # rank 0 writes them
        self._closed = False
        self.vote_s = 0.0
        self._snapshot_s = 0.0  # the in-memory snapshots' hold on the loop since the last checkpoint record
        self._load_s: float | None = None  # resume()'s, for the recovery's phases (ledger/phases.py)
        self._timer = straggler.for_job(self)  # each step's work and data wait, riding the vote
        self._probe = probe.Probe.for_rank(ctx.env.ddpjob_vars, run_dir, self.rank, restart)  # ddpjob verify's
        # On GPUs the kernel choice decides both speed and whether a resume is bit-exact: say it.
        kernels = "" if self.device.type != "cuda" else (
            ", deterministic kernels (train.deterministic)" if cfg.train.deterministic
            else ", fastest kernels, cudnn.benchmark (train.deterministic = false: resumes not bit-exact)")
        console.print0(f"ddpjob run {run_dir}: {self.env.describe()}{kernels}")
        self._uncaught: int | None = None  # the exit status of an uncaught error (scripts run alone)
        if standalone:
            atexit.register(self._at_exit)
            self._excepthook = sys.excepthook
            sys.excepthook = self._report_uncaught

    @property
    def current_step(self) -> int | None:
        """The optimizer steps done so far in this attempt's loop (None before resume())."""
        return self._step

    def explain(self, exc: BaseException) -> BaseException:
        """What to report for an exception that ends this rank: a failed collective in the
        training code becomes one line naming the ranks that did not arrive (node/hang.py)."""
        from ddpjob.node import determinism, dist

        # The hang watch first: it tells the peers waiting for this rank what ended it.
        reported = dist.explain_failure(exc)
        return determinism.explain(exc) if reported is exc else reported

    def _report_uncaught(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        # A script run alone (no `ddpjob run` around it): Python prints the traceback, then the line.
        self._excepthook(kind, exc, tb)
        explained = self.explain(exc)
        if isinstance(explained, DDPJobError):
            print(explained.line(), file=sys.stderr, flush=True)
        self._uncaught = 130 if issubclass(kind, KeyboardInterrupt) else 1

    def _at_exit(self) -> None:
        """Scripts run alone. After an uncaught error this rank failed alone: its peers wait for
        it inside some collective, not in close()'s exit barrier, which would hold this process
        for the whole dist_timeout_s (300 s) so that torchrun or srun could not end the job
        before then. So: no barrier, and no interpreter teardown with the group left standing
        (dist.end_if_left_standing), as `ddpjob run` does."""
        self.close(failed=self._uncaught is not None)
        if self._uncaught is not None:
            from ddpjob.node import dist

            dist.end_if_left_standing(self._uncaught)

    # ------------------------------------------------------------------ model
    def wrap(self, model: Any, **ddp_kwargs: Any) -> Any:
        """Move `model` to this rank's device and wrap it in DDP (when there are several ranks).
        With train.deterministic_reduce and more than 2 ranks the gradients are summed in rank
        order, so a resumed run adds them exactly as the uninterrupted one did; with
        train.grad_compression = "bf16" they travel as bfloat16.
        With train.strategy = "fsdp" the model is sharded in place instead (FSDP2 fully_shard
        on each child with parameters and on the root, node/fsdp.py) and returned: build the
        optimizer after wrap(). `ddp_kwargs` are DDP's only."""
        from ddpjob.node import dist

        model.to(self.device)
        if not self._ctx.initialized:
            return model  # one process: nothing to share or shard (the checkpoint layout still follows the strategy)
        if self.config.train.strategy == "fsdp":
            from ddpjob.node import fsdp

            if ddp_kwargs:
                raise DDPJobError(f"job.wrap() got DDP arguments {sorted(ddp_kwargs)} with train.strategy = "
                                  "\"fsdp\", expected none", "drop them, or use strategy = \"ddp\"")
            return fsdp.shard(model, self.config.train.amp)
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        ddp = DDP(model, **ddp_kwargs)
        self._ctx.hold(ddp)  # it lets go of the group at the end (DistContext._release)
        t = self.config.train
        dist.register_comm_hook(ddp, ordered=t.deterministic_reduce and self.world_size > 2,
                                compression=t.grad_compression)
        self._timer.watch_forward(ddp, model)
        return ddp

    def timed(self, batches: Any) -> Iterator[Any]:
        """Yield from `batches`, counting the wait for each as this step's data wait: the
        straggler watch then tells a slow loader from a slow rank (rank/straggler.py)."""
        from ddpjob.node.metrics import timed_fetches

        return timed_fetches(batches, self._timer.fetched)

    # ------------------------------------------------------------------ resume / steps
    def resume(self, state: dict[str, Any], *, seed: int | None = None) -> int:
        """Load the newest valid checkpoint into `state` (objects in place, plain values replaced
        in the dict) and return the step to continue from (0 for a fresh run). Every RNG of
        this rank (CPU, CUDA, numpy, random) is restored when `steps()` starts the loop (a fresh
        run's are seeded from (seed, rank)). Call it after building model and data."""
        from ddpjob.node.sampler import StepSampler
        from ddpjob.rank import checks

        if self._step is None:  # the first call: what would make a resume differ
            from ddpjob.node import dist

            # the user's own objects as built: one that differs between the ranks is per rank
            every = dist.all_gather_object(checks.own_digests(state), what="job.resume()'s look at the state",
                                           group=self._control.group)
            if self.is_rank0:
                for gap in checks.state_gaps(state) + checks.differing(every):
                    console.warn(gap)
        seed = self.config.train.seed if seed is None else int(seed)
        t0 = time.monotonic()
        step = self._store.resume(state, enabled=self.config.checkpoint.resume, seed=seed)
        self._load_s = round(time.monotonic() - t0, 3)
        old_world = self._store.resumed_meta.get("world_size")
        self.resumed_world_size = old_world if step else None
        if step and old_world not in (None, self.world_size):
            console.print0(f"resumed at another world size: {old_world} -> {self.world_size} ranks "
                           f"(step {step})")
        for obj in state.values():
            if isinstance(obj, StepSampler):
                obj.set_step(step)
        self._step = step
        if self.config.train.tensorboard and self._metrics is not None:
            self._metrics.open_tensorboard(step)
        return step

    def steps(self, state: dict[str, Any], total: int, **info: Any) -> Iterator[int]:
        """Optimizer-step numbers from the resumed step to `total` - 1. Between two steps every
        rank votes (one small all-reduce) on stopping and on a due checkpoint; when they agree to
        stop, the checkpoint is written, the requeue decided and the process ends with
        exitcodes.REQUEUE (StopForRequeue). After the last step a final checkpoint is written.
        With train.stop_vote = "overlap" (default) the vote started after step s is read after
        step s+1, so no step waits for it: a stop request lands one step later.
        `info` (plain values) joins this start's record in events.jsonl, e.g. accumulation=4."""
        from ddpjob.node import compilecache
        from ddpjob.node.sampler import StepSampler
        from ddpjob.rank.decide import StepDecider

        if self._step is None:
            self.resume(state)
        step = int(self._step or 0)
        if self.is_rank0:
            from ddpjob.node import warmserver
            from ddpjob.node.cluster import process_started

            if warmserver.FORKED in self.env.ddpjob_vars:  # forked by the node's warm-start server
                info = {"warm": True, **info}
            events.record(self.run_dir, "start", restart=self.restart, job_id=self.job_id,
                                world_size=self.world_size, source=self.env.source,
                                host=self.env.hostname, resumed_step=step or None,
                                launched_time=process_started(), load_s=self._load_s, **info)
        first_step = self.is_rank0  # rank 0 records when the first step of this attempt ends
        self._store.restore_rng()  # last thing before the first step: see StateStore.restore_rng
        samplers = [o for o in state.values() if isinstance(o, StepSampler)]
        decider = StepDecider(self._control, stop=self._stop, schedule=self._schedule, deadline=self._deadline,
                              busy=self._store.busy, total=total, lag=int(self.config.train.stop_vote == "overlap"),
                              rider=self._timer)  # no slots when the watch is off: nothing rides
        self._stop.current_step = step
        try:
            while step < total:
                self._timer.step_started()
                if self._probe is not None:  # ddpjob verify: an interruption caused at this step
                    self._probe.at_step(step, self._stop)
                yield step
                self._timer.step_done()
                step += 1
                self._step = step
                if first_step:  # the recovery's last phase ends here (ledger/phases.py)
                    graphs = compilecache.graphs()  # torch.compile's work is in this first step
                    events.record(self.run_dir, "first_step", step=step, job_id=self.job_id,
                                        restart=self.restart, **({"graphs": graphs} if graphs else {}))
                    first_step = False
                self._stop.current_step = step
                now = decider.after_step(step)
                if now.last:
                    break
                if not now.busy:
                    self._store.commit_pending()  # every rank's background write is done: the vote said so
                if now.save:
                    for s in samplers:
                        s.set_step(step)
                    self._before_checkpoint()
                    t0, decided = time.monotonic(), time.time()
                    self._store.save(step, state, blocking=bool(now.stop))
                    if self._metrics is not None:
                        self._metrics.saved(step)  # what a resume from this checkpoint keeps is on disk
                    decider.saved(time.monotonic() - t0)
                    if not now.stop:  # a stop's save is the ledger's "stop and save" already
                        self._record_checkpoint(step, time.monotonic() - t0)
                if now.stop:
                    self._stop_for_requeue(step, now.stop, lag=decider.lag, decided_time=decided,
                                           saved_time=time.time())
                elif self._store.snapshot_due(step):  # node-local memory (a collective once, for "auto")
                    for s in samplers:
                        s.set_step(step)
                    t0 = time.monotonic()
                    self._store.snapshot(step, state)
                    self._snapshot_s += time.monotonic() - t0
                decider.next_step(step)
        finally:
            self.vote_s += decider.vote_s
        decider.close()  # every rank reads the last vote: the groups stay in step
        for s in samplers:
            s.set_step(step)
        self._before_checkpoint()
        t0 = time.monotonic()
        self._store.save(step, state, blocking=True)
        self._record_checkpoint(step, time.monotonic() - t0)
        if self._metrics is not None:
            self._metrics.saved(step)
        if self._probe is not None:
            self._probe.at_end(state)

    def _before_checkpoint(self) -> None:
        """Rank 0, before the first checkpoint: the [user] keys the script has not read by now
        change nothing (a typo trains at the script's default), said while there is time to stop."""
        if self._checked_user or not self.is_rank0:
            return
        self._checked_user = True
        from ddpjob.rank import checks

        line = checks.unread_user_keys(dict.keys(self.user), self.user.read)
        if line:
            console.warn(line)

    def _record_checkpoint(self, step: int, block_s: float) -> None:
        """Rank 0, after a save: how long it held the loop, and the in-memory snapshots' hold
        since the last record (the goodput ledger, ledger/goodput.py). One line per checkpoint,
        nothing per step."""
        if self.is_rank0:
            events.record(self.run_dir, "checkpoint", step=step, job_id=self.job_id, restart=self.restart,
                                block_s=round(block_s, 4), snapshot_s=round(self._snapshot_s, 4))
        self._snapshot_s = 0.0

    def _stop_for_requeue(self, step: int, code: int, *, lag: int, **times: float) -> None:
        from ddpjob.node import preemption
        from ddpjob.rank import requeue

        self.stopped_at = step
        self._record_signal(step)
        mine = f"; this rank got {self._stop.describe()}" if self._stop.signum is not None else ""
        if self.is_rank0 and code == preemption.REQUEUE and requests.stop_requested(self.run_dir, self.job_id):
            # the checkpoint signal came from `ddpjob stop`: no requeue follows (requeue.after_stop)
            console.print0(f"stopping at step {step} (`ddpjob stop`{mine}): checkpoint written, not requeued")
        else:
            console.print0(f"stopping at step {step} ({preemption.REASONS[code]}{mine}): checkpoint written")
        if self.is_rank0:
            requeue.after_stop(self.config, self.env, self.run_dir, code, step, restart=self.restart,
                               signal_step=self._stop.signal_step, signal_time=self._stop.time,
                               lag=lag, times=times)
        # nobody exits (srun --kill-on-bad-exit) before rank 0 requeued
        self._control.barrier("the barrier after the requeue decision")
        raise StopForRequeue(step)

    def _record_signal(self, step: int) -> None:
        import signal

        if self._stop.signum is not None:  # per rank: which signal reached it, and when
            events.record(self.run_dir, "signal", rank=self.rank,
                                signal=signal.Signals(self._stop.signum).name,
                                at_step=self._stop.signal_step, stop_step=step,
                                signal_time=self._stop.time,
                                job_id=self.job_id, restart=self.restart)

    # ------------------------------------------------------------------ records
    def all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        """`tensor` summed ("sum"), averaged ("mean") or maximised ("max") over the ranks, in
        place; returns it. A collective: every rank calls it."""
        from ddpjob.node import dist

        if op not in ("sum", "mean", "max"):
            raise DDPJobError(f"all_reduce op {op!r} is unknown, expected sum, mean or max", "use op=\"sum\"")
        return dist.all_reduce_(tensor, op, what="job.all_reduce()")

    def broadcast_buffers(self, model: Any) -> None:
        """Rank 0's buffers (BatchNorm running statistics) on every rank, e.g. before an
        evaluation, so that every rank evaluates the same model. A collective."""
        from ddpjob.node import dist
        from ddpjob.store.state import plain_module

        dist.broadcast_buffers(plain_module(model))

    def log(self, step: int, *, average: bool | Sequence[str] = False, **scalars: Any) -> dict[str, Any]:
        """Rank 0 appends {step, restart, time, **scalars} to RUN_DIR/metrics.jsonl (what
        `ddpjob plot` and `status` read; names starting with eval_ make an eval record).
        `average=True` (or a list of names) first averages those values over the ranks (one
        all-reduce): a collective, so every rank must call log() at that step. Returns the
        values as logged (tensors read with .item(), which waits for the device)."""
        import torch

        from ddpjob.rank import checks

        checks.scalars(scalars)
        names = list(scalars) if average is True else list(average or ())
        if names:
            values = [float(torch.as_tensor(scalars[n]).detach().to(torch.float64)) for n in names]
            scalars.update(zip(names, self._control.mean(values, what="job.log()'s average")))
        record = {name: (v.item() if hasattr(v, "item") else v) for name, v in scalars.items()}
        if self._metrics is not None:
            self._metrics.write(step, record)
        return record

    def log_samples(self, step: int, epoch: int, ids: Any) -> None:
        """This rank's global sample ids of optimizer step `step` (1-based: the step just done)
        to RUN_DIR/samples/rank-R.jsonl, for exactly-once-per-epoch checks across requeues.
        Steps replayed after a kill are appended again: readers keep the newest restart's."""
        self._samples.write(step, epoch, ids)

    def finish(self, model: Any = None, **info: Any) -> None:
        """The end of training: RUN_DIR/final/model.pt (a plain state_dict, no `module.`
        prefixes; a sharded model gathered whole) and the COMPLETED marker with `info` (e.g.
        accuracy=0.93). Collective."""
        from ddpjob.node import dist, fsdp
        from ddpjob.store.state import plain_module, plain_state_dict

        self._store.finish_pending()
        step = self._step if self._step is not None else 0
        self._record_signal(step)
        weights: dict[str, Any] | None = None
        if model is not None and fsdp.is_sharded(plain_module(model)):
            weights = dist.full_state_dict(plain_module(model))  # every rank: its shards to rank 0
        if self.is_rank0:
            if model is not None:
                import torch

                final = self.run_dir / rundir.FINAL
                final.mkdir(exist_ok=True)
                weights = plain_state_dict(model) if weights is None else weights
                fileio.write_atomic(final / "model.pt", lambda f: torch.save(weights, f))
            rundir.mark_completed(self.run_dir, step=step, **info)
            events.record(self.run_dir, "stop", reason="finished", step=step, job_id=self.job_id,
                                restart=self.restart, **{k: v for k, v in info.items() if k == "accuracy"})
        self._control.barrier("job.finish()")
        self.finished = True

    # ------------------------------------------------------------------ teardown
    def close(self, failed: bool = False) -> None:
        """Tear the process group down (ddpjob run does it; atexit for scripts run alone)."""
        if self._closed:
            return
        self._closed = True
        self._samples.close()
        if self._metrics is not None:
            self._metrics.close("finished" if self.finished else "stopped" if self.stopped_at is not None and not failed
                                else "failed")
        if self._standalone:
            self._stop.uninstall()  # ddpjob run installed its own and removes it itself
        snaps = self._store.snapshots
        if snaps is not None:
            snaps.close()
        # After a failure the peers are stuck in some collective, not in our exit barrier.
        self._ctx.destroy(barrier_timeout_s=None if failed else 30.0)
        if snaps is not None and not failed and self.local_rank == 0:
            # finished, or stopped with a checkpoint newer than any snapshot: past the exit
            # barrier every rank of this node is done with them
            from ddpjob.store import memsnap

            memsnap.remove_job(self.run_dir, self.job_id, memsnap.base_of(self.config))
        if self.is_rank0 and self.stopped_at is not None:  # the end of the recovery's exit phase
            events.record(self.run_dir, "exit", step=self.stopped_at, job_id=self.job_id,
                                restart=self.restart)
        if self._lock is not None:  # after the last record: the run dir is free for the next job
            self._lock.release()
        if self._on_close is not None:
            self._on_close(self)
        # The interpreter's final garbage collection walks torch's module graph: seconds per
        # rank at every exit. Everything is closed and flushed by now.
        gc.freeze()


