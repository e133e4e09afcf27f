"""In-memory snapshots (`checkpoint.snapshot_every`): every N steps each rank's whole state goes
to node-local memory (/dev/shm), in the background, so that a crash no signal announces (kill -9,
the OOM killer, a segfault) costs at most N steps: the restart inside the allocation resumes from
the newest snapshot every new rank can read and verify, else from the durable checkpoint.

Each rank keeps a complete copy of its own: under DDP the model and the optimizer are replicas
(a resume loads rank 0's copy on rank 0, whose buffers DDP broadcasts at the next forward, as a
checkpoint does), plus the rank's RNG streams and the samplers' position. It is a CheckpointStore
of its own, so it has a checkpoint's manifest and digests and loads with weights_only=True:

    /dev/shm/ddpjob-<uid>/<job id>-<run dir digest>/<host>/rank-<N>/step-<S>/

KEEP of them per rank, and none is taken when the memory they would need is not free. The folder
tree is 0700 and must be ours: /dev/shm is writable by everyone, and a tree another user made is
never read. The batch script, the local supervisor and a finished run remove the job's tree.
A requeue onto other nodes finds none (or one of an earlier attempt that still verifies) and
resumes from the durable checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpjob import console, rundir
from ddpjob.store import manifest

if TYPE_CHECKING:  # torch: imported by a rank only (the crash decision reads the paths too)
    from ddpjob.store.commit import CheckpointInfo

SHM = Path("/dev/shm")
KEEP = 2  # the newest is being written while the one before stays whole


def job_root(run_dir: Path, job_id: str | None, base: Path = SHM) -> Path:
    """The job's tree: one per run dir and job (a job id alone may repeat across clusters)."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return top(base) / f"{job_id or 'nojob'}-{digest}"


def rank_root(run_dir: Path, job_id: str | None, host: str, rank: int, base: Path = SHM) -> Path:
    return job_root(run_dir, job_id, base) / host / f"rank-{rank}"


def top(base: Path = SHM) -> Path:
    return base / f"ddpjob-{os.getuid()}"


def refuse(path: Path, base: Path = SHM) -> str | None:
    """Why the tree down to `path` must not be used (a folder someone else made, or one open to
    others, or a link), or None. Checked from the user's own ddpjob-<uid> folder down."""
    first = top(base)
    if first not in path.parents and path != first:
        return f"{path} is not under {first}"
    for p in [first, *reversed([q for q in path.parents if first in q.parents]), path]:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return None  # make() creates the rest, 0700
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a folder"
        if st.st_uid != os.getuid():
            return f"{p} belongs to uid {st.st_uid}, not to this user"
        if st.st_mode & 0o077:
            return f"{p} has mode {stat.S_IMODE(st.st_mode):o}: others may change it"
    return None


def make(path: Path) -> None:
    """The folders down to `path`, 0700 whatever the umask."""
    old = os.umask(0o077)
    try:
        path.mkdir(parents=True, exist_ok=True)
    finally:
        os.umask(old)


def newest_common(run_dir: Path, job_id: str | None, base: Path = SHM) -> int | None:
    """The newest snapshot step that every rank folder of the job on this machine holds whole
    (manifest present, sizes right; not hashed: the crash decision's estimate of where the
    restart resumes, which the ranks then verify), or None."""
    root = job_root(run_dir, job_id, base)
    if not root.is_dir() or refuse(root, base) is not None:
        return None
    steps: set[int] | None = None
    for folder in root.glob("*/rank-*"):
        try:
            whole = {s for s, p in manifest.committed(folder) if manifest.verify(p, s, hashes=False) is None}
        except OSError:
            return None
        steps = whole if steps is None else steps & whole
    return max(steps, default=None) if steps else None


def newest_saved(run_dir: Path, job_id: str | None) -> int | None:
    """The step a restart of the job on this machine would resume from: the newest valid
    checkpoint, or with `job_id` the newest snapshot all its ranks hold when newer."""
    found = manifest.newest_valid(Path(run_dir) / rundir.CHECKPOINTS)
    snap = newest_common(run_dir, job_id) if job_id else None
    return max((s for s in (found[0] if found else None, snap) if s is not None), default=None)


