"""[slurm] -> sbatch options and the batch shell's own lines, written once for both SLURM scripts.

Pure. The template (render.py, `ddpjob sbatch` and the sbatch backend) writes the options as
`#SBATCH` lines; the submitit backend hands the same options to submitit's SlurmExecutor, which
writes them itself. The shell pieces (the signals the batch shell traps, the node and task count
of the allocation) reach the template as placeholders and submitit's script as setup lines.
"""

from __future__ import annotations

from ddpjob import scriptsafe, validate
from ddpjob.config import JobConfig

Option = tuple[str, str | int | bool]  # ("nodes", 2), ("requeue", True): --nodes=2, --requeue

# SLURM sends SIGTERM to the batch shell too (scancel, time limit, preemption); without a trap
# a non-interactive bash dies at once and the job ends while the ranks are still writing their
# checkpoint. Trapped, bash waits for srun. (INT/HUP: a user's scancel --signal.)
BATCH_SIGNALS = ("TERM", "INT", "HUP")


def sbatch_options(cfg: JobConfig) -> tuple[list[Option], list[Option]]:
    """(ddpjob's options from [slurm] in a fixed order, the user's slurm.sbatch_extra). Raises
    UsageError for a string that could not reach sbatch unchanged (scriptsafe's rules)."""
    s = cfg.slurm
    validate.job_strings(cfg)
    # spare nodes are part of the allocation, the ranks run on `nodes` of them (node_count)
    own: list[Option] = [("job-name", cfg.name), ("nodes", s.nodes + s.spare_nodes),
                         ("ntasks-per-node", s.tasks_per_node)]
    if s.gpus_per_node > 0:
        own.append(("gpus-per-node", s.gpus_per_node))
    own.append(("cpus-per-task", s.cpus_per_task))
    own += [(key, getattr(s, key)) for key in ("mem", "partition", "account", "qos") if getattr(s, key)]
    own.append(("time", s.time))
    if s.constraint:
        own.append(("constraint", s.constraint))
    # A requeued run appends to its logs instead of truncating the first run's.
    own += [("requeue" if s.requeue else "no-requeue", True), ("open-mode", "append")]
    if s.on_node_loss == "continue":  # a failed node leaves the allocation, the job goes on
        own.append(("no-kill", True))
    # No "B:": the warning goes to the ranks (the job steps), which checkpoint on it.
    own.append(("signal", f"{s.signal}@{s.signal_lead_s}"))
    extra: list[Option] = []
    for arg in s.sbatch_extra:  # "--exclusive", "--mail-type=END"
        key, value = scriptsafe.split_extra(arg)
        extra.append((key, True if value is None else value))
    return own, extra


def as_flag(option: Option) -> str:
    key, value = option
    return f"--{key}" if value is True else f"--{key}={value}"


def node_count(cfg: JobConfig) -> str:
    """The ranks' node count in the batch shell. An admin may shrink a pending, requeued
    job (scontrol update NumNodes=1 ...) and ddpjob resumes elastically, so the count follows
    the allocation this incarnation got, not the submission's ([slurm] nodes, the fallback);
    with spare nodes, at most `nodes` of it (the spares wait for a lost node)."""
    n, k = int(cfg.slurm.nodes), int(cfg.slurm.spare_nodes)
    if not k:
        return f"${{SLURM_JOB_NUM_NODES:-{n}}}"
    return f"$(( ${{SLURM_JOB_NUM_NODES:-{n + k}}} < {n} ? ${{SLURM_JOB_NUM_NODES:-{n + k}}} : {n} ))"


def task_count(cfg: JobConfig, nodes_var: str) -> str:
    """The allocation's task count from the shell variable holding its node count: what srun
    must start (SLURM_NTASKS still holds the submission's count after a shrink)."""
    return f"$(({nodes_var} * {int(cfg.slurm.tasks_per_node)}))"


def warm_start(cfg: JobConfig, ranks_per_host: int | None = None) -> bool:
    """Whether the ranks fork from a per-node process that has torch imported (node/warm.py): for
    a job that may restart inside its allocation (a restart then skips torch's start-up), and for
    one that runs more than one rank per node (`ranks_per_host`, [slurm] tasks_per_node unless
    given; the local backend runs them all on one host): the node imports torch once instead of
    once per rank, and the forked ranks share its pages (measured here: 130 MiB of PSS per forked
    rank against 650 MiB per rank started cold). A first start of a single rank per node gains
    nothing (the server imports what the rank would). Not with GPUs: a rank forked in the
    server's step would have that step's devices, not the ones SLURM bound to its own task
    (ConstrainDevices); not in a container: the server would have to run in the same one."""
    s = cfg.slurm
    many = (s.tasks_per_node if ranks_per_host is None else ranks_per_host) > 1
    return s.warm_start and (s.max_failures > 0 or many) and s.gpus_per_node == 0 and not s.container


# The job step that runs one warm-start server per node of the allocation, spares included:
# --overlap (it takes no CPU, memory or GPU from the ranks' steps), --no-kill (a lost node ends
# only its own server), its own name in sacct. The batch shell sets DDPJOB_WARM_PID.
WARM_SERVER = ("{srun} --overlap --no-kill --kill-on-bad-exit=0 --job-name=ddpjob-warm --input=none "
               '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
               "{python} -u -m ddpjob.node.warm serve >>{log} 2>&1 &")
WARM_CLIENT = "-m ddpjob.node.warm run"  # between the ranks' `python -u` and their `-m MODULE`


def warm_server_lines(cfg: JobConfig, python: str, run_dir: str, srun: str = "srun") -> list[str]:
    """The batch shell's lines that start the servers, or none. `python` and `run_dir` are quoted
    for the shell already; the servers' output and srun's own lines (its step is ended when the
    job is, see the template) go to RUN_DIR/logs/warm-JOBID.log, not the batch log. They come
    after the job's setup lines (the servers import torch from the job's environment). `srun`:
    "command srun" where a shell function shadows it (submitit_slurm.restart_lines)."""
    if not warm_start(cfg):
        return []
    log = f'{run_dir}/logs/warm-"$SLURM_JOB_ID".log'
    return ["export DDPJOB_WARM=1", WARM_SERVER.format(srun=srun, python=python, log=log),
            "DDPJOB_WARM_PID=$!"]
