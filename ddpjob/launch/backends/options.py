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
