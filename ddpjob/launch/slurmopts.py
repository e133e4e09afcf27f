"""[slurm] -> sbatch options and the batch shell's own lines, written once for both SLURM scripts.

Pure. The template (render.py, `ddpjob sbatch` and the sbatch backend) writes the options as
`#SBATCH` lines; the submitit backend hands the same options to submitit's SlurmExecutor, which
writes them itself. The shell pieces (the signals the batch shell traps, the node and task count
of the allocation) reach the template as placeholders and submitit's script as setup lines.
"""

from __future__ import annotations

import shlex

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
    (ConstrainDevices); not in a container: the server would have to run in the same one; not for
    a [train] command: its rank never imports torch (the program is a process of its own), and a
    warm server's fork would only add torch's start-up to each start."""
    s = cfg.slurm
    many = (s.tasks_per_node if ranks_per_host is None else ranks_per_host) > 1
    return (s.warm_start and (s.max_failures > 0 or many) and s.gpus_per_node == 0 and not s.container
            and not cfg.train.command)


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
    "command srun" where a shell function shadows it (submitit's script: srun -> ddpjob_srun)."""
    if not warm_start(cfg):
        return []
    log = f'{run_dir}/logs/warm-"$SLURM_JOB_ID".log'
    return ["export DDPJOB_WARM=1", WARM_SERVER.format(srun=srun, python=python, log=log),
            "DDPJOB_WARM_PID=$!"]


# srun turns its own TERM/INT/HUP/QUIT into SIGKILL for the ranks: never forward those.
NOT_FORWARDED = frozenset({"TERM", "INT", "HUP", "QUIT"})


