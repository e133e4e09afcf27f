"""The run directory: one folder per submission, the only thing the compute nodes read.

Written on the login node (config.json, job.json, the submitted script) and appended to by the
ranks (events.jsonl, metrics.jsonl, checkpoints/). Layout in docs/design.md. Small JSON records
are written atomically (temp file + rename) so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ddpjob import recordtypes
from ddpjob.errors import DDPJobError, UsageError

if TYPE_CHECKING:
    from ddpjob.config import JobConfig

CONFIG = "config.json"
JOB = "job.json"
EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
COMPLETED = "COMPLETED"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
FINAL = "final"


def new_run_dir(runs_root: str | Path, name: str) -> Path:
    """runs/<name>-<UTC time>-<random>: unique without coordination, sorts by time."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(runs_root) / f"{name}-{stamp}-{secrets.token_hex(2)}"


def dir_mode(share_group: bool) -> int:
    """Run dirs are private (0700), or readable by the group with slurm.share_group (0750).
    Never writable by others: submitit unpickles RUN_DIR/logs/*_submitted.pkl and `ddpjob run`
    imports train.entry from config.json, so whoever can write the run dir runs code as the
    job's user."""
    return 0o750 if share_group else 0o700


def file_mode(folder: str | Path) -> int:
    """0640 in a group-readable folder, else 0600: files follow their run dir."""
    try:
        group = Path(folder).stat().st_mode & 0o050 == 0o050
    except OSError:
        group = False
    return 0o640 if group else 0o600


def private_umask(share_group: bool) -> None:
    """What ddpjob's own processes create (run dirs, checkpoints, logs, submitit's pickle, the
    compile caches) gets 0600/0700, or 0640/0750 with slurm.share_group, whatever umask the user
    came with (Debian's 002 would make them group-writable: code others could run as the job's
    user). Set by every ddpjob command that writes a run dir and by each rank; SLURM hands it on
    to the job (sbatch and srun pass their umask as SLURM_UMASK)."""
    os.umask(0o027 if share_group else 0o077)


def make_dir(path: Path, share_group: bool = False) -> None:
    """Create `path` (and missing parents, as usual) and set its mode explicitly: the umask
    neither loosens nor tightens it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, dir_mode(share_group))


def check_private(run_dir: Path) -> None:
    """Refuse a run dir (or its logs/ folder, or config.json) that someone else can change:
    group- or world-writable, or owned by another user (who could loosen it at any time), or
    below a folder where anyone may rename it (check_parents)."""
    check_parents(run_dir)
    for p in (run_dir, run_dir / LOGS, run_dir / CONFIG):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise DDPJobError(f"cannot inspect {p} ({exc.strerror})", "check its permissions") from None
        if st.st_mode & 0o022 or st.st_uid != os.geteuid():
            who = "group/world-writable" if st.st_mode & 0o022 else f"owned by uid {st.st_uid}"
            raise DDPJobError(f"{p} is {who} (mode {st.st_mode & 0o777:o}), expected a run dir "
                              "only you can write: others could run code as you through it",
                              f"chmod go-w {p} (if you trust its contents), or resubmit")


def check_parents(run_dir: Path) -> None:
    """Refuse a run dir below a folder that anyone may write and that lacks the sticky bit
    (chmod 777 scratch space): anyone could rename the run away and put a run of theirs in its
    place, whose code/ goes first on the ranks' PYTHONPATH and whose logs/ holds the pickle
    submitit loads, so they would run code as the job's user at its next start or requeue.
    Refused, not warned: the hole stays open for the run's whole life, and a warning at submit
    is read once if at all; the fix (chmod +t, or another folder) takes a second. A sticky
    folder (/tmp, a 1777 scratch) lets only an entry's owner rename it: fine. Every folder up
    to / counts, through links (a rename anywhere above moves the run)."""
    above = run_dir.absolute().parent
    existing = next(p for p in [above, *above.parents] if os.path.isdir(p))
    real = Path(os.path.realpath(existing))
    for p in [real, *real.parents]:
        mode = os.stat(p).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise DDPJobError(f"run directory '{run_dir}' is below '{p}', which anyone may write and "
                              f"which has no sticky bit (mode {stat.S_IMODE(mode):04o}): anyone could "
                              "swap the run for one of theirs, expected folders only you can change, or "
                              "sticky ones like /tmp (1777)", f"chmod +t {p}, or choose a --run-dir elsewhere")


def unreadable(path: str | Path) -> str:
    """'' when this user can read `path` (a folder: list it and open what is in it); else why
    not, for one line or a DAMAGED row: another user's private run in a shared runs root. The
    tests run as root, whom no mode stops: tests/unit/test_permissions.py runs them as nobody."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    except OSError:  # a folder above it cannot be searched
        return whose(path)
    wants = os.R_OK | (os.X_OK if stat.S_ISDIR(st.st_mode) else 0)
    return "" if os.access(path, wants) else whose(path)


