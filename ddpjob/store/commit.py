"""Atomic checkpoint store: trainer state <-> `RUN_DIR/checkpoints/step-<N>/` (runner/trainer side).

Every rank writes its files into one staging folder `.tmp-step-<N>-<attempt>/`; after a barrier
rank 0 hashes them, writes manifest.json last and renames the folder to `step-<N>` in one atomic
step, so a kill -9 at any moment leaves a complete checkpoint or none. `latest()` resumes from the
newest one that verifies; every file loads with `torch.load(weights_only=True)` (loadable.py).
Host snapshots and background writes live in snapshot.py, the collective save's stages in
pipeline.py, the file-level write steps in diskio.py, RNG state in rng.py, the save schedule in
schedule.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ddpjob.version import __version__
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.store import manifest
from ddpjob.store.diskio import ErrnoRecorder, fsync_dir, io_error, write_durably
from ddpjob.store.loadable import check_loadable, load_file
from ddpjob.store.nocrc import save as _torch_save  # without the zip's CRC32: nocrc.py says why
from ddpjob.store.snapshot import snapshot_tree

_WIDTH = 9  # step-000001234: lexical order = numeric order (names are still parsed as numbers)
_STAGING = ".tmp-step-"
_TRASH = ".del-"

@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]  # parsed manifest.json; {} when missing or unparsable (see verify)


class CheckpointStore:
    """Committed checkpoints are `root/step-<N>/`; anything starting with a dot is in flight or
    being deleted and is never listed. Rank 0 calls commit()/prune(); every rank calls write()."""

    def __init__(self, root: str | Path, *, keep_last: int = 3, config_hash: str = "",
                 stale_after_s: float = 300.0) -> None:
        if keep_last < 1:
            raise UsageError(f"checkpoint keep_last is {keep_last}, expected at least 1",
                             "set checkpoint.keep_last to 1 or more")
        self.root = Path(root)
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.stale_after_s = stale_after_s
        self._open: set[Path] = set()  # staging folders this process is filling: never pruned
        # sha256 of the files this process wrote, hashed as the bytes went out (path -> size,
        # mtime_ns, hex): commit() need not read them back (90 MB for resnet18 + SGD state)
        self._digests: dict[Path, tuple[int, int, str]] = {}
        self._committed: Path | None = None  # the newest checkpoint this process committed

    def make_room(self, step: int) -> None:
        """Rank 0, as the write of `step` begins: delete now the checkpoints its commit will
        prune (keep_last), so that the write reuses their freed memory. On the benchmark VMs a
        page freed a moment ago is cheap to write into and one free for longer often is not (it
        looks like the host reclaiming free guest memory): writing 45 MB into the page cache
        took 11-12 ms of CPU right after a deletion, 60-70 ms otherwise, and pruning at the
        commit, 10 steps before the next write, is too early (bench P6: the steady-state
        checkpoint every 10 steps cost ~145 ms that way, ~85 ms this way). What this gives up:
        from here to the commit only keep_last - 1 checkpoints exist, so a crash (or a failed
        write) in between loses the oldest one, which the commit would have deleted anyway.
        Never the newest valid checkpoint: only when this process committed it (valid without
        hashing), and never that one, so with keep_last = 1 nothing goes early. Best effort,
        like pruning: a failure here only leaves the deletion to the commit."""
        known = self._committed
        try:
            if known is None or not known.is_dir() or (self.root / f"step-{step:0{_WIDTH}d}").exists():
                return  # (the same step saved again: its commit may keep the old one, prunes nothing)
            sound = [i for i in self.list() if manifest.verify(i.path, i.step, hashes=False) is None]
            for info in sound[self.keep_last - 1:]:  # after the commit: the new one + keep_last - 1
                if info.path != known and info.step < step:
                    self._delete(info.path)
        except (OSError, DDPJobError):
            pass

    # ---- collective save -------------------------------------------------------------------
    def staging_dir(self, step: int, attempt: str) -> Path:
        attempt = re.sub(r"[^A-Za-z0-9_.-]", "_", attempt) or "0"
        path = self.root / f"{_STAGING}{step:0{_WIDTH}d}-{attempt}"
        try:
            path.mkdir(parents=True, exist_ok=True)  # all ranks race here: exist_ok
        except OSError as err:
            raise io_error(err, path, "create the checkpoint staging folder") from None
        self._open.add(path)
        for old in [p for p in list(self._digests) if p.parent != path]:  # saves are sequential
            self._digests.pop(old, None)
        return path

    def check(self, name: str, obj: Any) -> None:
        """Raise for a file name the store does not take or an object weights_only could not
        load back: an async save calls it in the caller's thread, before anything is written."""
        _check_name(name)
        check_loadable(obj, [name])

    def write(self, staging: Path, name: str, obj: Any, *, shared: bool = False, checked: bool = False) -> None:
        """One file into `staging` (`checked`: check() already passed). A failed write removes
        the staging folder, unless `shared`: other ranks may still be writing into it, and the
        collective that follows every rank's writes removes it (pipeline.py); then only this
        file's partial .tmp goes."""
        if not checked:
            self.check(name, obj)
        self._write_file(staging, name, obj, abort=not shared)

    def digests(self, staging: Path, names: list[str]) -> dict[str, tuple[int, int, str]]:
        """(size, mtime_ns, sha256) of the named staged files, for those this process wrote
        and hashed on their way out (for rank 0's add_digests)."""
        return {n: self._digests[staging / n] for n in names if staging / n in self._digests}

    def add_digests(self, staging: Path, digests: dict[str, tuple[int, int, str]]) -> None:
        """(size, mtime_ns, sha256) of staged files other ranks wrote and hashed themselves (a
        sharded checkpoint's shards): commit() takes each while its size and mtime still match
        instead of reading the file back."""
        for name, known in digests.items():
            _check_name(name)
            self._digests[staging / name] = known

    def commit(self, staging: Path, step: int, meta: dict[str, Any]) -> Path:
        """Rank 0, after every rank's write returned: manifest last, then one atomic rename."""
        if not staging.is_dir():
            raise DDPJobError(f"checkpoint staging folder {staging} vanished before the commit",
                              "a rank's write failed and removed it: look for its error in that rank's log")
        unfinished = sorted(p.name for p in staging.glob("*.tmp"))
        if unfinished:
            raise DDPJobError(f"checkpoint staging folder {staging} still holds unfinished files {unfinished}",
                              "commit only after every rank's write()/wait() returned and the ranks passed a barrier")
        target = self.root / f"step-{step:0{_WIDTH}d}"
        try:
            files = {p.name: self._digest(p)
                     for p in sorted(staging.iterdir()) if p.is_file() and p.name != manifest.MANIFEST}
            assert files, f"commit of an empty staging folder {staging}"
            # serialised before anything is written: meta that is not JSON fails here, cleanly
            text = json.dumps(self._manifest(step, meta, files), indent=1, sort_keys=True)
            write_durably(staging / manifest.MANIFEST, text)
            fsync_dir(staging)
            if target.exists():
                # Same step saved again (e.g. preempted right after a resume). A valid one stays:
                # replacing it would need two renames, and a kill between them would lose it.
                if self.verify(CheckpointInfo(target, step, manifest.read(target))) is None:
                    self.abort(staging)
                    return target
                self._delete(target)
            os.rename(staging, target)
            fsync_dir(self.root)
        except OSError as err:
            self.abort(staging)
            raise io_error(err, target, "commit the checkpoint") from None
        self._open.discard(staging)
        self._committed = target
        try:
            self._prune(known_valid=target)
        except (OSError, DDPJobError):
            pass  # housekeeping only: the checkpoint is committed, the next commit prunes again
        return target

    def save(self, step: int, files: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Single-process convenience: staging + write every file + commit."""
        staging = self.staging_dir(step, f"pid{os.getpid()}")
        self.make_room(step)
        for name, obj in files.items():
            self.write(staging, name, obj)
        return self.commit(staging, step, meta)

    def abort(self, staging: Path) -> None:
        """Drop a staging folder (after a failed write); committed checkpoints are untouched."""
        self._open.discard(staging)
        shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def snapshot(obj: Any) -> Any:
        """Deep copy of nested dicts/lists/tuples of tensors to CPU (pinned when CUDA is there).
        When it returns, the caller may change the originals: the step blocks only for this copy."""
        return snapshot_tree(obj)

    # ---- load --------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, newest first (not verified)."""
        try:
            found = manifest.committed(self.root)
        except OSError as err:
            raise io_error(err, self.root, "list the checkpoint folder") from None
        return [CheckpointInfo(p, step, manifest.read(p)) for step, p in found]

    def verify(self, info: CheckpointInfo, *, config_hash: str | None = None) -> str | None:
        """None when the checkpoint is complete and intact, else a one-line reason."""
        return manifest.verify(info.path, info.step,
                               self.config_hash if config_hash is None else config_hash)

    def latest(self, *, config_hash: str | None = None,
               log: Callable[[str], None] = print) -> CheckpointInfo | None:
        """Newest checkpoint that verifies. One log line per skipped one and one for the choice.
        Call it on rank 0 and broadcast the step: it reads (hashes) whole checkpoints."""
        infos = self.list()
        for info in infos:
            reason = self.verify(info, config_hash=config_hash)
            if reason is None:
                log(f"resuming from step-{info.step}")
                return info
            log(f"skipping step-{info.step}: {reason}")
        if infos:
            log(f"no valid checkpoint in {self.root}: starting from scratch")
        return None

    def load(self, info: CheckpointInfo, name: str, map_location: Any = "cpu") -> Any:
        path = info.path / name
        listed = info.manifest.get("files")
        if isinstance(listed, dict) and name not in listed:
            raise DDPJobError(f"checkpoint {info.path} has no {name} (it holds {', '.join(sorted(listed))})",
                              "resume with the same number of ranks and model setup that wrote it")
        try:
            return load_file(path, map_location, str(path))
        except FileNotFoundError:
            raise DDPJobError(f"checkpoint file {path} does not exist",
                              "pick a checkpoint with latest(), which verifies every file") from None
        except (RuntimeError, OSError, EOFError) as err:
            raise DDPJobError(f"cannot read checkpoint file {path}: {str(err).splitlines()[0]}",
                              f"the file is damaged; delete {info.path} to resume from an older checkpoint") from None

    # ---- pruning -----------------------------------------------------------------------------
    def prune(self) -> None:
        """Keep the newest keep_last sound checkpoints (and always the newest valid one), remove
        damaged ones and staging folders nobody touched for stale_after_s (dead attempts)."""
        self._prune(known_valid=None)

    def drop_others(self, step: int | None) -> None:
        """Delete every checkpoint but the one of `step` (None: all of them), and the staging
        folders nobody writes: in-memory snapshots after a resume (memsnap.Snapshots.resumed)."""
        for info in self.list():
            if info.step != step:
                self._delete(info.path)
        self._prune(known_valid=None)

    def _prune(self, known_valid: Path | None) -> None:
        if not self.root.is_dir():
            return
        infos = self.list()
        # A damaged checkpoint (missing file, wrong size, no manifest) can never be resumed: it
        # goes, and takes no keep_last slot. Cheap checks only; hashing every kept checkpoint at
        # every save would cost keep_last full reads. The config hash is not checked: a resume
        # at other resources may still want an older run's checkpoints.
        sound = []
        for info in infos:
            if manifest.verify(info.path, info.step, hashes=False) is None:
                sound.append(info)
            elif info.manifest.get("format_version", manifest.FORMAT_VERSION) == manifest.FORMAT_VERSION:
                self._delete(info.path)  # (another ddpjob's format is not ours to judge)
        newest_valid = next((i.path for i in sound if i.path == known_valid or self.verify(i) is None), None)
        for info in sound[self.keep_last:]:
            if info.path != newest_valid:
                self._delete(info.path)
        now = time.time()
        for path in self.root.iterdir():
            if path.name.startswith(_TRASH):  # a deletion that a kill interrupted
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith(_STAGING) and path not in self._open:
                # Age = newest mtime inside: a rank writing right now keeps touching its .tmp file.
                if now - _newest_mtime(path) > self.stale_after_s:
                    self._delete(path)

    def _delete(self, path: Path) -> None:
        # Rename first: a kill during rmtree must never leave a half-deleted step-N that looks real.
        trash = self.root / f"{_TRASH}{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except OSError:
            return  # already gone (another process pruned it)
        shutil.rmtree(trash, ignore_errors=True)

    # ---- internals ---------------------------------------------------------------------------
    def _digest(self, path: Path) -> dict[str, Any]:
        """Manifest entry of a staged file: the digest taken while writing it when this process
        wrote it and it is unchanged since (size and mtime), else hashed from disk."""
        st = path.stat()
        known = self._digests.pop(path, None)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            return {"size": st.st_size, "sha256": known[2]}
        return {"size": st.st_size, "sha256": manifest.sha256(path)}

    def _write_file(self, staging: Path, name: str, obj: Any, abort: bool = True) -> None:
        tmp = staging / f"{name}.tmp"
        recorder: ErrnoRecorder | None = None
        try:
            with open(tmp, "wb") as f:
                recorder = ErrnoRecorder(f)
                _torch_save(obj, recorder)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, staging / name)
            st, sent = (staging / name).stat(), recorder
            if sent is not None and st.st_size == sent.size:  # every byte went through the recorder
                self._digests[staging / name] = (st.st_size, st.st_mtime_ns, sent.digest.hexdigest())
        except (OSError, RuntimeError) as err:
            if abort:
                self.abort(staging)
            else:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            # torch.save turns the writer's OSError into a RuntimeError; the recorder kept the errno.
            os_err = err if isinstance(err, OSError) else (recorder.error if recorder else None)
            if os_err is None:
                raise
            raise io_error(os_err, staging / name, "write the checkpoint file") from None

    def _manifest(self, step: int, meta: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
        assert meta.get("step", step) == step, f"meta step {meta.get('step')} != commit step {step}"
        assert not (meta.get("config_hash") and self.config_hash and meta["config_hash"] != self.config_hash)
        return {**meta, "format_version": manifest.FORMAT_VERSION, "step": step,
                "config_hash": self.config_hash or meta.get("config_hash", ""),
                "versions": {"ddpjob": __version__, "torch": torch.__version__,
                             "python": sys.version.split()[0]},
                "created_unix": time.time(), "files": files}


def _check_name(name: str) -> None:
    # a check, not an assert: `python -O` must not let a name leave the checkpoint folder
    if not manifest.FILE_NAME.fullmatch(name) or name == manifest.MANIFEST or name.endswith(".tmp"):
        raise ValueError(f"bad checkpoint file name {name!r}")


def _newest_mtime(path: Path) -> float:
    try:
        return max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.iterdir()])
    except OSError:
        return time.time()  # vanishing under us: somebody is working on it, leave it
