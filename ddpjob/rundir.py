"""The run directory: one folder per submission, the only thing the compute nodes read. Its
layout, its modes and who may own it, and its one reuse policy (a new run, the same one, the same
training at other resources; anything else refused).

Written on the login node (config.json, job.json, the submitted script) and appended to by the
ranks (events.jsonl, metrics.jsonl, checkpoints/). Layout in docs/design.md. How its files are
written and read (atomically, bounded) is fileio.py's.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpjob import fileio
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


USER_UMASK = "DDPJOB_USER_UMASK"  # the user's umask before ddpjob made its own (private_umask)


def private_umask(share_group: bool) -> None:
    """What ddpjob's own processes create (run dirs, checkpoints, logs, submitit's pickle, the
    compile caches) gets 0600/0700, or 0640/0750 with slurm.share_group, whatever umask the user
    came with (Debian's 002 would make them group-writable: code others could run as the job's
    user). Set by every ddpjob command that writes a run dir and by each rank; SLURM hands it on
    to the job (sbatch and srun pass their umask as SLURM_UMASK). The umask the user came with
    is noted first in USER_UMASK (the first ddpjob process of a job notes it; its children and
    the job inherit the note): a [train] command's program runs with it (rank/commandenv.py)."""
    old = os.umask(0o027 if share_group else 0o077)
    os.environ.setdefault(USER_UMASK, f"{old:04o}")


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
    fileio.write_text_atomic(path / CONFIG, cfg.to_json())
    return path


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def require_run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not is_run_dir(p):
        raise DDPJobError(f"'{path}' is not a ddpjob run directory (no {CONFIG})",
                          "pass a folder made by `ddpjob submit`; `ddpjob ls` lists them")
    return p


def completed(run_dir: str | Path) -> dict[str, Any] | None:
    rec = fileio.read_json(Path(run_dir) / COMPLETED)
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
    fileio.write_json_atomic(Path(run_dir) / COMPLETED, {"time": time.time(), **info})


def follow_successor(run_dir: Path, old: str, new: str) -> None:
    """Job `new` succeeds `old` (a requeue by a successor job): job.json makes it the job that
    status, logs and cancel follow, `job_ids` keeps the chain, and submitit's task pickle is
    copied under the new id (the backend's script loads RUN_DIR/logs/NEWID_submitted.pkl)."""
    job = fileio.read_json(run_dir / JOB, {}) or {"backend": "slurm", "via": "sbatch"}
    chain = list(job.get("job_ids") or [job.get("job_id") or old])
    job.update(job_id=new, job_ids=[*chain, new])
    fileio.write_json_atomic(run_dir / JOB, job)
    folder = Path(job.get("log_folder") or run_dir / LOGS)
    pickle = folder / f"{old}_submitted.pkl"
    if pickle.is_file():
        fileio.write_atomic(folder / f"{new}_submitted.pkl", lambda f: f.write(pickle.read_bytes()))
