"""In-memory snapshots (`checkpoint.snapshot_every`): every N steps each rank's whole state goes
to node-local memory (/dev/shm), in the background, so that a crash no signal announces (kill -9,
the OOM killer, a segfault) costs at most N steps: the restart inside the allocation resumes from
the newest snapshot every new rank can read and verify, else from the durable checkpoint.

Each rank keeps a complete copy of its own: under DDP the model and the optimizer are replicas
(a resume loads rank 0's copy on rank 0, whose buffers DDP broadcasts at the next forward, as a
checkpoint does), plus the rank's RNG streams and the samplers' position. It is a CheckpointStore
of its own, so it has a checkpoint's manifest and digests and loads with weights_only=True:

    /dev/shm/ddpjob-<uid>/<job id>-<run dir digest>/<host>/rank-<N>/step-<S>/

KEEP of them per rank, and none is taken when the memory they would need is not free. The base
folder is `checkpoint.snapshot_dir` (/dev/shm by default). At its first snapshot each rank fits
them to its node (fit(), the arithmetic in store/snaproom.py, which `ddpjob doctor` checks
before the job is submitted): the folder's free room is measured at the start, before this
start's first snapshot; a shortfall keeps 1, or none, with one line from the node's first rank.

A lost node takes its ranks' folders with it. What only those ranks held is their RNG streams
(the replicas and the samplers' global position are on every node), so each snapshot also holds
a copy of the RNG file of one rank on another node (keepers(): the rank with the same index on
the next node). A restart then plans (plan_restore()) the newest step every new rank can get
whole: its own folder's files, else a peer's, sent over the process group and checked against
the holder's manifest digests. A spare node's ranks thus resume from the snapshot, bit-equal,
instead of falling back to the durable checkpoint.

`snapshot_every = "auto"` (the default; on only for a job that may restart, slurm.max_failures >
0) measures the interval at each start (store/snapauto.py: a probe snapshot, then rank 0's
interval, verdict(), which rides the per-step vote to every rank, rank/snapvote.py: they must
snapshot the same steps). The folder tree is 0700 and must be ours: /dev/shm is writable by
everyone, and a tree another user made is never read. The batch script, the local supervisor and a finished run remove the job's tree.
A requeue onto other nodes finds none (or one of an earlier attempt that still verifies) and
resumes from the durable checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ddpjob import console, rundir
from ddpjob.store import manifest, snaproom
from ddpjob.store.snapauto import AUTO, Auto, AutoRule

if TYPE_CHECKING:  # torch: imported by a rank only (the crash decision reads the paths too)
    from ddpjob.store.commit import CheckpointInfo

SHM = Path("/dev/shm")


def _room(base: Path, job_tree: Path) -> int | None:
    """Free bytes for the job's snapshots under `base` at a start: the file system's free space
    (snaproom.free) plus what the job's own older snapshots there take, in a tree that is ours
    (the new ones replace them); None when the folder's file system cannot be asked."""
    free = snaproom.free(base)
    if free is not None and job_tree.is_dir() and refuse(job_tree, base) is None:
        free += snaproom.bytes_under(job_tree)
    return free


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


def newest_saved(run_dir: Path, job_id: str | None, base: Path = SHM) -> tuple[int | None, bool]:
    """(the step a restart of the job on this machine would resume from: the newest valid
    checkpoint, or with `job_id` the newest snapshot all its ranks hold when newer; whether that
    is a snapshot's)."""
    found = manifest.newest_valid(Path(run_dir) / rundir.CHECKPOINTS)
    snap = newest_common(run_dir, job_id, base) if job_id else None
    if snap is not None and (found is None or snap > found[0]):
        return snap, True
    return (found[0] if found else None), False


def retry_point(cfg: Any, run_dir: Path, job_id: str | None) -> tuple[int | None, bool]:
    """What a retry of the job (`cfg`: its JobConfig) on this machine resumes from, for
    ledger/recovery.decide: newest_saved under the job's snapshot folder, or (None, False) for a
    [train] command, which resumes from its own checkpoint."""
    return (None, False) if cfg.train.command else newest_saved(run_dir, job_id, base_of(cfg))


def remove_job(run_dir: Path, job_id: str | None, base: Path = SHM) -> None:
    """The job's snapshots on this machine: at the end of the job (the folder is ours to drop)."""
    root = job_root(run_dir, job_id, base)
    if root.is_dir() and refuse(root, base) is None:
        shutil.rmtree(root, ignore_errors=True)


def base_of(cfg: Any) -> Path:
    """The folder the job's snapshot trees go under (`cfg`: a JobConfig)."""
    return Path(cfg.checkpoint.snapshot_dir)


