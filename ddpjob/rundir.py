"""The run directory: one folder per submission, the only thing the compute nodes read.

Written on the login node (config.json, job.json, the submitted script) and appended to by the
ranks (events.jsonl, metrics.jsonl, checkpoints/). Layout in docs/design.md. Small JSON records
are written atomically (temp file + rename) so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

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


def make_dir(path: Path, share_group: bool = False) -> None:
    """Create `path` (and missing parents, as usual) and set its mode explicitly: the umask
    neither loosens nor tightens it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, dir_mode(share_group))


def check_private(run_dir: Path) -> None:
    """Refuse a run dir (or its logs/ folder, or config.json) that someone else can change:
    group- or world-writable, or owned by another user (who could loosen it at any time)."""
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


NEW, SAME, RESIZED = "new", "same", "resized"


def check_reuse(path: Path, cfg: JobConfig) -> str:
    """The one run-dir policy (submit, sbatch, run), decided before anything is written: NEW (no
    folder, or an empty one), SAME (a run dir of this very config), RESIZED (the same training
    at other resources or length: config.json takes the new ones and the checkpoints resume
    elastically). Anything else is refused with one line."""
    from ddpjob import config

    if not path.exists():
        return NEW
    if not path.is_dir():
        raise UsageError(f"run directory '{path}' exists and is not a folder, expected a new or "
                         "empty folder or a run dir of this job", "choose another --run-dir")
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
    old = config.read_run_config(path)
    if old.hash() != cfg.hash():
        raise UsageError(f"run directory '{path}' holds another job (config hash {old.hash()}, this "
                         f"job has {cfg.hash()}), expected the same model, data and optimizer",
                         "use a new --run-dir, or the job file that made this one")
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


def read_json(path: str | Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON: all "no record"
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
    """All complete records; a torn last line (killed writer) is ignored."""
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):  # a damaged line ([], null, "x") is skipped like a torn one
            out.append(rec)
    return out


def record_event(run_dir: str | Path, event: str, **fields: Any) -> None:
    """A (re)start or stop, with its reason: what `status`, `plot` and the tests read."""
    append_jsonl(Path(run_dir) / EVENTS, {"time": time.time(), "event": event, **fields})


def events(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / EVENTS)


def run_restart(run_dir: str | Path, job_id: str | None, slurm_restart: int) -> int:
    """This incarnation's restart number within the run: SLURM's count for this job id plus, for
    a successor job (whose SLURM_RESTART_COUNT starts at 0 again), the restart of the stop that
    submitted it plus one. Every rank computes the same from the file."""
    base = 0
    for e in events(run_dir):
        if e.get("requeued_by") == "successor" and str(e.get("next_job_id")) == str(job_id):
            base = int(e.get("restart") or 0) + 1
    return base + slurm_restart


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


def mark_completed(run_dir: str | Path, **info: Any) -> None:
    write_json_atomic(Path(run_dir) / COMPLETED, {"time": time.time(), **info})