def batch_shell_lines(cfg: JobConfig, python: str, run_dir: str) -> list[str]:
    """The batch shell's part of a job, written once for both scripts (the template's
    ${batch_shell}; submitit's setup lines, whose `srun` a function hands to `ddpjob_srun`):

    - the trap: SLURM sends SIGTERM to the batch shell as well as to the ranks (scancel, time
      limit, preemption). A non-interactive bash would die of it and end the job while the ranks
      still write their checkpoint, so the shell only notes the signal and keeps waiting for
      srun. It never forwards TERM/INT/HUP: srun answers those by SIGKILLing the ranks. The job's
      warning signal reaches the ranks from SLURM directly (--signal has no B:); if only this
      shell gets it (scancel --batch), it is passed on to srun, which hands it to every rank.
    - `ddpjob_srun ARGS...`, the one restart loop: srun on the allocation's nodes (the quarantined
      hosts left out), waited for in the background so a trap runs at once; after a crash (not 0,
      not a stop for a requeue, no signal to this shell) ddpjob's one decision (`python -m
      ddpjob.rank.requeue`, the policy in ddpjob/ledger/policy.py) answers RESTART with the nodes
      to run on ("NODES [HOST,...]", its last stdout line: hostnames it checked, no shell), and
      srun runs again inside this allocation; anything else returns srun's status.

    `python` and `run_dir` are quoted for the shell already."""
    from ddpjob import exitcodes

    s = cfg.slurm
    forward = "" if s.signal in NOT_FORWARDED else s.signal
    ntasks = task_count(cfg, "DDPJOB_NODES")
    return [
        f"DDPJOB_FORWARD={shlex.quote(forward)}",
        "DDPJOB_TRAPPED=0",
        "DDPJOB_SIGNALLED=0",
        "ddpjob_on_signal() {",
        "    DDPJOB_TRAPPED=1",
        "    DDPJOB_SIGNALLED=1",
        '    echo "ddpjob: batch shell got SIG$1 at $(date -u +%Y-%m-%dT%H:%M:%SZ); waiting for the ranks to stop" >&2',
        "    # $! also covers a signal that lands between starting srun and saving its pid.",
        "    DDPJOB_PID=${DDPJOB_SRUN_PID:-$!}",
        '    [ "$DDPJOB_PID" != "${DDPJOB_WARM_PID:-}" ] || DDPJOB_PID=  # not the ranks\' srun yet',
        '    if [ -n "$DDPJOB_FORWARD" ] && [ "$1" = "$DDPJOB_FORWARD" ] && [ -n "$DDPJOB_PID" ]; then',
        '        kill -s "$1" "$DDPJOB_PID" 2>/dev/null || true',
        "    fi",
        "}",
        f"for DDPJOB_SIG in {' '.join(BATCH_SIGNALS)} {shlex.quote(s.signal)}; do",
        '    trap "ddpjob_on_signal $DDPJOB_SIG" "$DDPJOB_SIG"',
        "done",
        "# The task count follows the allocation this incarnation got, not the environment saved at",
        "# submission: an admin may shrink a pending, requeued job (scontrol update jobid=N NumNodes=1",
        "# NumTasks=... NumCPUs=...), and ddpjob resumes elastically.",
        f"DDPJOB_NODES={node_count(cfg)}",
        f"export SLURM_NTASKS={ntasks} SLURM_NPROCS={ntasks}",
        "# How many times the ranks ran again inside this allocation after a crash (for logs and tests),",
        "# and the hosts a restart leaves out (each failed twice: the decision sets it, to SLURM node",
        "# names it checked)",
        "export DDPJOB_ATTEMPT=0",
        "DDPJOB_EXCLUDE=",
        "ddpjob_srun() {",
        "    local layout",
        "    while :; do",
        "        # srun's lines after this one are this attempt's: the decision reads which task failed where",
        '        echo "ddpjob: attempt $DDPJOB_ATTEMPT: ranks on $DDPJOB_NODES node(s)'
        '${DDPJOB_EXCLUDE:+, excluding $DDPJOB_EXCLUDE}" >&2',
        f'        command srun --nodes="$DDPJOB_NODES" --ntasks="{ntasks}" '
        '${DDPJOB_EXCLUDE:+--exclude="$DDPJOB_EXCLUDE"} "$@" &',
        "        DDPJOB_SRUN_PID=$!",
        "        # `wait` returns early (128+N) whenever a trapped signal arrives: wait again until srun",
        "        # itself has exited (127: a trap ran right after srun was reaped), then take its status",
        "        DDPJOB_STATUS=",
        "        while :; do",
        "            DDPJOB_TRAPPED=0",
        '            wait "$DDPJOB_SRUN_PID"',
        "            DDPJOB_RC=$?",
        '            if [ -z "$DDPJOB_STATUS" ] || [ "$DDPJOB_RC" -ne 127 ]; then',
        "                DDPJOB_STATUS=$DDPJOB_RC",
        "            fi",
        '            [ "$DDPJOB_TRAPPED" = 1 ] || break',
        "        done",
        '        echo "ddpjob: srun exited with status $DDPJOB_STATUS" >&2',
        f'        if [ "$DDPJOB_STATUS" -ne {exitcodes.OK} ] && [ "$DDPJOB_STATUS" -ne {exitcodes.REQUEUE} ] '
        '&& [ "$DDPJOB_SIGNALLED" = 0 ]; then',
        f'            layout=$({python} -m ddpjob.rank.requeue {run_dir} "$DDPJOB_STATUS")',
        f'            if [ $? -eq {exitcodes.RESTART} ] && [ "$DDPJOB_SIGNALLED" = 0 ]; then',
        """                read -r DDPJOB_NODES DDPJOB_EXCLUDE <<< "${layout##*$'\\n'}"  # its last line""",
        f"                export SLURM_NTASKS={ntasks} SLURM_NPROCS={ntasks}",
        "                DDPJOB_SRUN_PID=",
        "                DDPJOB_ATTEMPT=$((DDPJOB_ATTEMPT + 1))",
        "                continue",
        "            fi",
        "        fi",
        '        return "$DDPJOB_STATUS"',
        "    done",
        "}",
    ]
