"""torch.compile's caches in the run dir, so that a requeued or resumed job finds them.

Compiling is the slow part of a compiled job's start: TorchInductor turns every graph into C++
(CPU) or Triton (GPU) kernels, tens of seconds per model on a small machine. torch caches the
results (FX graph cache, AOTAutograd cache, compiled kernels) by default, but under
/tmp/torchinductor_$USER: node-local, so a job requeued onto another node, or after the node's
/tmp was cleaned, compiles everything again and a resume costs a whole cold start.
Part of a rank's set-up in init() (rank/start.py), as soon as the run dir is known and before any model
code: every later torch.compile of the process (the built-in trainer's `train.compile`, or the
user's own) reads these variables when it compiles.

Why the run dir is a safe place: the cache holds pickled graphs and generated code that
torch loads and runs. The run dir is created 0700 (0750 with `[slurm] share_group`), and a
rank refuses a run dir that others can write (rundir.py), so only the job's user can put
anything there. A directory the user exported in TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR
wins (a site-wide cache, a faster local disk), unless it is torch's own node-local default.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpjob.node.cluster import ClusterEnv

CACHE = "cache"  # RUN_DIR/cache/{inductor,triton}
_set_here: dict[str, str] = {}  # what this process set (a later init in it, e.g. a test's, moves it)


def use_run_dir(run_dir: Path, env: ClusterEnv) -> None:
    """Point torch's compile caches into RUN_DIR/cache unless the user chose a place (`env`: the
    process's environment as read at start)."""
    wanted = {"TORCHINDUCTOR_CACHE_DIR": run_dir / CACHE / "inductor",
              # Triton keeps its compiled GPU kernels apart from inductor's own cache
              "TRITON_CACHE_DIR": run_dir / CACHE / "triton"}
    for name, path in wanted.items():
        inherited = env.compile_cache_vars.get(name)
        if inherited is None or inherited in (_set_here.get(name), _torch_default(name)):
            os.environ[name] = _set_here[name] = str(path)


def _torch_default(name: str) -> str | None:
    """The place torch itself writes into TORCHINDUCTOR_CACHE_DIR the first time it asks for
    its cache (`import torchvision` does: a script's imports before ddpjob.init() would otherwise
    look like the user's choice). A user who exports exactly that node-local default gets the
    run dir instead."""
    if name != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: only an unset variable is ours to set
        return None
    return os.path.abspath(default_cache_dir())


def graphs() -> dict[str, int] | None:
    """Graphs this process has compiled so far: taken from the FX graph cache ("cached") or
    compiled afresh ("compiled"); a compiled training step is two (forward and backward).
    None when nothing was compiled (torch._dynamo is then not even imported). Recorded with
    the first step of every attempt, which is where the compile time goes: a resumed attempt
    with "compiled" > 0 paid for a cold compile."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    counts = utils.counters["inductor"]
    cached, compiled = int(counts["fxgraph_cache_hit"]), int(counts["fxgraph_cache_miss"])
    return {"cached": cached, "compiled": compiled} if cached or compiled else None
