"""The file-level steps of a checkpoint write, below commit.py's CheckpointStore: the wrapper
that hashes torch.save's bytes on their way out and keeps the errno torch hides, the durable
write of the manifest and the fsync of a folder, and the one-line error an OSError becomes.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any

from ddpjob.errors import DDPJobError


class ErrnoRecorder:
    """File wrapper for torch.save that remembers the OSError (ENOSPC...) torch would hide,
    and hashes the bytes on their way out (torch.save writes sequentially, never seeks)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None
        self.digest, self.size = hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self.f.flush()


def write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a crash of the node, not just of the process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def io_error(err: OSError, path: Path, doing: str) -> DDPJobError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DDPJobError(f"could not {doing} {path}: {err.strerror} (disk or quota full)",
                           "free space on that filesystem or lower checkpoint.keep_last; committed "
                           "checkpoints were not touched")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return DDPJobError(f"could not {doing} {path}: {err.strerror}",
                           "point the run directory at a writable folder on a filesystem every node shares")
    return DDPJobError(f"could not {doing} {path}: {err.strerror or err}",
                       "check that the run directory's filesystem is mounted and healthy on this node")
