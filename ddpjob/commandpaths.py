"""Where a [train] command runs and what its arguments say, read alike by the nodes' rank
(rank/commandenv.py, which starts the program), the crash decision's progress evidence
(rank/requeue.py, launch/local.py) and the login side's preflight (launch/commandcheck.py):
`{run_dir}` and `{attempt}` filled in, its working directory, its progress path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddpjob.config import JobConfig

PLACEHOLDERS = ("{run_dir}", "{attempt}")


def expand(text: str, run_dir: Path, attempt: int) -> str:
    """`text` with the placeholders filled in; any other brace is the program's own (a JSON
    argument, a format string it reads)."""
    return text.replace("{run_dir}", str(run_dir)).replace("{attempt}", str(attempt))


def argv(cfg: JobConfig, run_dir: Path, attempt: int) -> list[str]:
    return [expand(arg, run_dir, attempt) for arg in cfg.train.command]


def workdir(cfg: JobConfig, run_dir: Path, attempt: int) -> Path:
    """The program's working directory: [train] command_cwd (relative: to the directory the job
    was submitted from), else that directory itself, as for `python train.py` typed there."""
    here = Path.cwd()
    if not cfg.train.command_cwd:
        return here
    return here / expand(cfg.train.command_cwd, run_dir, attempt)


def progress_path(cfg: JobConfig, run_dir: Path, attempt: int) -> Path | None:
    """[train] command_progress as a path (relative: to the program's working directory), None
    where it is not set (ledger/progress.py)."""
    if not cfg.train.command_progress:
        return None
    return workdir(cfg, run_dir, attempt) / expand(cfg.train.command_progress, run_dir, attempt)


def pinned(cfg: JobConfig) -> JobConfig:
    """At submission: a command's working directory made absolute (by default the directory it is
    submitted from), so every later start runs it there: a requeue, a restart in place, and a
    `ddpjob resume` typed anywhere (or a job SLURM starts in another folder)."""
    t = cfg.train
    if not t.command or (t.command_cwd and (Path(t.command_cwd).is_absolute() or any(p in t.command_cwd for p in PLACEHOLDERS))):
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(t, command_cwd=str(Path.cwd() / t.command_cwd)))
