"""Joining the job's process group: backend, device and CPU threads chosen from the
ClusterEnv, rank 0's address awaited, the group formed (or none, for a single process).

Second step on the nodes: rank/start.py's init() (and selftest.py, the benchmarks) hand the
ClusterEnv from cluster.py to `init_process_group`, which returns dist.DistContext, the
handle through which the group is used and torn down (dist.py, the one module that calls
torch.distributed's collectives; tests/unit/test_layout.py checks it).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from ddpjob.errors import ClusterFailure, DDPJobError
from ddpjob.node import dist
from ddpjob.node.cluster import PORT_IN_USE, ClusterEnv


def choose_backend(env: ClusterEnv, backend: str = "auto") -> str:
    """auto = NCCL when every local task has its own GPU (ClusterEnv guarantees
    gpus >= local_world_size when gpus > 0), gloo otherwise."""
    if backend == "auto":
        return "nccl" if env.gpus > 0 else "gloo"
    if backend == "nccl" and env.gpus == 0:
        raise DDPJobError(f"backend nccl was asked for but rank {env.rank} on {env.hostname} sees no GPU",
                          "use --backend gloo (or auto) on CPU nodes, or ask SLURM for GPUs "
                          "(--gpus-per-node)")
    if backend not in ("nccl", "gloo"):
        raise DDPJobError(f"unknown backend {backend!r}, expected auto, nccl or gloo", "pick one of those")
    return backend


def _cpu_threads(env: ClusterEnv, threads: int) -> int:
    """Threads per CPU rank. torch's default is one per core of the whole node, so N ranks on
    one node would run N x cores threads and fight for the cores (all-reduce waits on the
    slowest). Use what SLURM gave the task (--cpus-per-task), else this node's cores shared
    among its ranks (1 each on the 2-core test nodes with 2 tasks)."""
    if threads > 0:
        return threads
    if env.cpus_per_task:
        return max(1, env.cpus_per_task)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, env.local_world_size))


def _wait_for_master(env: ClusterEnv, timeout_s: float) -> None:
    """Non-zero ranks: poll rank 0's store port ourselves. torch's own client retries past its
    timeout (about 2.5x here) and prints C++ stack traces; this fails on time with one line."""
    addr, port = env.master_addr, env.master_port
    deadline = time.monotonic() + timeout_s
    last = "nothing listening"
    while True:
        try:
            wait = max(0.1, min(2.0, deadline - time.monotonic()))
            socket.create_connection((addr, port), timeout=wait).close()
            return
        except socket.gaierror as exc:
            raise DDPJobError(f"rank {env.rank} on {env.hostname}: the master address {addr!r} does not "
                              f"resolve ({exc.strerror})", "set MASTER_ADDR to a host name or address "
                              "every node can resolve (SLURM: the first node of the job)") from None
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        if time.monotonic() + 0.25 >= deadline:
            raise _unreachable(env, timeout_s, last)
        time.sleep(0.25)


def _unreachable(env: ClusterEnv, timeout_s: float, cause: str) -> DDPJobError:
    return DDPJobError(
        f"rank {env.rank} on {env.hostname} could not reach rank 0 at {env.master_addr}:{env.master_port} "
        f"within {timeout_s:g} s ({cause})",
        "check that rank 0 started (its log), that MASTER_ADDR/MASTER_PORT are the same on every "
        "rank and reachable from this node, and that no firewall blocks the port")


def init_process_group(env: ClusterEnv, backend: str = "auto", timeout_s: float = 300,
                       threads: int = 0) -> dist.DistContext:
    """Join the job's process group (or not, for a single process) and pick this rank's device."""
    backend = choose_backend(env, backend)
    if env.gpus > 0:
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)  # before init: NCCL binds its communicator to this GPU
    else:
        device = torch.device("cpu")
        torch.set_num_threads(_cpu_threads(env, threads))
    if not env.is_distributed:
        return dist.DistContext(env, "none", device, initialized=False, timeout_s=timeout_s)
    if tdist.is_initialized():
        return dist.DistContext(env, tdist.get_backend(), device, initialized=True, timeout_s=timeout_s,
                           owned=False)

    start = time.monotonic()
    if env.rank != 0:
        _wait_for_master(env, timeout_s)
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr  # IPv6 literal
    try:
        # tcp:// with explicit rank/world, not env://: the values come from ClusterEnv (which may
        # have derived them), not from whatever MASTER_* this process happens to inherit.
        # device_id binds NCCL to this rank's GPU up front (no guessing in the first barrier).
        # torchrun's agent hosts the store and keeps it across its restart rounds: a round that
        # used it bare read the last round's gloo addresses and hung on refused connections, so
        # each round gets keys of its own (as torch itself did up to 2.x).
        where: dict[str, Any] = ({"init_method": f"tcp://{host}:{env.master_port}"} if env.agent_round is None else
                                 {"store": tdist.PrefixStore(f"ddpjob/round_{env.agent_round}/", tdist.TCPStore(
                                     env.master_addr, env.master_port, is_master=False,
                                     timeout=timedelta(seconds=timeout_s)))})
        tdist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None, **where)
    except (RuntimeError, ValueError, OSError) as exc:
        cause = " ".join(str(exc).split("\n")[0].split())[:200].rstrip(".")
        if env.rank == 0 and PORT_IN_USE.search(cause):
            if env.port_derived:
                # ddpjob chose the port: another program took it on this node, the node's doing. A
                # retry derives another one from the attempt (node/cluster.port_for_job)
                raise ClusterFailure(f"rank 0 on {env.hostname} could not listen on port {env.master_port}, "
                                     f"which ddpjob chose: another program on the node holds it ({cause})",
                                     "nothing to do: a restart takes another port; if this recurs, set "
                                     "MASTER_PORT to a port the nodes keep free") from None
            raise DDPJobError(f"rank 0 on {env.hostname} could not listen on MASTER_PORT={env.master_port}, "
                              f"which you set ({cause})",
                              "another program uses this port: set MASTER_PORT to a free one, or unset "
                              "it and ddpjob derives one from the job id") from None
        # a group that did not form: a peer that never came or a network in the way, the
        # cluster's doing (retried in place: ledger/policy.py), not the user's code
        if env.rank == 0:
            raise ClusterFailure(f"rank 0 on {env.hostname} waited {time.monotonic() - start:.0f} s at "
                              f"{env.master_addr}:{env.master_port} but not all {env.world_size} ranks "
                              f"joined ({cause})", "look at the other ranks' logs: they may have failed "
                              "to start, or reached another MASTER_ADDR/MASTER_PORT") from None
        # This rank reached rank 0's store (checked above), so the group itself did not form.
        raise ClusterFailure(f"rank {env.rank} on {env.hostname} reached rank 0 at {env.master_addr}:"
                          f"{env.master_port} but the {backend} group of {env.world_size} ranks did not "
                          f"form within {timeout_s:g} s ({cause})",
                          "look at the other ranks' logs (one may have failed to start); if the nodes "
                          "have several networks, set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the one "
                          "they share") from None
    dist.start_watch(env)
    return dist.DistContext(env, backend, device, initialized=True, timeout_s=timeout_s)
