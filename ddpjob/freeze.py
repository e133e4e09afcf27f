"""Frozen code per run: what a job imports is copied into RUN_DIR/code at submission, so a
queued or requeued job never picks up code edited since (the config hash does not cover code).

What is frozen (collect):
- ddpjob itself (its package folder), so the nodes run the ddpjob that submitted the job;
- a script entry (train.entry = "x.py"): in a git checkout, every tracked file of that
  repository as it is in the working tree (uncommitted edits included, untracked files not);
  elsewhere the script's folder as it is, bounded (_folder_files; data files are copied but
  only the .py files are the code that is hashed);
- "package.module:function" plugins (train.entry, train.model, data.dataset): the top-level
  package (or module) as found on this machine's sys.path; one that is not found is recorded
  as not frozen and the nodes import it as before.

RUN_DIR/code/python/ goes first on the ranks' PYTHONPATH (template, submitit, local backend) and
RUN_DIR/code.json names the frozen entry and the code hash (sha256 over every path and file
hash). The hash goes into every checkpoint manifest; a checkpoint written by other code is not
resumed (store/state.py) unless allowed (`ddpjob run --allow-code-change`, or `ddpjob resume
--allow-code-change`, which freezes the current code and records the old hash as accepted).
Login side and node side (the live hash of `ddpjob run` by hand); never imports torch.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, rundir
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.version import __version__

CODE, RECORD = "code", "code.json"
PACKAGE = Path(__file__).resolve().parent  # the ddpjob this process imported: the live tree or a frozen copy
MAX_BYTES = 200 * 2**20  # a repository with data files in git: refuse rather than copy it per run
# An entry folder outside git is copied as it is, up to these (what does not fit is named).
FOLDER_BYTES, FOLDER_ENTRIES = 64 * 2**20, 20_000
_SKIP = ("__pycache__", ".git")


def _files_under(root: Path, prefix: str) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(f"{prefix}/{root.name}", root)]
    return [(f"{prefix}/{root.name}/{p.relative_to(root).as_posix()}", p) for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part in _SKIP for part in p.relative_to(root).parts)]


def _git_files(folder: Path) -> tuple[Path, list[Path], dict[str, Any]] | None:
    """(repository root, tracked files present in the work tree, git facts), or None outside
    a checkout (or without git)."""
    def git(where: Path, *args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.decode("utf-8", "surrogateescape") if out.returncode == 0 else None

    top = git(folder, "rev-parse", "--show-toplevel")
    if not top:
        return None
    root = Path(top.strip())
    listed = git(root, "ls-files", "-z", "--cached")  # the whole repository, not just `folder`
    if listed is None:
        return None
    files = [root / name for name in listed.split("\0") if name and (root / name).is_file()]
    commit = (git(root, "rev-parse", "HEAD") or "").strip()
    dirty = bool((git(root, "status", "--porcelain", "--untracked-files=no") or "").strip())
    return root, files, {"root": str(root), "commit": commit, "dirty": dirty}


def _folder_files(folder: Path) -> tuple[list[Path], list[tuple[Path, int]]]:
    """An entry script outside git: its folder as it is, so that data files next to the script
    work as they do in a checkout. Bounded: every .py file, then the other files in path order
    while they fit FOLDER_BYTES; run dirs, `runs/`, hidden and cache folders are never copied,
    and the walk stops after FOLDER_ENTRIES entries. Returns (kept, [(left out, size)])."""
    found: list[tuple[Path, int]] = []
    seen = 0
    for top, dirs, names in os.walk(folder):
        here = Path(top)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in (*_SKIP, "runs")
                         and not rundir.is_run_dir(here / d))
        for name in sorted(names):
            seen += 1
            path = here / name
            if seen > FOLDER_ENTRIES or name.startswith("."):
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((path, st.st_size))
    code = [(p, n) for p, n in found if p.suffix == ".py"]
    kept, total = [p for p, _ in code], sum(n for _, n in code)
    left_out: list[tuple[Path, int]] = []
    for path, size in (x for x in found if x[0].suffix != ".py"):
        if total + size <= FOLDER_BYTES:
            kept.append(path)
            total += size
        else:
            left_out.append((path, size))
    return sorted(kept), left_out


def _plugins(cfg: JobConfig) -> list[str]:
    specs = [cfg.train.entry, cfg.train.model, cfg.data.dataset]
    return sorted({s.partition(":")[0].split(".")[0] for s in specs if ":" in s and not s.endswith(".py")})


def collect(cfg: JobConfig) -> dict[str, Any]:
    """{"files": [(path in the snapshot, source file)] (the code: hashed), "data": the same for
    the other files of an entry folder outside git (copied, not hashed), "left_out": [(file,
    size)] that did not fit, "entry": snapshot path of a script entry or None, "git": facts or
    None, "not_frozen": [plugin names not found here]}."""
    files = _files_under(PACKAGE, "python")
    entry_rel, git_facts = None, None
    missing: list[str] = []
    left_out: list[tuple[Path, int]] = []
    data: list[tuple[str, Path]] = []
    if cfg.train.entry.endswith(".py"):
        script = Path(cfg.train.entry).resolve()
        tracked = _git_files(script.parent)
        if tracked is not None and script in tracked[1]:
            root, paths, git_facts = tracked
            files += [(f"repo/{p.relative_to(root).as_posix()}", p) for p in paths]
            entry_rel = f"repo/{script.relative_to(root).as_posix()}"
        else:
            kept, left_out = _folder_files(script.parent)
            copies = [(f"entry/{p.relative_to(script.parent).as_posix()}", p) for p in kept]
            files += [x for x in copies if x[1].suffix == ".py"]
            # data next to the script: copied, not hashed (a log file written there must not
            # read as a code change that refuses the checkpoints)
            data = [x for x in copies if x[1].suffix != ".py"]
            entry_rel = f"entry/{script.name}"
    for name in _plugins(cfg):
        if name == "ddpjob":
            continue
        try:  # where the ranks would find it: sys.path, then the working directory (runner.py)
            spec = importlib.machinery.PathFinder.find_spec(name, [*sys.path, os.getcwd()])
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        if origin is None or not origin.is_file() or "site-packages" in origin.parts:
            missing.append(name)  # installed libraries are the environment's, not the run's
            continue
        files += _files_under(origin.parent if origin.name == "__init__.py" else origin, "python")
    return {"files": sorted(set(files)), "entry": entry_rel, "git": git_facts, "not_frozen": missing,
            "data": data, "left_out": left_out}


def digest(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def freeze(cfg: JobConfig, run_dir: Path, *, accepts: tuple[str, ...] = ()) -> dict[str, Any]:
    """Copy the code into RUN_DIR/code (replacing an older copy as a whole) and write code.json."""
    found = collect(cfg)
    if found["left_out"]:
        names = ", ".join(f"{p.name} ({n / 2**20:.0f} MB)" for p, n in found["left_out"][:3])
        more = f" and {len(found['left_out']) - 3} more" if len(found["left_out"]) > 3 else ""
        console.warn(f"the entry's folder is not in git, so it is frozen as it is, up to "
                     f"{FOLDER_BYTES // 2**20} MB: left out {names}{more}, which the frozen script "
                     "will not find next to it. Hint: read large data from an absolute path (a [user] "
                     "key), or commit the code to git")
    copies = found["files"] + found["data"]
    total = sum(p.stat().st_size for _, p in copies)
    if total > MAX_BYTES:
        raise DDPJobError(f"the code to freeze for this run is {total / 2**20:.0f} MB (git-tracked files of "
                          f"{(found['git'] or {}).get('root', 'the entry folder')}), expected at most "
                          f"{MAX_BYTES // 2**20} MB", "keep data and checkpoints out of git, or move "
                          "the entry script into a smaller repository")
    staging = run_dir / f".{CODE}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    # the run dir's modes, whatever the umask or the sources' modes: code nobody else can edit
    dmode, fmode = rundir.dir_mode(cfg.slurm.share_group), fileio.file_mode(run_dir)
    for rel, path in copies:
        target = staging / rel
        for parent in reversed([p for p in target.parents if p == staging or staging in p.parents]):
            if not parent.is_dir():
                parent.mkdir()
                parent.chmod(dmode)
        shutil.copyfile(path, target)
        target.chmod(fmode)
    record = {"hash": digest(found["files"]), "files": len(copies), "bytes": total,
              "ddpjob_version": __version__, "entry": found["entry"],
              "original_entry": cfg.train.entry or None, "git": found["git"],
              "not_frozen": found["not_frozen"], "accepts": list(accepts)}
    old = run_dir / CODE
    if old.exists():
        shutil.rmtree(old)
    staging.rename(old)
    fileio.write_json_atomic(run_dir / RECORD, record)
    return record


def record(run_dir: Path) -> dict[str, Any]:
    return fileio.read_record(run_dir / RECORD)


def python_path(run_dir: Path) -> Path:
    """What goes first on the ranks' PYTHONPATH."""
    return run_dir / CODE / "python"


