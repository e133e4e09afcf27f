"""[slurm] container: the ranks run inside a container image, on both script paths.

- pyxis/enroot (`container_runtime = "pyxis"`): srun takes `--container-image` and
  `--container-mounts`; pyxis starts each task inside the container, so SLURM's signals reach
  the training processes themselves.
- apptainer (`"apptainer"`, also `"singularity"`): each task is
  `apptainer exec --bind MOUNTS IMAGE PYTHON -u -m ddpjob run RUN_DIR`; apptainer forwards the
  signals it gets (TERM, USR2 ...) to the process it runs.

Mounted at the same path inside: the run dir (checkpoints, logs, events), data.root, the code
(ddpjob's own source folder and train.entry's folder) and the interpreter's prefix, so the same
`python -m ddpjob run` works inside; plus `container_mounts` ("SRC" or "SRC:DST"). With
`container_python` the container's own interpreter runs instead (ddpjob installed in the image):
the default runs the submitting interpreter, which inside an image only works where the image
has the libraries it links against (the same OS release), so for real images set it.
Pure functions of the config, used by render.py (template) and backends/submitit_slurm.py
(submitit); strings are checked by validate.py (no comma, colon or control character where
the runtimes split on them).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ddpjob.config import JobConfig
from ddpjob.errors import UsageError


def mounts(cfg: JobConfig, run_dir: str, python: str) -> list[tuple[str, str]]:
    """(host path, container path) pairs, without duplicates or paths inside another."""
    s, t = cfg.slurm, cfg.train
    wanted = [run_dir, str(Path(__file__).resolve().parents[2])]  # the folder ddpjob is imported from
    root = Path(cfg.data.root).absolute() if cfg.data.root else None
    # synthetic data needs no folder; a real dataset's missing root is the data check's to report
    if root is not None and cfg.data.dataset != "synthetic" and (root.exists() or cfg.data.dataset == "cifar10"):
        wanted.append(str(root))
    if t.entry.endswith(".py"):
        wanted.append(str(Path(t.entry).absolute().parent))
    if not s.container_python:
        wanted.append(str(Path(sys.prefix).resolve()))
        wanted.append(str(Path(python).absolute().parent))
    # first-seen order, not sorted: the script must not depend on where ddpjob is installed
    same = list(dict.fromkeys(wanted))
    # a folder inside another mounted one is visible already
    same = [p for p in same if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in same)]
    for path in same:  # the runtimes split their mount lists on "," and ":"
        if "," in path or ":" in path:
            raise UsageError(f"'{path}' must be mounted into the container but has a comma or a "
                             "colon, which pyxis and apptainer read as separators",
                             "move it to a path without them")
    extra = [(m.partition(":")[0], m.partition(":")[2] or m.partition(":")[0]) for m in s.container_mounts]
    return [(p, p) for p in same] + [pair for pair in extra if pair[0] not in same]


def interpreter(cfg: JobConfig, python: str) -> str:
    return cfg.slurm.container_python or python


def srun_options(cfg: JobConfig, run_dir: str, python: str) -> list[str]:
    """Options for the srun line (pyxis); [] for no container or apptainer."""
    s = cfg.slurm
    if not s.container or s.container_runtime != "pyxis":
        return []
    pairs = ",".join(f"{a}:{b}" for a, b in mounts(cfg, run_dir, python))
    return [f"--container-image={s.container}", f"--container-mounts={pairs}",
            f"--container-workdir={run_dir}"]


def exec_prefix(cfg: JobConfig, run_dir: str, python: str) -> list[str]:
    """The words before the interpreter (apptainer exec ... IMAGE); [] otherwise."""
    s = cfg.slurm
    if not s.container or s.container_runtime == "pyxis":
        return []
    binds = ",".join(a if a == b else f"{a}:{b}" for a, b in mounts(cfg, run_dir, python))
    return [s.container_runtime, "exec", "--bind", binds, "--pwd", run_dir, s.container]
