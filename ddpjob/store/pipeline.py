"""The durable save as one pipeline, blocking or async alike (as torchtitan's CheckpointManager):

  plan    which files this rank writes, the staging folder, the manifest's meta (state.py: Plan)
  stage   what the training step waits for: async, a copy to host memory; blocking, nothing
  sink    the files into the staging folder, rank 0 making room first: in the caller's thread
          (blocking) or in the one writer thread (async)
  agree   ONE collective: every rank's digests and errors; a failed write on any rank removes
          the staging folder on every rank and raises on every rank; then DCP's shards (fsdp)
  commit  rank 0 writes the manifest: blocking, then a barrier; async, once the per-step vote
          said no rank is still writing (commit_pending)

The collectives run in the same order on every rank whichever rank failed: a mismatch would
deadlock gloo. An async save runs sink and agree on the io group (Control.io_group(), made on
the main thread), so they never interleave with the stop vote on the control group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ddpjob.errors import DDPJobError
from ddpjob.node import dist
from ddpjob.store import sharded
from ddpjob.store.commit import CheckpointStore
from ddpjob.store.snapshot import AsyncWrite

Digests = dict[str, tuple[int, int, str]]  # file name -> (size, mtime_ns, sha256)


@dataclass(frozen=True)
class Plan:
    """One rank's part of the checkpoint of `step`, the same folder on every rank."""

    step: int
    staging: Path
    files: dict[str, Any]  # name -> object: this rank's .pt files
    meta: dict[str, Any]  # the manifest's, written by rank 0
    dcp: dict[str, Any] | None = None  # fsdp: the state dicts DCP saves (sharded.state_dicts)


class SavePipeline:
    """One rank's saves into `store`; it holds the async save in flight (at most one)."""

    def __init__(self, store: CheckpointStore, control: dist.Control, rank: int) -> None:
        self.store, self.control, self.rank = store, control, rank
        self._pending: tuple[AsyncWrite, Plan] | None = None

    def run(self, plan: Plan, *, blocking: bool) -> None:
        """Collective. Blocking: returns once the checkpoint is committed; async: once the state
        is copied to host memory, the rest left to the writer thread and commit_pending()."""
        if blocking:
            error = self._sink(plan, plan.files, checked=False)
            # every rank's .pt files are on disk before rank 0 commits (the gather is the barrier)
            self._agree(plan, list(plan.files), error, self.control.group, plan.dcp, background=False)
            self._commit(plan)
            self.control.barrier("the checkpoint's commit")  # nobody moves on (or exits) before it exists
            return
        files, group, dcp = self._stage(plan)

        def write() -> None:  # the writer thread: sink, then agree even when this rank's write failed
            error = self._sink(plan, files, checked=True)
            self._agree(plan, list(files), error, group, dcp, background=True)
        self._pending = (AsyncWrite(write, plan.staging), plan)

    def _stage(self, plan: Plan) -> tuple[dict[str, Any], Any, dict[str, Any] | None]:
        """The step blocks for this only: host copies of this rank's files and DCP's state
        dicts, and the io group (made here, on the main thread of every rank together)."""
        files = {name: CheckpointStore.snapshot(obj) for name, obj in plan.files.items()}
        group = self.control.io_group()
        dcp = sharded.stage(plan.dcp, plan.staging) if plan.dcp is not None else None
        for name, obj in files.items():  # fail in the caller's thread, before anything is written
            self.store.check(name, obj)
        return files, group, dcp

    def _sink(self, plan: Plan, files: dict[str, Any], *, checked: bool) -> BaseException | None:
        """This rank's files into the staging folder. A failure is returned, not raised: the
        agreement tells it to every rank first, so that none of them waits for this one."""
        if self.rank == 0:
            self.store.make_room(plan.step)
        try:
            for name, obj in files.items():
                self.store.write(plan.staging, name, obj, shared=True, checked=checked)
        except Exception as err:
            return err
        return None

    def _agree(self, plan: Plan, names: list[str], error: BaseException | None, group: Any,
               dcp: dict[str, Any] | None, *, background: bool) -> None:
        """Collective, after each rank wrote its files (or failed to): rank 0 gets the sha256 each
        rank took while writing (the commit need not read other ranks' files back), and every
        rank learns whether any write failed, so that none commits or waits for a rank that
        gave up. Raises this rank's own error, else one naming the rank that failed. Then the
        DCP shards (fsdp), whose gathers follow on the same group."""
        staging = plan.staging
        mine: Digests | str = self.store.digests(staging, names)
        if error is not None:
            mine = error.message if isinstance(error, DDPJobError) else f"{type(error).__name__}: {error}"
        every = dist.all_gather_object(mine, what="the checkpoint's write", group=group, background=background)
        failed = [(r, m) for r, m in enumerate(every) if isinstance(m, str)]
        if failed:
            self.store.abort(staging)  # every rank: whichever failed, the folder goes (never committed)
        if error is not None:
            raise error
        if failed:
            r, why = failed[0]
            raise DDPJobError(f"rank {r} could not write its files of checkpoint {staging.name} ({why})",
                              f"see rank {r}'s log; no checkpoint was committed, the older ones are untouched")
        if self.rank == 0:
            self.store.add_digests(staging, {n: d for part in every if isinstance(part, dict)
                                             for n, d in part.items()})
        if dcp is not None:
            sharded.save(staging, dcp, self.control, self.rank, partial(self.store.add_digests, staging),
                         background=background)

    def _commit(self, plan: Plan) -> None:
        if self.rank == 0:
            self.store.commit(plan.staging, plan.step, plan.meta)

    # ---- the async save in flight ------------------------------------------------------------
    def busy(self) -> bool:
        return self._pending is not None and not self._pending[0].done()

    def commit_pending(self) -> None:
        """After the step vote said no rank is still writing: the vote was the barrier."""
        if self._pending is None:
            return
        aw, plan = self._pending
        self._pending = None
        aw.wait()
        self._commit(plan)

    def finish_pending(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self.control.barrier("the background checkpoint write")
            self.commit_pending()
