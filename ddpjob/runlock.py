"""One job per run dir: an flock on RUN_DIR/.lock, held by whatever trains there.

Two jobs in one run dir overwrite each other's checkpoints and interleave their records. The
queue state cannot tell (a damaged events.jsonl, a second `ddpjob run` by hand, a job another
tool started), so whoever trains holds an exclusive flock for as long as it runs: rank 0 of
`ddpjob run` and scripts under ddpjob.init(), the local supervisor for its whole run (its ranks
inherit its lock, see INHERITED). The kernel drops the lock when its holder dies, so a crash
never leaves a stale lock behind. The login side only looks (`holder`), never holds.

File systems without flock (some parallel file systems mount without it) get a warning, once:
the job still runs, as before this lock existed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from ddpjob.errors import DDPJobError

LOCK = ".lock"
# The local supervisor hands its locked descriptor to its ranks (subprocess pass_fds) and names it
# here: the same open file description holds the lock, so rank 0 re-taking it through that
# descriptor succeeds, and only there. A stray value in the environment takes nothing.
INHERITED = "DDPJOB_RUN_LOCK_FD"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class Busy(DDPJobError):
    """Another process holds the run dir's lock."""


class RunLock:
    """The held lock; `release()` (or the process's end) gives it up."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, run_dir: Path, holder: str) -> RunLock:
        """Take the run dir's lock for this process, or raise Busy naming who holds it."""
        path = run_dir / LOCK
        fd = _inherited(path)
        heir = fd is not None  # the holder's line stays the parent's, which holds it longer
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(run_dir, _read(path)) from None
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            print(f"ddpjob: warning: {run_dir} is on a file system without flock ({exc.strerror}): "
                  "nothing stops a second job from using this run dir", file=sys.stderr, flush=True)
            return cls(path, fd)
        if heir:
            return cls(path, fd)
        os.fchmod(fd, 0o600)  # whatever the umask: the holder's line is ours alone to write
        line = f"{holder}, pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, line.encode()[:500] + b"\n", 0)
        return cls(path, fd)

    def inherit_env(self) -> dict[str, str]:
        """The environment a child that trains under this lock gets (with pass_fds=(fd,))."""
        return {INHERITED: str(self.fd)} if self.fd is not None else {}

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing our last descriptor of it drops the flock
            self.fd = None


def holder(run_dir: Path) -> str | None:
    """Who trains in `run_dir` now (the holder's line), or None when nobody holds its lock.
    Looks without creating anything; a lock file this user cannot open reads as busy."""
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unknown: {path} cannot be opened ({exc.strerror})"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(path) or "another process"
    except OSError:
        return None  # no flock here: nobody can hold it either
    finally:
        os.close(fd)
    return None


def refuse_busy(run_dir: Path) -> None:
    """The login side's check before it starts anything in `run_dir`."""
    who = holder(run_dir)
    if who is not None:
        raise _busy(run_dir, who)


def _busy(run_dir: Path, who: str) -> Busy:
    return Busy(f"run directory '{run_dir}' is in use: {who or 'another process'} holds its lock, "
                "expected no job training there (two jobs would overwrite each other's checkpoints)",
                f"wait for that job to end, or stop it (`ddpjob cancel {run_dir}`) first")


def _inherited(path: Path) -> int | None:
    """The descriptor our parent (the local supervisor) locked for us, if it is this file's."""
    value = os.environ.get(INHERITED, "")
    if not value.isascii() or not value.isdigit():
        return None
    fd = int(value)
    try:
        mine, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
        return None
    return os.dup(fd)  # ours to close; the same open file description, so the same lock


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return " ".join(f.read(500).decode("utf-8", "replace").split())
    except OSError:
        return ""
