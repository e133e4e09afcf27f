"""The Job: one rank's handle on the job, what `ddpjob.init()` returns (start.py builds it).

It wraps the model (DDP or FSDP2), resumes the newest checkpoint, runs the step loop with the
stop/save decision between steps (decide.py), writes the metric records and the sample log
(records.py), the final model and the COMPLETED marker, and tears the rank down. Its parts are
built by jobparts.py; what the loop records and says (the start, checkpoints, the stop and its
requeue) is loopevents.py's; a script run alone reports an uncaught error through
ownerror.Uncaught. A rank's exceptions leave through `explain()`, which the runner and a script
run alone both use.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, rundir, runlock
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.rank.usertable import UserTable


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
        from ddpjob.rank import jobparts, steptimer  # torch loads here, not at import (jobparts.build)

        self.config, self.env, self._ctx, self.run_dir, self._stop = cfg, ctx.env, ctx, run_dir, stop
        self.rank, self.local_rank = ctx.env.rank, ctx.env.local_rank
        self.world_size, self.device, self.is_rank0 = ctx.env.world_size, ctx.device, ctx.env.is_rank0
        self.user = UserTable(cfg.user)
        self.restart, self.job_id = restart, ctx.env.job_id  # restart: the attempt's number in the run (ledger/attempts.py)
        self.finished = False
        self.stopped_at: int | None = None
        self._step: int | None = None  # set by resume()
        self.resumed_world_size: int | None = None  # the checkpoint's, after resume()
        self._closed = False
        self.vote_s = 0.0
        self._load_s: float | None = None  # resume()'s, for the recovery's phases (ledger/phases.py)
        p = jobparts.build(cfg, ctx, run_dir, stop, self.user, restart=restart, end_time=end_time, code=code,
                           allow_code_change=allow_code_change, from_scratch=from_scratch)
        self._control, self._events, self._store = p.control, p.events, p.store
        self._schedule, self._deadline, self._samples, self._metrics = p.schedule, p.deadline, p.samples, p.metrics
        self._probe = p.probe  # ddpjob verify's
        self._timer = steptimer.for_job(self)  # each step's times, riding the vote; the speed watches
        # On GPUs the kernel choice decides both speed and whether a resume is bit-exact: say it.
        kernels = "" if self.device.type != "cuda" else (
            ", deterministic kernels (train.deterministic)" if cfg.train.deterministic
            else ", fastest kernels, cudnn.benchmark (train.deterministic = false: resumes not bit-exact)")
        console.print0(f"ddpjob run {run_dir}: {self.env.describe()}{kernels}")
        if standalone:  # no `ddpjob run` around: an uncaught error is reported, close() runs at exit
            from ddpjob.rank import ownerror

            ownerror.Uncaught(self)

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

    # ------------------------------------------------------------------ model
    def wrap(self, model: Any, **ddp_kwargs: Any) -> Any:
        """Move `model` to this rank's device and wrap it in DDP (when there are several ranks).
        With train.deterministic_reduce and more than 2 ranks the gradients are summed in rank
        order, so a resumed run adds them exactly as the uninterrupted one did; with
        train.grad_compression = "bf16" they travel as bfloat16.
        With train.strategy = "fsdp" the model is sharded in place instead (FSDP2 fully_shard
        on each child with parameters and on the root, node/fsdp.py) and returned: build the
        optimizer after wrap(). `ddp_kwargs` are DDP's only."""
        from ddpjob.node import gradsync

        model.to(self.device)
        if not self._ctx.initialized:
            return model  # one process: nothing to share or shard (the checkpoint layout still follows the strategy)
        if self.config.train.strategy == "fsdp":
            from ddpjob.node import fsdp

            if ddp_kwargs:
                raise DDPJobError(f"job.wrap() got DDP arguments {sorted(ddp_kwargs)} with train.strategy = "
                                  "\"fsdp\", expected none", "drop them, or use strategy = \"ddp\"")
            return fsdp.shard(model, self.config.train.amp)
        from ddpjob.node.ddpwrap import TimedDDP as DDP  # DDP, its pre-forward timed: rank/steptimer.py

        if self.device.type == "cuda":
            ddp_kwargs.setdefault("device_ids", [self.device.index])
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        ddp = DDP(model, **ddp_kwargs)
        self._ctx.hold(ddp)  # it lets go of the group at the end (DistContext._release)
        t = self.config.train
        gradsync.register_comm_hook(ddp, ordered=t.deterministic_reduce and self.world_size > 2,
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
        from ddpjob.node.sampler import StepSampler
        from ddpjob.rank import snapvote
        from ddpjob.rank.decide import Riders, StepDecider

        if self._step is None:
            self.resume(state)
        step = int(self._step or 0)
        self._events.started(step, self._load_s, info)
        self._store.restore_rng()  # last thing before the first step: see StateStore.restore_rng
        samplers = [o for o in state.values() if isinstance(o, StepSampler)]
        decider = StepDecider(self._control, stop=self._stop, schedule=self._schedule, deadline=self._deadline,
                              busy=self._store.busy, total=total, lag=int(self.config.train.stop_vote == "overlap"),
                              # the step times (no slots when the watch is off) and an "auto"
                              # snapshot interval (none when snapshots are off or fixed)
                              rider=Riders(self._timer, snapvote.for_snapshots(self._store.snapshots, self.rank)))
        self._stop.current_step = step
        try:
            while step < total:
                self._timer.step_started()
                if self._probe is not None:  # ddpjob verify: an interruption caused at this step
                    self._probe.at_step(step, self._stop, state)
                yield step
                self._timer.step_done(step + 1)
                step += 1
                self._step = step
                self._events.stepped(step)
                self._stop.current_step = step
                now = decider.after_step(step)
                if now.last:
                    break
                if not now.busy:
                    self._store.commit_pending()  # every rank's background write is done: the vote said so
                if now.stop:
                    self._events.signal(step)  # what this rank had when the vote said stop
                if now.save:
                    for s in samplers:
                        s.set_step(step)
                    self._events.before_checkpoint()
                    t0, decided = time.monotonic(), time.time()
                    self._store.save(step, state, blocking=bool(now.stop))
                    if self._metrics is not None:
                        self._metrics.saved(step)  # what a resume from this checkpoint keeps is on disk
                    decider.saved(time.monotonic() - t0)
                    if not now.stop:  # a stop's save is the ledger's "stop and save" already
                        self._events.checkpoint(step, time.monotonic() - t0)
                if now.stop:
                    self.stopped_at = step
                    self._events.stop_for_requeue(step, now.stop, lag=decider.lag, decided_time=decided,
                                                  saved_time=time.time())  # raises StopForRequeue
                elif self._store.snapshot_due(step):  # node-local memory ("auto": its interval came with the vote)
                    for s in samplers:
                        s.set_step(step)
                    t0 = time.monotonic()
                    self._store.snapshot(step, state)
                    self._events.snapshot_s += time.monotonic() - t0
                decider.next_step(step)
        finally:
            self.vote_s += decider.vote_s
        decider.close()  # every rank reads the last vote: the groups stay in step
        for s in samplers:
            s.set_step(step)
        self._events.before_checkpoint()
        t0 = time.monotonic()
        self._store.save(step, state, blocking=True)
        self._events.checkpoint(step, time.monotonic() - t0)
        if self._metrics is not None:
            self._metrics.saved(step)
        if self._probe is not None:
            self._probe.at_end(state)

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
        from ddpjob.node import modelsync
        from ddpjob.store.statecheck import plain_module

        modelsync.broadcast_buffers(plain_module(model))

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
        from ddpjob.node import fsdp, modelsync
        from ddpjob.store.statecheck import plain_module, plain_state_dict

        self._store.finish_pending()
        step = self._step if self._step is not None else 0
        self._events.signal(step)
        weights: dict[str, Any] | None = None
        if model is not None and fsdp.is_sharded(plain_module(model)):
            weights = modelsync.full_state_dict(plain_module(model))  # every rank: its shards to rank 0
        if self.is_rank0:
            if model is not None:
                import torch

                final = self.run_dir / rundir.FINAL
                final.mkdir(exist_ok=True)
                weights = plain_state_dict(model) if weights is None else weights
                fileio.write_atomic(final / "model.pt", lambda f: torch.save(weights, f))
            rundir.mark_completed(self.run_dir, step=step, **info)
        self._events.finished(step, info)
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
        self._events.exited(self.stopped_at)  # the end of the recovery's exit phase
        if self._lock is not None:  # after the last record: the run dir is free for the next job
            self._lock.release()
        if self._on_close is not None:
            self._on_close(self)
        # The interpreter's final garbage collection walks torch's module graph: seconds per
        # rank at every exit. Everything is closed and flushed by now.
        gc.freeze()


