"""Checkpointing a dict of state objects: what `job.resume(state)` loads and `job.steps()` saves.

A state is a dict like torchtitan's: values with `state_dict`/`load_state_dict` (model, optimizer,
LR scheduler, GradScaler, StepSampler, the user's own objects) and plain values (numbers,
strings, tensors, lists and dicts of them). A checkpoint `step-N/` holds `<key>.pt` for each
stateful value and `values.pt` for the plain ones, and `rank-<R>.pt` with every RNG of each rank.
Rank 0 writes the models and the rest, ranks 1.. the optimizers (DDP keeps those equal on every
rank: writers()); their sha256 reach rank 0 in one gather. Loads use weights_only=True. With
`train.strategy = "fsdp"` the models and optimizers go through DCP instead (sharded.py): every
rank writes its shards into the same staging folder, and the manifest covers them all. The
save's stages after the plan (stage, sink, agree, commit) are pipeline.py's.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ddpjob import rundir
from ddpjob.ledger import events
from ddpjob.console import print0
from ddpjob.errors import DDPJobError
from ddpjob.node import dist
from ddpjob.store import memsnap, perrank, rng, sharded
from ddpjob.store.commit import CheckpointInfo, CheckpointStore
from ddpjob.store.pipeline import Plan, SavePipeline
from ddpjob.store.source import Source
from ddpjob.store.statecheck import _code_inside, _plain, _stateful, _target, check_state, seed_for

if TYPE_CHECKING:
    from ddpjob.config import JobConfig
    from ddpjob.node.cluster import ClusterEnv

State = MutableMapping[str, Any]


class StateStore:
    """Resume and collective saves (blocking or async) of one state dict, for one process."""

    def __init__(self, cfg: JobConfig, env: ClusterEnv, run_dir: Path, *, control: dist.Control, restart: int,
                 code: Callable[[], tuple[str, tuple[str, ...]]] | None = None, allow_code_change: bool = False,
                 from_scratch: bool = False, snapshots: memsnap.Snapshots | None = None) -> None:
        """The store of RUN_DIR/checkpoints as `cfg` says: its [checkpoint] section (keep_last,
        async, init_from, init_keys), train.strategy and the config's hash; this rank's place
        from `env`. `snapshots`: this rank's in-memory ones, memsnap.for_rank() (a caller that
        wants none passes none: the config's default "auto" would make them)."""
        c = cfg.checkpoint
        self.store = CheckpointStore(run_dir / rundir.CHECKPOINTS, keep_last=c.keep_last, config_hash=cfg.hash())
        # what config_hash is taken of (JobConfig.identity()), in each manifest: a checkpoint of
        # another config is then refused naming the keys that differ
        self.identity = cfg.identity()
        self.sharded = cfg.train.strategy == "fsdp"  # models and optimizers through DCP
        # checkpoint.snapshot_every: this rank's in-memory copies (memsnap.py); not with fsdp
        self.snapshots = None if self.sharded else snapshots
        self.init_from, self.init_keys = c.init_from, c.init_keys
        # (hash of the code this process runs, hashes it accepts): ddpjob/freeze.py. Asked on
        # rank 0 only, once (it may hash a repository); None: not checked (tests, benchmarks).
        self._code = code
        self._code_hash: tuple[str, tuple[str, ...]] | None = None
        self.allow_code_change = allow_code_change
        self.from_scratch = from_scratch  # checkpoints none of which resumes: moved aside, step 0
        self.async_save = c.async_save
        self.rank, self.world_size, self.restart, self.job_id = env.rank, env.world_size, restart, env.job_id
        self.control = control
        # Same staging name on every rank, new for each (re)start: a folder left by a killed
        # incarnation (half-written .tmp files) is never reused.
        token = dist.broadcast_object(secrets.token_hex(4) if self.rank == 0 else None,
                                     what="the checkpoint store's start")
        self.attempt = f"r{restart}-{token}"
        self.saved_step: int | None = None
        self.resumed_meta: dict[str, Any] = {}
        self._rng: dict[str, Any] | None = None
        self._rng_seed = (0, 0)
        self._pipe = SavePipeline(self.store, control, self.rank)

    # ---------------------------------------------------------------- resume
    def resume(self, state: State, *, enabled: bool, seed: int) -> int:
        """Load the newest valid checkpoint into `state` (in place) and this rank's saved RNG
        states (put in place by restore_rng()); returns its step, or 0."""
        check_state(state)
        units = self._units(state)  # every rank: a state DCP cannot take stops them all alike
        info = None
        if enabled:
            # latest() hashes whole checkpoints: rank 0 does it, the others get the answer. A
            # checkpoint that verifies but does not load is skipped like a damaged one.
            info = dist.rank0_decides(self.rank == 0, lambda: self._pick(state, sharded.keys(units)),
                                      what="the choice of the checkpoint to resume from")
        source = None if info is None else Source.of(self.store, info)
        if self.snapshots is not None and enabled:
            snap = self._newest_snapshot(state, None if info is None else info.step)
            self.snapshots.resumed(None if snap is None else snap.step)
            source = snap or source
        self._rng_seed = (seed, 0 if source is None else source.step)
        if source is None:
            if self.init_from:
                from ddpjob.store import initfrom

                initfrom.load(state, self.init_from, self.init_keys, self.rank, _target)
            return 0
        if units:
            assert info is not None  # fsdp: never from a snapshot
            sharded.load(info.path, units, self.control)
        self._load_into(state, source, skip=set(sharded.keys(units)))
        rng_file = f"rank-{self.rank}.pt"
        if rng_file in source.files:
            self._rng = source.read(rng_file)
        fresh = perrank.restore(state, self._rng, where=source.where)
        old_world = source.manifest.get("world_size")
        if perrank.keys(state) and isinstance(old_world, int) and old_world != self.world_size:
            print0(perrank.resize_line(perrank.keys(state), old_world, self.world_size))
        elif fresh and self.rank == 0:  # a checkpoint from before the value was per rank
            print0(f"{', '.join(f'state[{k!r}]' for k in fresh)} (per rank): {source.name} holds none, "
                   "every rank starts from its object as built")
        self.saved_step = source.step
        self.resumed_meta = dict(source.manifest)
        print0(f"resumed from {source.name} (step {source.step}, restart {self.restart})")
        return source.step

    def _newest_snapshot(self, state: State, durable: int | None) -> Source | None:
        """Collective: the newest in-memory snapshot, newer than the durable checkpoint
        `durable`, from which every rank can have all of its state, from its own folder or a
        peer's (peers.py: a rank on a spare node holds none); None otherwise (a requeue onto
        other nodes finds none)."""
        from ddpjob.store import peers

        assert self.snapshots is not None
        needs = [f"{k}.pt" for k, v in state.items() if _stateful(v)] + [f"rank-{self.rank}.pt"]
        needs += ["values.pt"] if any(_plain(v) for v in state.values()) else []
        return peers.newest(self.snapshots, needs, durable, self.rank, self.control)

    def snapshot_due(self, step: int) -> bool:
        """Whether this step's in-memory snapshot is due (no collective). Every rank calls it
        at the same steps (every step the loop does not stop at); with snapshot_every = "auto"
        it measures the steps, and the interval arrives with the per-step vote
        (rank/snapvote.py), read at the same step on every rank."""
        snaps = self.snapshots
        if snaps is None:
            return False
        snaps.observe(step)
        return snaps.due(step, saved=self.saved_step == step)

    def snapshot(self, step: int, state: State) -> None:
        """This rank's whole state into node-local memory, written in the background: its own
        replica of every stateful key, its RNG streams, the plain values, and the RNG streams
        of the ranks on another node it keeps copies for (a collective: peers.copies)."""
        from ddpjob.store import peers

        assert self.snapshots is not None
        files = self._files(state, [], whole=True)
        started = time.perf_counter()
        if self.world_size > 1:
            files.update(peers.copies(self.snapshots, self.rank, files[f"rank-{self.rank}.pt"], self.control.group))
        self.snapshots.take(step, files, self._meta(step, {"snapshot": True}),
                            held_s=time.perf_counter() - started)

    def _units(self, state: State) -> list[sharded.Unit]:
        """With fsdp: the state's models and their optimizers, which go through DCP."""
        return sharded.units({k: _target(v) for k, v in state.items()}) if self.sharded else []

    def _pick(self, state: State, dcp_keys: list[str]) -> CheckpointInfo | None:
        """Rank 0: the newest checkpoint that verifies, fits the state and holds no code. When
        there are checkpoints and none of them will do, the start is refused (days of training
        are not thrown away without a word), unless --from-scratch, which moves them aside."""
        rejected: list[tuple[CheckpointInfo, str]] = []
        for info in self.store.list():
            reason = self.store.verify(info)
            written = info.manifest.get("config")
            if reason and "config hash" in reason and isinstance(written, dict):
                from ddpjob.config import identity_differences

                reason += f": {'; '.join(identity_differences(written, self.identity))[:400]}"
            if reason is None:
                files, in_dcp = info.manifest.get("files", {}), info.manifest.get("sharded", [])
                missing = [f"{k}.pt" for k, v in state.items()
                           if _stateful(v) and k not in dcp_keys and f"{k}.pt" not in files]
                missing += [f"sharded '{k}'" for k in dcp_keys
                            if k not in in_dcp or sharded.METADATA not in files]
                if missing:
                    reason = f"it has no {', '.join(missing)} (saved by another state layout)"
            if reason is None and (code := _code_inside(info)):
                # it verifies: its manifest was rewritten to match. Never loaded (weights_only);
                # skipped like a damaged one, and said where the run's history is kept
                reason = f"it holds code, not only tensors ({code}): someone wrote into the run dir"
                events.record(self.store.root.parent, "checkpoint_rejected", step=info.step,
                                    reason=reason, job_id=self.job_id, restart=self.restart)
            if reason is None:
                self._check_code(info)
                print0(f"resuming from step-{info.step}")
                return info
            print0(f"skipping step-{info.step}: {reason}")
            rejected.append((info, reason))
        if rejected and not self.from_scratch:
            why = "; ".join(f"{info.path.name}: {reason}" for info, reason in rejected[:3])
            why += f"; and {len(rejected) - 3} more" if len(rejected) > 3 else ""
            raise DDPJobError(f"{self.store.root} holds {len(rejected)} checkpoint(s) and none can be resumed "
                              f"({why}), expected one this run can continue from",
                              "find out why (`ddpjob status RUN_DIR`); to train from step 0 all the same, "
                              "`ddpjob run RUN_DIR --from-scratch` moves them to checkpoints/rejected/")
        for info, _ in rejected:  # never written over by the new run's step-N
            aside = self.store.root / "rejected" / f"{info.path.name}-{self.attempt}"
            aside.parent.mkdir(exist_ok=True)
            info.path.rename(aside)
            print0(f"--from-scratch: {info.path.name} moved to {aside}")
        return None

    def _load_into(self, state: State, source: Source, skip: set[str]) -> None:
        values = source.read("values.pt") if "values.pt" in source.files else {}
        for key, obj in list(state.items()):
            if key in skip:
                continue  # loaded through DCP
            if _stateful(obj):
                loaded = source.read(f"{key}.pt")
                try:
                    _target(obj).load_state_dict(loaded)
                except DDPJobError:
                    raise
                except (RuntimeError, KeyError, ValueError, TypeError) as err:
                    raise DDPJobError(
                        f"state '{key}' in {source.where} does not fit this run's {type(obj).__name__} "
                        f"({' '.join(str(err).split())[:200]})",
                        "resume with the same model and optimizer setup, or use a new run dir") from None
            elif key in values:
                state[key] = values[key]

    def restore_rng(self) -> None:
        """This rank's RNG streams as saved, or seeded from (seed, rank, step) when starting fresh
        or when the checkpoint has none for this rank (the job grew). Called when the loop
        starts, not in resume(): making a DataLoader iterator between the two draws a seed from
        the global RNG, which the uninterrupted run drew before its first step too."""
        if self._rng is not None:
            rng.restore_rng_state(self._rng)
            self._rng = None
            return
        seed, step = self._rng_seed
        s = seed_for(seed, "rank", self.rank, step)
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s)

    # ---------------------------------------------------------------- saving
    def writers(self, state: State, skip: list[str]) -> dict[str, int]:
        """Which rank writes each `<key>.pt`: the optimizers round robin over ranks 1.., the rest
        rank 0. Splitting the write halves the CPU a checkpoint takes from rank 0's training (on
        the benchmark VM most of it is the kernel handing out page-cache pages, the sha256 and
        the serialisation, all per byte). Only optimizers move: their state comes from the
        all-reduced gradients, so every rank holds the same bits (DDP), whereas a model's
        buffers (BatchNorm statistics) are each rank's own until DDP's next forward broadcasts
        rank 0's, and a resume must load rank 0's to continue bit for bit. Decided from keys
        and types only, so every rank draws the same plan without asking the others."""
        plan = {key: 0 for key, obj in state.items() if key not in skip and _stateful(obj)}
        if self.world_size > 1:
            movable = sorted(k for k in plan if isinstance(state[k], torch.optim.Optimizer)
                             and type(state[k]).__name__ != "ZeroRedundancyOptimizer")  # sharded state
            for i, key in enumerate(movable):
                plan[key] = 1 + i % (self.world_size - 1)
        return plan

    def _files(self, state: State, skip: list[str], whole: bool = False) -> dict[str, Any]:
        """The files this rank writes: its RNG streams, the stateful keys writers() gives it and,
        on rank 0, values.pt; `whole` (a snapshot): every key and the values, from this rank."""
        # the rank's RNG streams and its per-rank values: both resume by rank number
        files: dict[str, Any] = {f"rank-{self.rank}.pt": {**rng.capture_rng_state(), **perrank.capture(state)}}
        for key, rank in self.writers(state, skip).items():
            if whole or rank == self.rank:
                files[f"{key}.pt"] = _target(state[key]).state_dict()
        if whole or self.rank == 0:
            values = {k: v for k, v in state.items() if k not in skip and _plain(v)}
            if values:
                files["values.pt"] = values
        return files

    def code_hash(self) -> tuple[str, tuple[str, ...]] | None:
        if self._code_hash is None and self._code is not None:
            self._code_hash = self._code()
        return self._code_hash

    def _check_code(self, info: CheckpointInfo) -> None:
        """A checkpoint written by other code is not resumed: a requeue runs the frozen copy,
        so this is someone running edited code on a run (or a run dir's code replaced)."""
        written = info.manifest.get("code_hash")
        mine = self.code_hash()
        if not written or mine is None or written == mine[0] or written in mine[1]:
            return
        if self.allow_code_change:
            print0(f"step-{info.step} was written by other code ({written}, this is {mine[0]}): "
                   "resuming anyway (--allow-code-change)")
            return
        raise DDPJobError(f"checkpoint step-{info.step} was written by other code (code hash {written}, "
                          f"the code here hashes to {mine[0]}), expected the code the run was submitted with",
                          "`ddpjob resume RUN_DIR` runs the frozen code; to resume with the code on disk, "
                          "ddpjob run RUN_DIR --allow-code-change")

    def _meta(self, step: int, extra: dict[str, Any]) -> dict[str, Any]:
        code = self.code_hash() if self.rank == 0 else None  # rank 0 writes the manifest
        return {"step": step, "world_size": self.world_size, "restart": self.restart,
                "job_id": self.job_id, **({"code_hash": code[0]} if code else {}),
                **({"config": self.identity} if self.rank == 0 else {}), **extra}

    def save(self, step: int, state: State, *, blocking: bool, meta: dict[str, Any] | None = None) -> None:
        """Collective: every rank calls it at the same step. Blocking saves return once the
        checkpoint is committed; async ones once the state is copied to host memory."""
        if self.saved_step == step:
            return  # e.g. a periodic save at the step where training then stops
        self.finish_pending()
        self._pipe.run(self._plan(step, state, meta), blocking=blocking or not self.async_save)

    def _plan(self, step: int, state: State, meta: dict[str, Any] | None) -> Plan:
        """The pipeline's first stage: this rank's files (the state dicts, taken now), the
        staging folder, the manifest's meta. Marks `step` saved."""
        staging = self.store.staging_dir(step, self.attempt)
        units = self._units(state)
        dcp_keys = sharded.keys(units)
        files = self._files(state, dcp_keys)
        self.saved_step = step
        extra = self._meta(step, {**({"sharded": dcp_keys} if units else {}), **(meta or {})})
        return Plan(step, staging, files, extra, sharded.state_dicts(units) if units else None)

    # the async save in flight: the pipeline's (bench/worker.py times these three by name)
    def busy(self) -> bool:
        return self._pipe.busy()

    def commit_pending(self) -> None:
        """After the step vote said no rank is still writing: the vote was the barrier."""
        self._pipe.commit_pending()

    def finish_pending(self) -> None:
        self._pipe.finish_pending()
