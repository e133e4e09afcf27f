"""Where this process sits in the job: `ClusterEnv.from_environ(environ, argv, num_gpus)`.

First step on every node (runner, selftest): the launcher's variables (torchrun, the local
backend, SLURM, or none) become one frozen ClusterEnv that dist.py and the trainer take as an
argument. This is the only node-side code that reads os.environ; tests pass plain dicts.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ddpjob.errors import DDPJobError
from ddpjob.node.hostlist import parse_hostlist, parse_tasks_per_node

# MASTER_PORT window. Linux hands out ephemeral ports (the local side of every outgoing
# connection, gloo/NCCL's own included) from net.ipv4.ip_local_port_range, 32768-60999 by
# default: a fixed port in there can be taken by some unrelated socket on the node and fail
# with EADDRINUSE at random. Ports below ~15000 hold many well-known services (6817-6819 SLURM,
# 8080, 8888 Jupyter, 6006 TensorBoard ...). So: 15000 + job_id % 15000, i.e. 15000-29999, the
# same on every rank without any communication, different for jobs whose ids are less than 15000
# apart (a collision only matters if both jobs put rank 0 on the same node). Each restart of the
# job (in place or requeued) moves it by PORT_STRIDE: a port another program took on rank 0's
# node is not tried again, and far from the ports of the ids next to this one's.
PORT_BASE = 15000
PORT_SPAN = 15000
PORT_STRIDE = 7919
DEFAULT_PORT = 29500  # torch's default, used when there is no job id to derive one from
PORT_CHOSEN = "DDPJOB_MASTER_PORT"  # beside MASTER_PORT where ddpjob chose it (rank/commandenv.py)
PORT_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")  # torch's words when rank 0 cannot listen

_HINT_ENV = "unset the stray variable, or launch with srun / torchrun, which set all of them"


def process_started() -> float | None:
    """When this process started, in epoch seconds (Linux /proc, 10 ms ticks), so that a
    start-up time counts the interpreter and the imports too; None where /proc has no answer."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def port_for_job(job_id: str | None, attempt: int = 0) -> int:
    """MASTER_PORT for a job id (numeric ids directly, others via crc32) and attempt: every rank's."""
    if not job_id:
        return DEFAULT_PORT
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + (number + PORT_STRIDE * attempt) % PORT_SPAN


