"""What submit can check about the job's own code and inputs on the login node, before the queue
wait: train.entry parses (a script) or names a function that its module defines (package.module:
function), and checkpoint.init_from exists. Nothing is imported or run: the module is found the
way `import` would find it (importlib's PathFinder, over the working directory and sys.path) and
its source is parsed; torch stays out (the login side never imports it).

Part of `ddpjob doctor`'s cheap checks (doctor.cheap_checks), which `submit` runs first; each
answer is a launch/checks.Check.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TYPE_CHECKING

from ddpjob.launch.checks import FAIL, PASS, WARN, Check

if TYPE_CHECKING:
    from ddpjob.config import JobConfig


def entry_check(cfg: JobConfig) -> Check:
    entry = cfg.train.entry
    if not entry:
        return Check("entry", PASS, "the built-in trainer")
    if entry.endswith(".py"):
        problem = _parse_problem(Path(entry))
        if problem:
            return Check("entry", FAIL, f"train.entry script {entry} does not parse: {problem}",
                         f"fix {entry}, then submit again")
        return Check("entry", PASS, f"{entry} parses")
    module, _, func = entry.partition(":")
    source = _find_module(module)
    if source is None:
        # a container's or a `module load`'s package may exist only on the nodes
        elsewhere = bool(cfg.slurm.container or cfg.slurm.setup)
        return Check("entry", WARN if elsewhere else FAIL,
                     f"train.entry module '{module}' is not importable here (searched the working "
                     "directory and sys.path)" + (", expected it on the nodes" if elsewhere else ""),
                     "run ddpjob from the folder that holds the package, or install it")
    if source.suffix != ".py":  # compiled or built in: nothing to parse
        return Check("entry", PASS, f"{module} found ({source.name})")
    problem = _parse_problem(source)
    if problem:
        return Check("entry", FAIL, f"train.entry module {source} does not parse: {problem}",
                     f"fix {source}, then submit again")
    names = _top_level_names(source)
    if names is not None and func not in names:
        close = difflib.get_close_matches(func, sorted(names), n=1)
        return Check("entry", FAIL, f"train.entry '{entry}': {source} defines no '{func}'",
                     (f"did you mean '{close[0]}'? " if close else "") + f"define `def {func}():` in {source}")
    return Check("entry", PASS, f"{module}:{func} is defined in {source}")


# [train] keys that ddpjob itself reads for any entry (api.py, node/): the rest are the built-in
# trainer's, which a custom entry sees only if it reads job.config.train.<key> itself.
RUNTIME_TRAIN_KEYS = frozenset({
    "seed", "threads", "backend", "dist_timeout_s", "deterministic", "deterministic_reduce",
    "grad_compression", "strategy", "stop_vote", "tensorboard", "metrics_textfile", "trackers", "tracker_project",
    "mlflow_uri", "log_sample_ids", "amp", "entry", "args"})


def unused_overrides(cfg: JobConfig, overrides: list[str]) -> list[str]:
    """`--set train.K=...` that a custom entry never reads: one warning line each (the value
    would do nothing). "Never reads" means K does not occur as a word in the entry's source."""
    entry = cfg.train.entry
    if not entry:
        return []
    keys = sorted({o.partition("=")[0].strip().removeprefix("train.") for o in overrides
                   if o.strip().startswith("train.")} - RUNTIME_TRAIN_KEYS)
    if not keys:
        return []
    source = Path(entry) if entry.endswith(".py") else _find_module(entry.partition(":")[0])
    try:
        text = source.read_text(errors="replace") if source is not None and source.suffix == ".py" else None
    except OSError:
        text = None
    if text is None or source is None:
        return []
    return [f"--set train.{k}: {source.name} never reads train.{k}, which only the built-in trainer "
            f"uses, so it changes nothing. Hint: read it as job.config.train.{k}, or use a [user] key "
            f"(--set user.{k}=...)" for k in keys if not re.search(rf"\b{re.escape(k)}\b", text)]


def init_from_check(cfg: JobConfig) -> Check | None:
    source = cfg.checkpoint.init_from
    if not source:
        return None
    if not os.path.exists(source):
        return Check("init_from", FAIL, f"checkpoint.init_from '{source}' does not exist",
                     "give a run dir, RUN/checkpoints/step-N or a weights file (relative to where you submit)")
    return Check("init_from", PASS, f"{source} exists")


def _parse_problem(path: Path) -> str:
    """'' when `path` parses as Python, else why not (a line)."""
    try:
        ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:  # NUL bytes: no line (Python 3.11.4 and on)
        return f"{exc.msg} (line {exc.lineno})" if exc.lineno else exc.msg
    except ValueError as exc:  # NUL bytes
        return str(exc)
    except OSError as exc:
        return f"cannot read it ({exc.strerror})"
    return ""


def _find_module(dotted: str) -> Path | None:
    """The file `import dotted` would load, found without importing anything (a package's
    __init__ could import torch, or fail here for reasons of its own)."""
    search: list[str] | None = [os.getcwd(), *sys.path]
    parts = dotted.split(".")
    origin = None
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if spec is None:
            return None
        origin, search = spec.origin, list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and not search:
            return None  # not a package: it has no submodules
    if origin is None or origin in ("built-in", "frozen"):
        return Path(dotted)  # no file: found, nothing to parse
    return Path(origin)


def _top_level_names(path: Path) -> set[str] | None:
    """Names a module binds at its top level, in any branch of an if/try/with there; None when it
    could bind any (a star import, a module __getattr__): then its source proves nothing."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_bytes(), filename=str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return None if "__getattr__" in names else names
