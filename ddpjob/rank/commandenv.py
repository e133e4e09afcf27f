"""What a [train] command's program gets from ddpjob (rank/command.py starts it): what torchrun
would give it and nothing of ddpjob's internals.

- its arguments and working directory ([train] command_cwd) with `{run_dir}` and `{attempt}`
  filled in, so that a checkpoint path can live in the run dir (a fixed path in the submit
  directory is shared by every run submitted from there);
- the user's own environment (node/cluster.command_environ: without the PYTHONSAFEPATH and the
  frozen code ddpjob's launch puts first on PYTHONPATH for its own Python) with torchrun's
  variables;
- the user's umask (DDPJOB_USER_UMASK, noted by rundir.private_umask or the batch script before
  ddpjob made its own 077/027): the program's own checkpoints are the user's files, readable by
  whom the user's files are;
- its signals as a torchrun worker has them (SLURM's other stop signals ignored).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

from ddpjob import freeze, rundir
from ddpjob.config import JobConfig
from ddpjob.node import preemption
from ddpjob.node.cluster import PORT_CHOSEN, ClusterEnv

_UMASK = re.compile(r"0?[0-7]{3}")


# What ddpjob's own launch adds to the environment for its ranks' Python and a user's program
# must not inherit: PYTHONSAFEPATH (keeps the working directory off sys.path, so that `python
# script.py` would no longer find the script's sibling modules) and the run's frozen code first
# on PYTHONPATH (the templates and the local supervisor set both for `-m ddpjob run`).
OWN_PYTHON_VARS = ("PYTHONSAFEPATH",)


def command_environ(env: ClusterEnv, extra: Mapping[str, str], environ: Mapping[str, str] | None = None, *,
                    own_code: str | None = None, run_id: str = "none", max_restarts: int = 0) -> dict[str, str]:
    """The environment of a command entry's child (rank/command.py): the user's own (this
    process's, less what ddpjob's launch added for its own Python: OWN_PYTHON_VARS and `own_code`
    on PYTHONPATH), with what torchrun gives each worker of this rank (the elastic set too:
    Lightning and Accelerate tell a torchrun launch by TORCHELASTIC_RUN_ID), plus ddpjob's
    `extra` (DDPJOB_RUN_DIR, DDPJOB_ATTEMPT, ...). The attempt is torchrun's restart count."""
    # the user's own environment as this rank inherited it (the one place a rank reads it whole)
    out = dict(os.environ if environ is None else environ)
    for name in OWN_PYTHON_VARS:
        out.pop(name, None)
    if own_code is not None and "PYTHONPATH" in out:
        mine = os.path.realpath(own_code)
        kept = [p for p in out["PYTHONPATH"].split(os.pathsep) if p and os.path.realpath(p) != mine]
        if kept:
            out["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del out["PYTHONPATH"]
    attempt = extra.get("DDPJOB_ATTEMPT", "0")
    out.update({
        "RANK": str(env.rank), "LOCAL_RANK": str(env.local_rank), "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size), "GROUP_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(env.num_nodes), "ROLE_RANK": str(env.rank), "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(env.world_size), "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port), "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": attempt, "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        # the program's own rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (no agent here)
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": out.get(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # the port is ddpjob's choice, not the user's: a program that reads its place with
        # ddpjob's API says so if another program holds it (node/cluster.PORT_CHOSEN)
        **({PORT_CHOSEN: str(env.master_port)} if env.port_derived else {}), **extra,
    })
    return out


def user_umask(env: ClusterEnv) -> int | None:
    """The umask the user submitted with (rundir.USER_UMASK), None where none was noted."""
    value = env.ddpjob_vars.get(rundir.USER_UMASK, "")
    return int(value, 8) if _UMASK.fullmatch(value) else None


def environ(cfg: JobConfig, env: ClusterEnv, run_dir: Path, attempt: int,
            extra: Mapping[str, str]) -> dict[str, str]:
    return command_environ(env, {"DDPJOB_RUN_DIR": str(run_dir), "DDPJOB_ATTEMPT": str(attempt), **extra},
                           own_code=str(freeze.python_path(run_dir)), run_id=run_dir.name,
                           max_restarts=cfg.slurm.max_failures)


def child_setup(cfg: JobConfig, env: ClusterEnv) -> Callable[[], None]:
    """What runs in the child before exec: the user's umask, the command's stop signal at its
    default action, SLURM's other stop signals ignored (SLURM signals every process of the step:
    they are ddpjob's to turn into the one the program expects). A program's own handler
    replaces either."""
    own = preemption.signal_number(cfg.train.command_signal)
    others = [n for n in dict.fromkeys(preemption.signal_number(s) for s in (cfg.slurm.signal, "TERM")) if n != own]
    mask = user_umask(env)

    def setup() -> None:
        if mask is not None:
            os.umask(mask)
        for signum in others:
            signal.signal(signum, signal.SIG_IGN)
        signal.signal(own, signal.SIG_DFL)
    return setup