def remove_job(run_dir: Path, job_id: str | None, base: Path = SHM) -> None:
    """The job's snapshots on this machine: at the end of the job (the folder is ours to drop)."""
    root = job_root(run_dir, job_id, base)
    if root.is_dir() and refuse(root, base) is None:
        shutil.rmtree(root, ignore_errors=True)


def for_rank(cfg: Any, env: Any, run_dir: Path) -> Snapshots | None:
    """This rank's snapshots as `cfg` (a JobConfig) asks: None with snapshot_every = 0; a tree
    that may not be used gets one warning and no snapshots."""
    if cfg.checkpoint.snapshot_every <= 0:
        return None
    root = rank_root(run_dir, env.job_id, env.hostname, env.rank)
    snaps = Snapshots(root, every=cfg.checkpoint.snapshot_every, config_hash=cfg.hash())
    if snaps.why_not is not None:
        console.print0(f"ddpjob: warning: no in-memory snapshots: {snaps.why_not}")
    return snaps


class Snapshots:
    """One rank's snapshots: take() every `every` steps, newest()/load() at a restart."""

    def __init__(self, root: Path, *, every: int, config_hash: str, base: Path = SHM) -> None:
        from ddpjob.store.commit import CheckpointStore
        from ddpjob.store.snapshot import AsyncWrite

        self._base, self._async = base, AsyncWrite
        self.every = every
        # One process writes a rank's folder at a time, so a staging folder this process did not
        # open is a killed writer's (kill -9 mid-snapshot): the next prune drops it at once
        # instead of after the durable store's 5 minutes, and /dev/shm holds KEEP + 1 at most.
        self.store = CheckpointStore(root, keep_last=KEEP, config_hash=config_hash, stale_after_s=0.0)
        self._pending: Any = None  # AsyncWrite
        self.taken = self.skipped = 0
        self.why_not: str | None = refuse(root, base)

    def due(self, step: int) -> bool:
        return self.every > 0 and self.why_not is None and step > 0 and step % self.every == 0

    def take(self, step: int, files: dict[str, Any], meta: dict[str, Any]) -> bool:
        """Copy `files` (the step waits for that only) and write them in a thread. Skipped when
        the previous one is still being written (training never waits for a snapshot) or the
        memory is not free: False then."""
        if self._pending is not None and not self._pending.done():
            self.skipped += 1
            return False
        if self._pending is not None:
            try:
                self._pending.wait()
            except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation, never fatal
                self.why_not = f"the last snapshot could not be written ({' '.join(str(exc).split())[:160]})"
                return False
        snap = {name: self.store.snapshot(obj) for name, obj in files.items()}
        need = (KEEP + 1) * _nbytes(snap)
        make(self.store.root)
        self.why_not = refuse(self.store.root, self._base)  # made by us, not found made by another
        if self.why_not is not None:
            return False
        free = shutil.disk_usage(self.store.root).free
        if need > free:
            self.skipped += 1
            self.why_not = f"{need >> 20} MiB needed for {KEEP + 1} snapshots, {free >> 20} MiB free in {self.store.root}"
            return False
        def write() -> None:
            self.store.save(step, snap, meta)

        self._pending = self._async(write, self.store.root)
        self.taken += 1
        return True

    def newest(self, names: list[str]) -> list[int]:
        """The steps of this rank's snapshots that verify and hold every file in `names`,
        newest first."""
        if self.why_not is not None or not self.store.root.is_dir():
            return []
        out = []
        for info in self.store.list():
            files = info.manifest.get("files", {})
            if all(n in files for n in names) and self.store.verify(info) is None:
                out.append(info.step)
        return out

    def info(self, step: int) -> CheckpointInfo:
        return next(i for i in self.store.list() if i.step == step)

    def close(self) -> None:
        if self._pending is not None:
            try:
                self._pending.wait()
            except Exception:  # noqa: BLE001 - the job is ending: a lost snapshot loses nothing
                pass
            self._pending = None


def _nbytes(tree: Any) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 64
