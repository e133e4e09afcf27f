"""A [train] command's preflight on the login node (submit and sbatch): the script a `python
train.py` command names exists where the program will run, so that a typo fails here in one
line, not on the nodes after a wait in the queue as "your code raised"; the program is on PATH
(a warning: the nodes' setup lines may put it there)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ddpjob import console
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.commandpaths import PLACEHOLDERS

_PYTHONS = ("python", "python3")


def script_of(command: tuple[str, ...]) -> str | None:
    """The script a Python command runs (`python [-u ...] train.py ...`), None for another program,
    `python -m pkg` or `-c`."""
    if not command or os.path.basename(command[0]).split(".")[0] not in _PYTHONS:
        return None
    for arg in command[1:]:
        if arg in ("-m", "-c") or arg.startswith(("-m", "-c")) and not arg.startswith("--"):
            return None
        if arg.startswith("-"):
            continue  # the interpreter's own options (-u, -O, -X dev: a value never ends in .py)
        return arg
    return None


def check(cfg: JobConfig, *, strict: bool) -> None:
    """Raise (strict: `ddpjob submit`) or warn (`ddpjob sbatch`: the script runs where sbatch is
    typed) when the command's script is missing; warn when its program is not on PATH."""
    t = cfg.train
    if not t.command:
        return
    cwd = Path.cwd() / t.command_cwd if t.command_cwd and not any(p in t.command_cwd for p in PLACEHOLDERS) else Path.cwd()
    script = script_of(t.command)
    if script is not None and not any(p in script for p in PLACEHOLDERS) and not (cwd / script).is_file():
        line = (f"train.command runs the script '{script}', which is not in {cwd} (the command's working "
                "directory), expected the file there")
        hint = "run ddpjob from the script's folder, give its path, or set [train] command_cwd"
        if strict:
            raise DDPJobError(line, hint)
        console.warn(f"{line} (hint: {hint})")
    program = t.command[0]
    if "/" not in program and shutil.which(program) is None:
        console.warn(f"train.command's program '{program}' is not on this node's PATH; the nodes must have it "
                     "(hint: [slurm] setup lines such as `source venv/bin/activate`)")
