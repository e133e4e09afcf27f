"""dist.py with real processes on gloo: collectives work, failures are one line and on time."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from ddpjob.errors import ClusterFailure, DDPJobError
from ddpjob.node import dist as ddist
from ddpjob.node import group as dgroup
from ddpjob.node.cluster import ClusterEnv
from ranks import free_port


def test_unreachable_master_fails_within_the_timeout_with_one_line() -> None:
    port = free_port()  # nothing listens there
    env = ClusterEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                     master_port=port, hostname="n2", source="torchrun")
    start = time.monotonic()
    with pytest.raises(DDPJobError) as exc:
        dgroup.init_process_group(env, backend="gloo", timeout_s=5)
    took = time.monotonic() - start
    assert 4.0 <= took < 9, took
    line = exc.value.line()
    assert "\n" not in line
    assert f"rank 1 on n2 could not reach rank 0 at 127.0.0.1:{port} within 5 s" in line
    assert "Hint:" in line and "MASTER_ADDR" in line and "firewall" in line and "rank 0 started" in line


def test_unresolvable_master_fails_at_once() -> None:
    env = ClusterEnv(rank=1, local_rank=1, world_size=2, local_world_size=2,
                     master_addr="no-such-host.invalid", master_port=free_port(), source="torchrun")
    start = time.monotonic()
    with pytest.raises(DDPJobError) as exc:
        dgroup.init_process_group(env, backend="gloo", timeout_s=30)
    assert time.monotonic() - start < 20
    assert "'no-such-host.invalid' does not resolve" in exc.value.line()


def test_rank0_alone_reports_missing_ranks() -> None:
    env = ClusterEnv(rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                     master_port=free_port(), hostname="n1", source="torchrun")
    start = time.monotonic()
    with pytest.raises(DDPJobError) as exc:
        dgroup.init_process_group(env, backend="gloo", timeout_s=3)
    assert time.monotonic() - start < 15
    line = exc.value.line()
    assert "rank 0 on n1 waited" in line and "not all 2 ranks joined" in line and "Hint:" in line


def test_single_process_needs_no_group_and_helpers_are_no_ops() -> None:
    threads = torch.get_num_threads()
    try:
        ctx = dgroup.init_process_group(ClusterEnv(cpus_per_task=1), timeout_s=5)
        assert (ctx.initialized, ctx.backend, ctx.device) == (False, "none", torch.device("cpu"))
        assert torch.get_num_threads() == 1  # SLURM's --cpus-per-task decides
        dgroup.init_process_group(ClusterEnv(), threads=2)
        assert torch.get_num_threads() == 2  # an explicit value wins
        assert ddist.all_reduce_(torch.tensor([5]), "max").item() == 5
        obj = {"a": 1}
        assert ddist.broadcast_object(obj) is obj and ddist.all_gather_object(3) == [3]
        ddist.barrier()
        ctx.destroy()
    finally:
        torch.set_num_threads(threads)


def test_backend_choice() -> None:
    assert dgroup.choose_backend(ClusterEnv(gpus=0)) == "gloo"
    assert dgroup.choose_backend(ClusterEnv(gpus=2, local_world_size=2, world_size=2)) == "nccl"
    assert dgroup.choose_backend(ClusterEnv(gpus=2), "gloo") == "gloo"
    with pytest.raises(DDPJobError) as exc:
        dgroup.choose_backend(ClusterEnv(gpus=0, hostname="n1"), "nccl")
    line = exc.value.line()
    assert "nccl" in line and "sees no GPU" in line and "--backend gloo" in line


@pytest.mark.parametrize("derived", [False, True])
def test_rank0_port_in_use(derived: bool) -> None:
    """A port the user set and another program holds is theirs to change (one line, not
    retried); a port ddpjob chose is the node's doing: an infrastructure failure, retried on
    another port."""
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = ClusterEnv(rank=0, world_size=2, local_world_size=2, master_port=port, hostname="n1",
                         port_derived=derived)
        with pytest.raises(DDPJobError) as exc:
            dgroup.init_process_group(env, backend="gloo", timeout_s=3)
    line = exc.value.line()
    assert isinstance(exc.value, ClusterFailure) is derived
    if derived:
        assert f"rank 0 on n1 could not listen on port {port}, which ddpjob chose" in line
        assert "a restart takes another port" in line
    else:
        assert f"could not listen on MASTER_PORT={port}, which you set" in line and "set MASTER_PORT to a free one" in line