def interval(cfg: Any) -> int | None:
    """The snapshot interval `cfg` (a JobConfig) asks for: 0 none, None measured ("auto" for a
    job that may restart inside its allocation; one that may not has no use for them)."""
    every = cfg.checkpoint.snapshot_every
    if every == "auto":
        return None if cfg.slurm.max_failures > 0 else 0
    return max(0, int(every))


def for_rank(cfg: Any, env: Any, run_dir: Path) -> Snapshots | None:
    """This rank's snapshots as `cfg` (a JobConfig) asks: None without any; a tree that may not
    be used gets one warning and no snapshots."""
    every = interval(cfg)
    if every == 0:
        return None
    base = base_of(cfg)
    root = rank_root(run_dir, env.job_id, env.hostname, env.rank, base)
    try:
        cgroups = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroups = ""
    snaps = Snapshots(root, every=every, config_hash=cfg.hash(), base=base, host=env.hostname,
                      ranks=env.local_world_size, node_lead=env.local_rank == 0,
                      memory=lambda: snaproom.memory_left(cgroups))
    if snaps.why_not is not None:
        console.print0(f"ddpjob: warning: no in-memory snapshots: {snaps.why_not}")
    return snaps


class Snapshots:
    """One rank's snapshots: take() every `every` steps, newest()/load() at a restart."""

    def __init__(self, root: Path, *, every: int | None, config_hash: str, base: Path = SHM,
                 rule: AutoRule = AUTO, host: str = "", ranks: int = 1, node_lead: bool = True,
                 memory: Callable[[], int | None] = lambda: None) -> None:
        from ddpjob.store.commit import CheckpointStore
        from ddpjob.store.snapshot import AsyncWrite

        self._base, self._async = base, AsyncWrite
        self.host = host  # peers.keepers(): which rank on another node keeps a copy of the RNG file
        self.keepers: list[int | None] | None = None  # for each rank; known from the first snapshot
        self.every = every  # None: "auto", until the vote brings rank 0's verdict() (rank/snapvote.py)
        self.auto = Auto(rule) if every is None else None
        # One process writes a rank's folder at a time, so a staging folder this process did not
        # open is a killed writer's (kill -9 mid-snapshot): the next prune drops it at once
        # instead of after the durable store's 5 minutes, and /dev/shm holds KEEP + 1 at most.
        self.store = CheckpointStore(root, keep_last=snaproom.KEEP, config_hash=config_hash, stale_after_s=0.0)
        self._pending: Any = None  # AsyncWrite
        self.taken = self.skipped = 0
        self.why_not: str | None = refuse(root, base)
        # fit(): this node's `ranks` share the folder's room, measured now (before any of this
        # start's snapshots); `memory`: what the memory cgroup has left, asked at the first one
        self.keep, self._ranks, self._node_lead, self._memory = snaproom.KEEP, ranks, node_lead, memory
        self._room: int | None = _room(base, root.parent.parent) if self.why_not is None else None
        self._fitted = False

    def due(self, step: int, saved: bool = False) -> bool:
        """Whether a snapshot is due at `step`; `saved`: a checkpoint was just written at it
        (the same on every rank), which is then no snapshot's step, nor the probe's. The same
        answer on every rank (the schedule only: the snapshot gathers the RNG files for the
        peer copies); take() skips what this rank cannot write."""
        if saved:
            return False
        if self.every is None:  # measuring: only the probe (decided alike on every rank)
            return self.auto is not None and self.auto.probe_now(step)
        return step > 0 and self.every > 0 and step % self.every == 0

    def observe(self, step: int, now: float | None = None) -> None:
        """Every rank, at each step the loop asks about snapshots while "auto" is measuring: the
        loop's start (the same step on every rank) and, from the time between two consecutive
        asks (`now`: time.monotonic()), the step's duration. Nothing once the interval is set."""
        auto = self.auto
        if auto is None or self.every is not None:
            return
        now = time.monotonic() if now is None else now
        if auto.start is None:
            auto.start = step - 1
        elif auto.last is not None and auto.last[0] == step - 1 and step > auto.start + 2:
            auto.step_s.append(now - auto.last[1])  # not the first steps: compiles, caches
        auto.last = (step, now)

    def verdict(self) -> tuple[int, str] | None:
        """Rank 0, while "auto" measures: (the interval its probe's cost asks for, the line that
        says why), once AUTO.decide steps have passed since the probe (the steps observe() saw)
        and the probe's write is done; None before. Never waits for the write: one still
        running AUTO.wait steps later is counted at its time so far (take() skips every
        snapshot while it runs anyway), so "auto" is always decided."""
        auto = self.auto
        if auto is None or self.every is not None or auto.last is None:
            return None
        at, now = auto.decide_step(), auto.last[0]
        if at is None or now < at:
            return None
        pending = self._pending
        if pending is None or pending.done():
            return auto.interval()
        if now < at + auto.rule.wait or auto.write_since is None:
            return None
        return auto.interval(unfinished_s=time.perf_counter() - auto.write_since)

    def take(self, step: int, files: dict[str, Any], meta: dict[str, Any], held_s: float = 0.0) -> bool:
        """Copy `files` (the step waits for that only) and write them in a thread. Skipped when
        the previous one is still being written (training never waits for a snapshot), the
        memory is not free or the tree may not be used: False then. `held_s`: how long the
        caller already held the loop for it (the peer copies' gather), for "auto"."""
        started = time.perf_counter() - held_s
        if self.why_not is not None:
            return False
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
        size = _nbytes(snap)
        if not self._fitted and not self.fit(size):
            return False
        need = (self.keep + 1) * size
        make(self.store.root)
        self.why_not = refuse(self.store.root, self._base)  # made by us, not found made by another
        if self.why_not is not None:
            return False
        # beyond what this rank's folder holds already (its older ones go once the new one is in)
        more, free = max(size, need - snaproom.bytes_under(self.store.root)), shutil.disk_usage(self.store.root).free
        if more > free:  # the folder filled up since the start: stop before a write fails
            self.skipped += 1
            self.why_not = (f"in-memory snapshots off from step {step}: {snaproom.size_text(more)} more needed, "
                            f"{snaproom.size_text(free)} free in {self.store.root}")
            console.info(f"ddpjob: warning: {self.why_not}")
            return False
        auto = self.auto if self.every is None else None

        def write() -> None:
            cpu = time.thread_time()
            self.store.save(step, snap, meta)
            if auto is not None:
                auto.write_cpu_s = time.thread_time() - cpu

        if auto is not None:
            auto.write_since = time.perf_counter()
        self._pending = self._async(write, self.store.root)
        self.taken += 1
        if auto is not None:
            auto.block_s = time.perf_counter() - started
        return True

    def fit(self, size: int) -> bool:
        """At the first snapshot, when its `size` is known: keep KEEP, 1 or none (keep_for), said
        in one line by the node's first rank when fewer than KEEP. False: none."""
        self._fitted = True
        left = self._memory()
        self.keep = snaproom.keep_for(size, self._ranks, self._room, left)
        if self.keep == snaproom.KEEP:
            return True
        full = snaproom.need(size, self._ranks)
        short = [f"{snaproom.size_text(self._room)} free in {self._base}"] if self._room is not None and full > self._room else []
        short += [f"{snaproom.size_text(left)} left under the job's memory limit"] if left is not None and full > left else []
        what = "kept 1 deep instead of 2" if self.keep else "off"
        line = (f"in-memory snapshots {what}{f' on {self.host}' if self.host else ''}: {self._ranks} "
                f"rank(s) x {snaproom.KEEP + 1} x {snaproom.size_text(size)} = {snaproom.size_text(full)} needed, {' and '.join(short)}")
        if self._node_lead:
            console.info(f"ddpjob: warning: {line}")
        if self.keep == 0:
            self.why_not = line
            return False
        self.store.keep_last = self.keep
        return True

    def held(self) -> dict[int, dict[str, Any]]:
        """Step -> manifest of each of this rank's snapshots that verifies (every file's
        sha256): what a restart may take from this rank's folder."""
        if self.why_not is not None or not self.store.root.is_dir():
            return {}
        return {info.step: info.manifest for info in self.store.list() if self.store.verify(info) is None}

    def resumed(self, step: int | None) -> None:
        """Every rank, once the resume has read what it needs (the snapshot of `step`, None: the
        resume took none): drop this rank's other snapshots and any staging folder. None of them
        can serve a restart any more: an older one is behind the resume point, a newer one is
        not on every rank (the resume took the newest common one). They matter because a rank
        killed between a snapshot's commit and its prune leaves KEEP + 1 behind, and the room
        fit() shares out assumes each rank holds at most `keep` plus the one being written (in a
        stressed run, rank 0's first snapshot after a restart found 552.0 KiB free where it
        needed 552.4 KiB more, and the snapshots went off). Every rank is here before the first
        step's collectives, so before any rank's first take."""
        if self.why_not is None and self.store.root.is_dir():
            try:
                self.store.drop_others(step)
            except OSError:
                pass  # housekeeping: take()'s room check still says so in one line

    def info(self, step: int) -> CheckpointInfo:
        return next(i for i in self.store.list() if i.step == step)

    def read_bytes(self, step: int, name: str, size: int) -> bytes:
        """A file of this rank's snapshot of `step` as stored, for a peer that has no copy; b""
        when it is gone or no longer `size` bytes (the peer then takes the durable checkpoint)."""
        if not manifest.FILE_NAME.fullmatch(name):
            return b""
        try:
            data = (self.info(step).path / name).read_bytes()
        except (OSError, StopIteration):
            return b""
        return data if len(data) == size else b""

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
