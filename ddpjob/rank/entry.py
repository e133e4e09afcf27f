"""Runs the job file's `train.entry` in this rank's process: a script ("path/to/script.py", run
as `__main__` with `sys.argv = [script, *train.args]`) or a function ("package.module:function",
called with no arguments and the same sys.argv, like a console-script entry point).
The built-in trainer is the default entry.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob.errors import DDPJobError

BUILTIN = "ddpjob.train.trainer:main"


def describe(entry: str) -> str:
    return entry or f"{BUILTIN} (the built-in trainer)"


def run(entry: str, args: Sequence[str]) -> None:
    """Run the entry to its end; its exceptions (SystemExit included) propagate."""
    spec = entry or BUILTIN
    if spec.endswith(".py"):
        script = Path(spec)
        if not script.is_file():
            raise DDPJobError(f"train.entry script '{script}' does not exist on this node, expected "
                              "the Python file the job was submitted with",
                              "put the script on a filesystem every node shares, or fix train.entry")
        sys.argv = [str(script), *args]
        sys.path.insert(0, str(script.resolve().parent))  # as `python script.py` would
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SyntaxError as exc:
            raise _nul_bytes(exc, [script]) from None
        return
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        raise _nul_bytes(exc, _module_files(module_name)) from None
    except ModuleNotFoundError as exc:
        # Only a missing entry module is ours to explain; a missing import inside it is the
        # user's bug and keeps its traceback.
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise
        raise DDPJobError(f"train.entry module '{module_name}' cannot be imported (no module named "
                          f"'{exc.name}'), expected an importable package.module",
                          "install the package on the nodes, or run ddpjob from the folder that "
                          "contains it (it is put on sys.path)") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        import difflib

        functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(func_name, functions, n=1)
        raise DDPJobError(f"train.entry '{spec}': module '{module_name}' has no function "
                          f"'{func_name}', expected a callable taking no arguments",
                          (f"did you mean '{close[0]}'? " if close else "")
                          + f"define `def {func_name}():` in {_source_file(module)}")
    sys.argv = [spec, *args]
    func()


def _nul_bytes(exc: SyntaxError, files: Sequence[Path]) -> BaseException:
    """Python refuses a source file with NUL bytes in it with a SyntaxError that names no file
    and no line, so nothing would say which: the first of `files` (the entry's own) holding one
    is named. Any other SyntaxError is the user's, and goes on as it was raised."""
    if exc.filename is None:
        for path in files:
            try:
                found = b"\0" in path.read_bytes()
            except OSError:
                continue
            if found:
                return DDPJobError(f"train.entry {path} contains NUL bytes, expected Python source text",
                                   f"save {path} again as plain text (a binary file, or one an editor "
                                   "wrote in UTF-16?)")
    return exc


def _module_files(module_name: str) -> list[Path]:
    """The source files `import module_name` reads: each package's __init__ on the way, then the
    module's own (found, not imported: a failing package stops the search there)."""
    parts, files = module_name.split("."), []
    for i in range(1, len(parts) + 1):
        try:
            found = importlib.util.find_spec(".".join(parts[:i]))
        except Exception:  # a package above failed to import: its file is already listed
            break
        if found is not None and found.origin and os.path.isfile(found.origin):
            files.append(Path(found.origin))
    return files


def _source_file(module: Any) -> str:
    """Where the user edits the module: a run's frozen copy (RUN_DIR/code/python/pkg/mod.py) is
    named by its original, which code.json's run dir cannot tell, so by the path inside the copy."""
    path = str(getattr(module, "__file__", "") or module.__name__)
    marker = f"{os.sep}code{os.sep}python{os.sep}"
    if marker in path:
        return f"{path.split(marker, 1)[1]} (in your source tree; the job runs a copy frozen at submission)"
    return path
