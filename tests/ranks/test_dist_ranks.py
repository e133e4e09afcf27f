"""dist.py with real processes on gloo: collectives work, failures are one line and on time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ddpjob.errors import DDPJobError
from ddpjob.node import group as dgroup
from ddpjob.node.cluster import ClusterEnv
from ranks import free_port

WORKER = textwrap.dedent("""
    import json, sys
    from ddpjob.node import dist as d, group
    from ddpjob.node.cluster import ClusterEnv
    env = ClusterEnv.from_environ(argv=[])
    ctx = group.init_process_group(env, backend="gloo", timeout_s=60)
    import torch
    out = dict(rank=env.rank, backend=ctx.backend, device=str(ctx.device), init=ctx.initialized,
               threads=torch.get_num_threads(),
               max=int(d.all_reduce_(torch.tensor([10 * env.rank + 7]), "max").item()),
               bcast=d.broadcast_object({"from": env.rank, "list": [1, 2]}),
               gathered=d.all_gather_object((env.rank, env.hostname)))
    d.barrier()
    ctx.destroy()
    out["after_destroy"] = ctx.initialized
    print("RESULT " + json.dumps(out), flush=True)
""")


def clean_environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "RANK", "LOCAL_", "WORLD_", "MASTER_", "GROUP_", "DDPJOB_"))}
    env.update(extra)
    return env


def test_two_processes_all_reduce_broadcast_gather() -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=clean_environ(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                           LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                           MASTER_PORT=str(port)))
             for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    for r, res in enumerate(results):
        assert res["rank"] == r and res["backend"] == "gloo" and res["device"] == "cpu" and res["init"]
        assert res["max"] == 17  # max(7, 17)
        assert res["bcast"] == {"from": 0, "list": [1, 2]}
        assert [g[0] for g in res["gathered"]] == [0, 1]
        assert res["after_destroy"] is False
        # 2 ranks share this machine's cores: each gets its share, at least 1
        assert res["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_group_that_does_not_form_names_the_missing_ranks() -> None:
    """Rank 0 and rank 1 of 3 start, rank 2 never does: both fail on time with one line each."""
    port = free_port()
    rank0 = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            from ddpjob.errors import DDPJobError
            from ddpjob.node import group
            from ddpjob.node.cluster import ClusterEnv
            try:
                group.init_process_group(ClusterEnv(world_size=3, local_world_size=3, master_port={port},
                                                hostname="n1"), backend="gloo", timeout_s=4)
            except DDPJobError as exc:
                print(exc.line())
        """)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=clean_environ())
    env = ClusterEnv(rank=1, local_rank=1, world_size=3, local_world_size=3, master_port=port, hostname="n2")
    # rank 1 starts once rank 0 listens: on a loaded machine rank 0's imports alone can outlast
    # rank 1's 10 s to reach it, and that is another error (no race with the clock)
    deadline = time.monotonic() + 300
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert rank0.poll() is None and time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(DDPJobError) as exc:
        dgroup.init_process_group(env, backend="gloo", timeout_s=10)
    assert time.monotonic() - start < 25
    assert f"rank 1 on n2 reached rank 0 at 127.0.0.1:{port} but the gloo group of 3 ranks did not form" \
        in exc.value.line()
    out, _ = rank0.communicate(timeout=60)
    assert "rank 0 on n1 waited" in out and "not all 3 ranks joined" in out and "2/3 clients joined" in out


HOOK_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddpjob.node import group
    from ddpjob.node.gradsync import register_comm_hook
    from ddpjob.node.cluster import ClusterEnv
    ordered, compression = sys.argv[1] == "ordered", sys.argv[2]
    env = ClusterEnv.from_environ(argv=[])
    ctx = group.init_process_group(env, backend="gloo", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    ddp = DDP(model)
    register_comm_hook(ddp, ordered=ordered, compression=compression)
    ddp(torch.randn(8, 64, generator=torch.Generator().manual_seed(env.rank))).square().sum().backward()
    print("RESULT " + json.dumps({"rank": env.rank, "grad": model.weight.grad.flatten().tolist()}), flush=True)
    del ddp  # its reducer holds the group: freed first, gloo's threads are joined in destroy (test_trainer)
    ctx.destroy()
""")


def _local_grad(rank: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    model(torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    assert model.weight.grad is not None
    return model.weight.grad.flatten()


@pytest.mark.parametrize("world, ordered", [(2, False), (3, True)])
def test_bf16_gradient_compression_sends_bfloat16(world: int, ordered: bool) -> None:
    """train.grad_compression = "bf16": every rank ends with the same gradient, the mean of the
    ranks' gradients each rounded to bfloat16 (ordered: summed in rank order, exactly that)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", HOOK_WORKER, "ordered" if ordered else "ring", "bf16"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_environ(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                                MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(world)]
    grads = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        grads.append(torch.tensor(json.loads(out.split("RESULT ", 1)[1])["grad"]))
    assert all(torch.equal(g, grads[0]) for g in grads)
    local = [_local_grad(r) for r in range(world)]
    fp32_mean = sum(local) / world
    assert not torch.equal(grads[0], fp32_mean)  # it really was rounded on the way
    if ordered:
        expected = local[0].bfloat16().float()
        for g in local[1:]:
            expected = expected + g.bfloat16().float()
        assert torch.equal(grads[0], expected / world)
    else:  # torch's bf16 hook: each rank's grad / world in bfloat16, summed in bfloat16
        expected = sum((g.bfloat16() / world for g in local[1:]), local[0].bfloat16() / world).float()
        assert torch.equal(grads[0], expected)
    # each rank's value rounded to bf16 (half an ulp: 2^-9 of it), and the sum once more
    bound = 2.0 ** -7 * sum(g.abs() for g in local) / world
    assert bool(((grads[0] - fp32_mean).abs() <= bound).all())
