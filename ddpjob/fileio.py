"""The one way ddpjob writes and reads its small files: the atomic write (a temp file beside the
target, fsynced, renamed), the rule for a file the user names (`-o`), JSON records appended one
line at a time, and the bounded reader every view uses (a FIFO, a device or a huge file is never
a record). Shared by both sides; no torch. The run dir's layout and policy are rundir.py's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ddpjob import recordtypes
from ddpjob.errors import DDPJobError


def file_mode(folder: str | Path) -> int:
    """0640 in a group-readable folder, else 0600: files follow their run dir."""
    try:
        group = Path(folder).stat().st_mode & 0o050 == 0o050
    except OSError:
        group = False
    return 0o640 if group else 0o600


def write_atomic(path: str | Path, write: Callable[[BinaryIO], Any], mode: int | None = None
                 ) -> None:
    """The one atomic file write: `write(f)` fills a temp file beside `path`, which is fsynced and
    renamed over `path`, so a reader (or a resume after a kill) sees the old file or the new one,
    never half of one."""
    path = Path(path)
    mode = file_mode(path.parent) if mode is None else mode
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def write_text_atomic(path: str | Path, text: str, mode: int | None = None) -> None:
    write_atomic(path, lambda f: f.write(text.encode()), mode)


class UserOutput:
    """A file the user names (`sbatch -o`, `plot -o`), under the one rule for writing it: a new
    path or a regular file is written atomically (a temp file renamed over it; through a symlink,
    over the file it points to, so the link stays); a character device or a FIFO (`-o
    /dev/stdout`, `-o >(...)`, a named pipe with a reader) is written in place; anything else
    (a folder, a block device, a socket, a dangling link, a FIFO nobody reads) is refused with
    one line. Nothing at the path is ever replaced by a rename but a regular file.

    Two steps, so a caller can stage the file before its other work and commit it last:
    stage(data) then commit(), or discard()."""

    def __init__(self, path: str | Path, flag: str = "-o") -> None:
        self.path, self.flag = Path(path), flag
        self._staged: Path | None = None
        self._fd: int | None = None
        self._data = b""
        try:
            st = os.stat(self.path)  # through a link: what would be written
        except FileNotFoundError:
            if self.path.is_symlink():
                raise self._refuse("is a symlink to nothing") from None
            if not self.path.parent.is_dir():
                raise DDPJobError(f"cannot write '{self.path}': folder '{self.path.parent}' does not exist, "
                                  "expected an existing folder", f"create it first or choose another {flag}")
            self.in_place, self.target = False, self.path
            return
        except OSError as exc:
            raise DDPJobError(f"cannot inspect '{self.path}' ({exc.strerror})", f"choose another {flag}") from None
        if stat.S_ISREG(st.st_mode):
            self.in_place, self.target = False, self.path.resolve()
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            self.in_place, self.target = True, self.path
        else:
            kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise self._refuse(f"is {kind}")

    def _refuse(self, why: str) -> DDPJobError:
        return DDPJobError(f"{self.flag} '{self.path}' {why}, expected a new file, a regular file, a "
                           "character device or a FIFO with a reader", f"choose another {self.flag}, e.g. {self.flag} out")

    def _failed(self, exc: OSError) -> DDPJobError:
        return DDPJobError(f"cannot write '{self.path}' ({exc.strerror})", f"choose another {self.flag}")

    def stage(self, data: bytes, mode: int = 0o644) -> None:
        """A new or regular file: the data in a temp file beside the target (mode `mode`, never
        writable by others). In place: the target opened now (a FIFO nobody reads is refused
        before anything else is written), written by commit()."""
        self._data = data
        if self.in_place:
            try:
                # O_NONBLOCK: a FIFO that nobody reads fails at once (ENXIO) instead of hanging
                self._fd = os.open(self.target, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
                os.set_blocking(self._fd, True)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    raise self._refuse("is a FIFO nobody reads") from None
                raise self._failed(exc) from None
            return
        tmp = self.target.with_name(f".{self.target.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode & 0o755)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._failed(exc) from None
        self._staged = tmp

    def commit(self) -> None:
        if self._staged is not None:
            os.replace(self._staged, self.target)  # the commit point: the file changes whole
            self._staged = None
            return
        if self._fd is None:
            return
        try:
            view = memoryview(self._data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            raise self._failed(exc) from None
        finally:
            self.discard()

    def discard(self) -> None:
        if self._staged is not None:
            self._staged.unlink(missing_ok=True)
            self._staged = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write(self, data: bytes, mode: int = 0o644) -> None:
        self.stage(data, mode)
        try:
            self.commit()
        finally:
            self.discard()


RECORD_LIMIT = 1 << 30  # bytes: metrics.jsonl of a million logged steps is ~200 MB


class RecordError(ValueError):
    """A run record that cannot be read as one: not a regular file, or larger than any record."""


def read_bounded(path: str | Path, limit: int = RECORD_LIMIT, *, tail: bool = False,
                 errors: str = "replace") -> str:
    """The one rule for reading a run record: a regular file only (a FIFO would block `status`
    forever, a device never end), of at most `limit` bytes, or with `tail` its last `limit`
    bytes whatever its size. FileNotFoundError when it is not there, RecordError when it is not
    a record; undecodable bytes are replaced (errors="strict": UnicodeDecodeError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a FIFO opens without a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordError(f"{path} is not a regular file")
        if st.st_size > limit and not tail:
            raise RecordError(f"{path} is {st.st_size} bytes, more than a record may be ({limit})")
        with os.fdopen(os.dup(fd), "rb") as f:
            f.seek(max(0, st.st_size - limit) if tail else 0)
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while we read it
        raise RecordError(f"{path} is more than {limit} bytes, more than a record may be")
    return data.decode("utf-8", errors=errors)


def read_json(path: str | Path, default: Any = None) -> Any:
    try:
        return json.loads(read_bounded(path, 16 << 20))
    except (OSError, ValueError, RecursionError):  # missing, unreadable, not a file, not JSON: "no record"
        return default


def read_record(path: str | Path) -> dict[str, Any]:
    """A JSON object record (job.json, local.json, sweep.json); {} if missing or damaged,
    so one bad file never breaks `status` or `ls` for the other runs."""
    rec = read_json(path, {})
    return rec if isinstance(rec, dict) else {}


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One O_APPEND write per record: lines from several ranks/restarts never interleave."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    mode = file_mode(Path(path).parent)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        if os.fstat(fd).st_size == 0:  # new: its mode regardless of the umask
            with contextlib.suppress(OSError):
                os.fchmod(fd, mode)
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records; a torn last line (killed writer) is ignored. A file that is no record
    (a FIFO, a device, larger than RECORD_LIMIT) raises RecordError: a view shows the run as
    damaged, instead of hanging or running out of memory."""
    out: list[dict[str, Any]] = []
    try:
        text = read_bounded(path)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and recordtypes.type_error(rec) is None:  # a damaged line is skipped like a torn one
            out.append(rec)
    return out


def damaged_lines(path: str | Path, show: int = 2) -> str:
    """What read_jsonl skipped in `path`, said once ("" if nothing): status shows it."""
    try:
        lines = read_bounded(path).splitlines()
    except (OSError, RecordError):
        return ""
    bad: list[str] = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            why = None if n == len(lines) else "not JSON"  # the last may be torn by a killed writer
        else:
            why = recordtypes.type_error(rec) if isinstance(rec, dict) else "not a record"
        if why:
            bad.append(f"line {n} ({why})")
    if not bad:
        return ""
    more = f" and {len(bad) - show} more" if len(bad) > show else ""
    return f"{Path(path).name}: skipped {', '.join(bad[:show])}{more}"