def frozen_entry(run_dir: Path, cfg: JobConfig) -> str:
    """The script the ranks run: the frozen copy when there is one, else train.entry."""
    rel = record(run_dir).get("entry")
    if isinstance(rel, str) and cfg.train.entry.endswith(".py") and (run_dir / CODE / rel).is_file():
        return str(run_dir / CODE / rel)
    return cfg.train.entry


def running_hash(cfg: JobConfig, run_dir: Path) -> tuple[str, tuple[str, ...]]:
    """(hash of the code this process runs, hashes it accepts besides): the frozen copy's when
    ddpjob was imported from it, else the live code's, hashed by the same rule."""
    rec = record(run_dir)
    here = PACKAGE
    frozen = python_path(run_dir).resolve()
    if rec.get("hash") and here.is_relative_to(frozen):
        return str(rec["hash"]), tuple(str(h) for h in rec.get("accepts") or ())
    return digest(collect(cfg)["files"]), ()


def source_of(run_dir: Path | None, path: str) -> str:
    """The file the user wrote for `path` when it is a frozen copy (RUN_DIR/code/repo/... or
    code/entry/...): a crash's line names their file, not the copy. Else `path` as it is."""
    if run_dir is None:
        return path
    try:
        rel = Path(path).resolve().relative_to((run_dir / CODE).resolve()).as_posix()
    except (ValueError, OSError):
        return path
    rec = record(run_dir)
    root = (rec.get("git") or {}).get("root") if isinstance(rec.get("git"), dict) else None
    if rel.startswith("repo/") and isinstance(root, str):
        return str(Path(root) / rel.removeprefix("repo/"))
    original = rec.get("original_entry")
    if rel.startswith("entry/") and isinstance(original, str):
        return str(Path(original).resolve().parent / rel.removeprefix("entry/"))
    return path