# ---------------------------------------------------------------- reading variables
class _Vars:
    """Typed, error-reporting access to one environment mapping."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.env = environ

    def text(self, *names: str) -> str | None:
        """The first of `names` that is set to a non-empty value."""
        for name in names:
            value = self.env.get(name, "").strip()
            if value:
                return value
        return None

    def integer(self, *names: str, default: int | None = None) -> int | None:
        for name in names:
            value = self.env.get(name, "").strip()
            if value:
                try:
                    return int(value)
                except ValueError:
                    raise DDPJobError(f"{name}={value!r} is not an integer", _HINT_ENV) from None
        return default

    def required(self, *names: str, default: int | None = None) -> int:
        value = self.integer(*names, default=default)
        if value is None:
            raise DDPJobError(f"{names[0]} is not set although {self._why()} is",
                              "launch with torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, "
                              "MASTER_ADDR, MASTER_PORT) or set all of them")
        return value

    def _why(self) -> str:
        return "RANK" if "RANK" in self.env else "another launcher variable"

    def number(self, name: str) -> float | None:
        value = self.env.get(name, "").strip()
        if not value:
            return None
        try:
            return float(value)
        except ValueError:
            raise DDPJobError(f"{name}={value!r} is not a number", _HINT_ENV) from None


def _argv_local_rank(argv: Sequence[str]) -> int | None:
    """The legacy `--local_rank N` / `--local-rank=N` that torch.distributed.launch appends."""
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag or arg.startswith(flag + "="):
                value = arg[len(flag) + 1:] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
                try:
                    return int(value)
                except ValueError:
                    raise DDPJobError(f"{flag} {value!r} on the command line is not an integer",
                                      "torch.distributed.launch passes --local-rank=<int>") from None
    return None


# ---------------------------------------------------------------- the environment
@dataclass(frozen=True)
class ClusterEnv:
    """This process's place in the job. Build it with `ClusterEnv.from_environ()`."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    port_derived: bool = False  # MASTER_PORT is ddpjob's choice (derived, or the supervisor's), not the user's
    # The job as SLURM's commands name it (_slurm_job_id): ARRAYID_TASK for an array task
    job_id: str | None = None
    restart_count: int = 0
    source: str = "single"  # "torchrun" | "slurm" | "local" | "single"
    hostname: str = "localhost"  # SLURM's node name inside SLURM (what squeue shows), else the host
    hosts: tuple[str, ...] = ()  # expanded nodelist of the step (SLURM only)
    end_time: float | None = None  # SLURM_JOB_END_TIME (epoch s; SLURM >= 23.02, absent on 22.05)
    array_job_id: str | None = None
    array_task_id: int | None = None
    cpus_per_task: int | None = None
    gpus: int = 0  # GPUs this process can see (passed in: cluster.py never imports torch)
    slurm_step: bool = False  # inside an srun step (not the batch shell / an salloc shell)
    partition: str | None = None
    # torchrun's restart round when its agent hosts the store at MASTER_ADDR:MASTER_PORT
    # (TORCHELASTIC_USE_AGENT_STORE): that store outlives the round, so each round's keys get a
    # prefix of their own (node/dist.py). None: the store is rank 0's, new with every start.
    agent_round: int | None = None
    # torchrun's agent (the ranks' parent, the same across its restart rounds) outside SLURM and
    # the local backend: rank 0 records it in job.json, and `ddpjob status` asks whether it lives
    agent_pid: int | None = field(default=None, compare=False)
    submitit_folder: str | None = None
    ddpjob_vars: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    # cuBLAS's workspace setting as inherited (None: unset); node/determinism.py sets it
    # when train.deterministic needs it. Not where the process sits: left out of ==.
    cublas_workspace_config: str | None = field(default=None, compare=False)
    # torch.compile's cache places as inherited; node/compilecache.py points unset ones into
    # the run dir
    compile_cache_vars: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        """`cuda:<local_rank>` with GPUs, else `cpu`. Never rank % device_count: with
        several nodes that picks GPUs already taken by this node's other tasks."""
        return f"cuda:{self.local_rank}" if self.gpus > 0 else "cpu"

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
                f"node {self.node_rank}/{self.num_nodes} {self.hostname}) via {self.source}, "
                f"master {self.master_addr}:{self.master_port}, device {self.device}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
                     num_gpus: int = 0, *, hostname: str | None = None) -> ClusterEnv:
        """Precedence: torchrun / torch.distributed.launch (and ddpjob's local backend, which
        sets the same variables) -> SLURM -> a single process. Raises DDPJobError when the
        variables contradict each other."""
        env = os.environ if environ is None else environ
        args = sys.argv[1:] if argv is None else argv
        v = _Vars(env)
        common = dict(
            hostname=v.text("SLURMD_NODENAME") or hostname or socket.gethostname(),
            end_time=v.number("SLURM_JOB_END_TIME"),
            array_job_id=v.text("SLURM_ARRAY_JOB_ID"),
            array_task_id=v.integer("SLURM_ARRAY_TASK_ID"),
            cpus_per_task=v.integer("SLURM_CPUS_PER_TASK"),
            gpus=num_gpus,
            partition=v.text("SLURM_JOB_PARTITION"),
            submitit_folder=v.text("SUBMITIT_FOLDER"),
            ddpjob_vars={k: env[k] for k in sorted(env) if k.startswith("DDPJOB_")},
            cublas_workspace_config=v.text("CUBLAS_WORKSPACE_CONFIG"),
            compile_cache_vars={k: env[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
                                if env.get(k)},
        )
        argv_local_rank = _argv_local_rank(args)
        if "RANK" in env or argv_local_rank is not None:
            fields = _from_torchrun(v, argv_local_rank)
        elif v.text("SLURM_JOB_ID"):
            fields = _from_slurm(v)
        else:
            fields = _single(v)
        result = cls(**common, **fields)  # type: ignore[arg-type]
        _check(result)
        return result

    def with_gpus(self, num_gpus: int) -> ClusterEnv:
        """This place with the GPUs the process sees, counted once torch is imported (a rank
        reads its environment once, before the slow torch import), checked as from_environ's."""
        env = replace(self, gpus=num_gpus)
        _check(env)
        return env

    @classmethod
    def batch_shell(cls, environ: Mapping[str, str] | None = None) -> ClusterEnv:
        """The job as the sbatch batch script sees it (outside any srun step, so not a rank):
        job id, restart count, partition. For `python -m ddpjob.rank.requeue` after srun failed;
        from_environ refuses this process (SLURM_NTASKS > 1 without SLURM_STEP_ID)."""
        v = _Vars(os.environ if environ is None else environ)
        nodes = v.text("SLURM_JOB_NODELIST")  # the allocation: what a restart inside it may use
        return cls(job_id=_slurm_job_id(v), restart_count=_restart_count(v, "SLURM_RESTART_COUNT"),
                   source="slurm", hostname=v.text("SLURMD_NODENAME") or socket.gethostname(),
                   partition=v.text("SLURM_JOB_PARTITION"), num_nodes=len(parse_hostlist(nodes)) if nodes else 1,
                   hosts=tuple(parse_hostlist(nodes)) if nodes else ())


def _slurm_job_id(v: _Vars) -> str | None:
    """This job's id for scontrol/scancel/sbatch --dependency: ARRAYJOBID_TASKID for a task of a
    job array (a sweep), else SLURM_JOB_ID. An array task's own SLURM_JOB_ID is no safe name for
    it: one task of every array has SLURM_JOB_ID equal to the array's id (task 548_1 had
    SLURM_JOB_ID=548 on the test cluster), and `scontrol requeue 548` requeues every task of
    the array. It is also the id job.json records (submitit's) and `ddpjob stop` asks by."""
    array, task = v.text("SLURM_ARRAY_JOB_ID"), v.integer("SLURM_ARRAY_TASK_ID")
    if array is not None and task is not None:
        return f"{array}_{task}"
    return v.text("SLURM_JOB_ID")


def _master(v: _Vars, addr: str, job_id: str | None, attempt: int = 0, *, chosen: bool = False) -> dict:
    """A MASTER_ADDR/PORT set wins; `attempt`: requeues + restarts; `chosen`: the supervisor's port."""
    given = v.integer("MASTER_PORT")
    port = port_for_job(job_id, attempt) if given is None else given
    if not 0 < port < 65536:
        raise DDPJobError(f"MASTER_PORT={port} is not a TCP port (1-65535)", "unset it or pick a free port")
    ours = chosen or given is None or v.integer(PORT_CHOSEN) == port
    return dict(master_addr=v.text("MASTER_ADDR") or addr, master_port=port, port_derived=ours)


def _restart_count(v: _Vars, *names: str) -> int:
    return v.integer(*names, default=0) or 0


def _from_torchrun(v: _Vars, argv_local_rank: int | None) -> dict:
    """torchrun, torch.distributed.launch and ddpjob's local backend."""
    if "RANK" not in v.env:
        raise DDPJobError(f"--local-rank {argv_local_rank} is on the command line but RANK and "
                          "WORLD_SIZE are not set", "launch with torchrun or torch.distributed.launch "
                          "(they set both), or drop --local-rank")
    rank = v.required("RANK")
    world = v.required("WORLD_SIZE")
    local_rank = v.integer("LOCAL_RANK")
    if local_rank is None:  # old torch.distributed.launch: only --local_rank in argv
        local_rank = argv_local_rank if argv_local_rank is not None else rank
    elif argv_local_rank is not None and argv_local_rank != local_rank:
        raise DDPJobError(f"LOCAL_RANK={local_rank} but --local-rank={argv_local_rank} on the command line",
                          "let one launcher start the process, not two nested ones")
    # Without LOCAL_WORLD_SIZE (very old launchers) assume one node.
    local_world = v.required("LOCAL_WORLD_SIZE", default=world)
    node_rank = v.required("GROUP_RANK", default=rank // max(local_world, 1))
    num_nodes = v.required("GROUP_WORLD_SIZE", default=-(-world // max(local_world, 1)))
    local = bool(v.text("DDPJOB_JOB_ID"))
    job_id = v.text("DDPJOB_JOB_ID") or _slurm_job_id(v)
    elastic = job_id is None and not local and bool(v.text("TORCHELASTIC_RUN_ID"))  # torchrun outside SLURM
    job_id = job_id or _elastic_run(v)
    if world > 1 and not v.text("MASTER_ADDR"):
        raise DDPJobError(f"WORLD_SIZE={world} but MASTER_ADDR is not set",
                          "launch with torchrun, which sets MASTER_ADDR and MASTER_PORT")
    restarts = (_restart_count(v, "DDPJOB_RESTART_COUNT") if local else
                _restart_count(v, "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
    agent = v.text("TORCHELASTIC_USE_AGENT_STORE") == "True" and not local
    return dict(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                node_rank=node_rank, num_nodes=num_nodes, job_id=job_id, restart_count=restarts,
                source="local" if local else "torchrun", slurm_step=bool(v.text("SLURM_STEP_ID")),
                agent_round=_restart_count(v, "TORCHELASTIC_RESTART_COUNT") if agent else None,
                agent_pid=os.getppid() if elastic else None,
                **_master(v, "127.0.0.1", v.text("DDPJOB_JOB_ID", "SLURM_JOB_ID") or job_id, chosen=local))


_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)


def _elastic_run(v: _Vars) -> str | None:
    """The job, for torchrun outside SLURM: what stays the same across its restarts, so that a
    restarted round finds the run dir (runs/<name>-<job id>) and resumes. --rdzv-id (TORCHELASTIC_
    RUN_ID): the one given, or the uuid torchrun makes up for a one-node run; the run id "none"
    of a static rendezvous (--master-port) names nothing, and then the agent that restarts the
    ranks (their parent process) is the job: "torchrun-<its pid>"."""
    run = v.text("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    if run != "none" and _RUN_ID.fullmatch(run):
        return f"torchrun-{run}"
    return f"torchrun-{os.getppid()}"


def _single(v: _Vars) -> dict:
    job_id = v.text("DDPJOB_JOB_ID")
    return dict(job_id=job_id, restart_count=_restart_count(v, "DDPJOB_RESTART_COUNT"),
                source="single", **_master(v, "127.0.0.1", job_id))


def _from_slurm(v: _Vars) -> dict:
    """Inside a SLURM allocation. srun tasks see the step's values (SLURM_STEP_*); the batch
    shell and an salloc shell see only the job's and are not a rank of anything. The port comes
    from SLURM_JOB_ID, numeric and different for every array task."""
    job_id, port_id = _slurm_job_id(v), v.text("SLURM_JOB_ID")
    in_step = bool(v.text("SLURM_STEP_ID"))
    ntasks = v.required("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", default=1)
    if not in_step:
        # Seen on SLURM 22.05: the batch shell of `sbatch --nodes=2 --ntasks-per-node=2` has
        # SLURM_NTASKS=4 and SLURM_PROCID=0 (it looks like rank 0, and would wait forever for
        # ranks 1-3); an salloc shell has SLURM_NTASKS=4 and no SLURM_PROCID. Only srun tasks
        # have SLURM_STEP_ID (and SLURM_STEP_NUM_TASKS ...).
        if ntasks > 1:
            where = "the sbatch batch script" if "SLURM_PROCID" in v.env else "an salloc shell"
            raise DDPJobError(
                f"SLURM_NTASKS={ntasks} but SLURM_STEP_ID is not set: this process runs in {where} "
                f"of job {job_id}, not as one of its {ntasks} srun tasks",
                "start it with `srun ddpjob ...` (one process per task), or ask for --ntasks=1")
        return dict(job_id=job_id, restart_count=_restart_count(v, "SLURM_RESTART_COUNT"),
                    source="slurm", **_master(v, "127.0.0.1", port_id))
    job_ntasks = v.integer("SLURM_NTASKS")  # srun sets it to the step's count, like STEP_NUM_TASKS
    if job_ntasks is not None and job_ntasks != ntasks:
        raise DDPJobError(f"SLURM_NTASKS={job_ntasks} but SLURM_STEP_NUM_TASKS={ntasks} in this srun step",
                          "do not export SLURM_NTASKS yourself: srun sets it for every task")
    # The step's nodelist, not the job's: `srun -n1 -w n2` inside a job on n[1-2] gets
    # SLURM_NODELIST=n[1-2] but SLURM_STEP_NODELIST=n2, and rank 0 runs on n2.
    nodelist = v.text("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    hosts = tuple(parse_hostlist(nodelist)) if nodelist else ()
    nodes = v.required("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=len(hosts) or 1)
    node_rank = v.required("SLURM_NODEID", default=0)
    rank = v.required("SLURM_PROCID", default=0)
    local_rank = v.required("SLURM_LOCALID", default=0)
    if hosts and len(hosts) != nodes:
        raise DDPJobError(f"SLURM_STEP_NUM_NODES={nodes} but the nodelist {nodelist!r} names "
                          f"{len(hosts)} nodes", _HINT_ENV)
    per_node_text = v.text("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    per_node = parse_tasks_per_node(per_node_text) if per_node_text else [-(-ntasks // nodes)] * nodes
    if per_node_text and (len(per_node) != nodes or sum(per_node) != ntasks):
        raise DDPJobError(f"SLURM_NTASKS={ntasks} but SLURM_TASKS_PER_NODE={per_node_text!r} "
                          f"on {nodes} node(s) adds up to {sum(per_node)} task(s)",
                          "ask for --nodes and --ntasks-per-node and let srun derive the rest "
                          "(do not also pass a different --ntasks)")
    fixed = v.integer("SLURM_NTASKS_PER_NODE")
    if fixed is not None and not per_node_text and fixed * nodes != ntasks:
        raise DDPJobError(f"SLURM_NTASKS={ntasks} but SLURM_NTASKS_PER_NODE={fixed} x "
                          f"{nodes} node(s) = {fixed * nodes}",
                          "ask for --nodes and --ntasks-per-node only, not a different --ntasks")
    if not 0 <= node_rank < len(per_node):
        raise DDPJobError(f"SLURM_NODEID={node_rank} but the step has {nodes} node(s)", _HINT_ENV)
    restarts = _restart_count(v, "SLURM_RESTART_COUNT")
    return dict(rank=rank, local_rank=local_rank, world_size=ntasks, local_world_size=per_node[node_rank],
                node_rank=node_rank, num_nodes=nodes, job_id=job_id, restart_count=restarts, source="slurm",
                slurm_step=True, hosts=hosts, **_master(v, hosts[0] if hosts else "127.0.0.1", port_id,
                                                        restarts + _restart_count(v, "DDPJOB_ATTEMPT")))


def _check(e: ClusterEnv) -> None:
    """Contradictions that would otherwise hang init_process_group or share a GPU."""
    names = {"torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
             "local": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
             "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "tasks on this node",
                       "SLURM_NODEID")}.get(e.source, ("rank", "world size", "local rank",
                                                       "local world size", "node rank"))
    rank_n, world_n, lrank_n, lworld_n, node_n = names
    if e.world_size < 1:
        raise DDPJobError(f"{world_n}={e.world_size} but at least 1 process is needed", _HINT_ENV)
    if not 0 <= e.rank < e.world_size:
        raise DDPJobError(f"{rank_n}={e.rank} but {world_n}={e.world_size} (ranks are 0..{e.world_size - 1})",
                          _HINT_ENV)
    if not 1 <= e.local_world_size <= e.world_size:
        raise DDPJobError(f"{lworld_n}={e.local_world_size} but {world_n}={e.world_size}", _HINT_ENV)
    if not 0 <= e.local_rank < e.local_world_size:
        raise DDPJobError(f"{lrank_n}={e.local_rank} but {lworld_n}={e.local_world_size}", _HINT_ENV)
    if not 0 <= e.node_rank < e.num_nodes:
        raise DDPJobError(f"{node_n}={e.node_rank} but the job has {e.num_nodes} node(s)", _HINT_ENV)
    if e.gpus > 0 and e.local_world_size > e.gpus:
        raise DDPJobError(f"{e.local_world_size} tasks on node {e.hostname} but only {e.gpus} GPU(s) "
                          "visible to each", "ask for --ntasks-per-node equal to --gpus-per-node (one "
                          "rank per GPU), and do not bind GPUs per task (--gpus-per-task / --gpu-bind): "
                          "ddpjob picks cuda:<local rank> itself")