def whose(path: str | Path) -> str:
    """`path`'s owner and mode beside this user, in words (the found part of a permission line);
    where `path` cannot even be looked at, the folder above it that stops this user."""
    try:
        st = os.stat(path)
    except OSError as exc:
        closed = next((p for p in Path(path).parents if os.path.isdir(p) and not os.access(p, os.X_OK)), None)
        return whose(closed) if closed is not None else f"'{path}' cannot be looked at ({exc.strerror})"
    return (f"'{path}' belongs to {_user(st.st_uid)} (mode {stat.S_IMODE(st.st_mode):04o}) and "
            f"ddpjob runs as {_user(os.geteuid())}")


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


UNREADABLE_HINT = ("run ddpjob as the run's owner, or have them submit with slurm.share_group = true "
                   "(their group may then read the run)")


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


NEW, SAME, RESIZED = "new", "same", "resized"


def check_reuse(path: Path, cfg: JobConfig) -> str:
    """The one run-dir policy (submit, sbatch, run), decided before anything is written: NEW (no
    folder, or an empty one), SAME (a run dir of this very config), RESIZED (the same training
    at other resources or length: config.json takes the new ones and the checkpoints resume
    elastically). Anything else is refused with one line."""
    from ddpjob import jobfile

    check_parents(path)
    if not path.exists():
        return NEW
    if not path.is_dir():
        raise UsageError(f"run directory '{path}' exists and is not a folder, expected a new or "
                         "empty folder or a run dir of this job", "choose another --run-dir")
    why = unreadable(path)
    if why:
        raise DDPJobError(f"cannot read run directory: {why}, expected a run dir you can read",
                          UNREADABLE_HINT)
    if not is_run_dir(path):
        try:
            empty = not any(path.iterdir())
        except OSError as exc:
            raise DDPJobError(f"cannot read run directory '{path}' ({exc.strerror})",
                              "choose a readable --run-dir") from None
        if empty:
            return NEW
        raise UsageError(f"run directory '{path}' is not empty and has no {CONFIG}, expected a new "
                         "or empty folder or a run dir of this job", "choose a new --run-dir")
    old = jobfile.read_run_config(path)
    if old.hash() != cfg.hash():
        from ddpjob.config import differences

        raise UsageError(f"run directory '{path}' holds another job (config hash {old.hash()}, this "
                         f"job has {cfg.hash()}: {'; '.join(differences(old, cfg))[:600]}), expected the "
                         "same model, data and optimizer",
                         "use a new --run-dir, or the job file that made this one; a [user] key that may "
                         "change at a resume is listed in train.user_free when the run is submitted")
    return SAME if old.to_json() == cfg.to_json() else RESIZED


def prepare(path: Path, cfg: JobConfig) -> Path:
    """Make `path` the run dir of `cfg` (check_reuse, then create it / write config.json)."""
    from ddpjob import console

    state = check_reuse(path, cfg)
    if state == SAME:
        return path
    if state == RESIZED:
        console.print0(f"ddpjob: {path}/config.json updated (resources or length changed)")
    make_dir(path, cfg.slurm.share_group)
    write_text_atomic(path / CONFIG, cfg.to_json())
    return path


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


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def require_run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not is_run_dir(p):
        raise DDPJobError(f"'{path}' is not a ddpjob run directory (no {CONFIG})",
                          "pass a folder made by `ddpjob submit`; `ddpjob ls` lists them")
    return p


def completed(run_dir: str | Path) -> dict[str, Any] | None:
    rec = read_json(Path(run_dir) / COMPLETED)
    return rec if isinstance(rec, dict) or rec is None else {"damaged": True}


def refuse_completed(path: Path) -> None:
    """A finished run is not submitted again (`submit`, `sbatch`; `resume` says the same): its
    config.json would take the new settings and nothing would train."""
    done = completed(path)
    if done is not None:
        raise UsageError(f"run directory '{path}' completed at step {done.get('step', '?')}, expected a run "
                         "that can go on", "to train on from its weights, submit a new run with "
                         f"--set checkpoint.init_from='\"{path}\"' (add \"optimizer\" to checkpoint.init_keys "
                         "to keep its optimizer state)")


def mark_completed(run_dir: str | Path, **info: Any) -> None:
    write_json_atomic(Path(run_dir) / COMPLETED, {"time": time.time(), **info})
