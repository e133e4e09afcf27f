"""`ddpjob selftest`: does the process group work, and how fast is it?

Runs wherever `ddpjob run` would (under srun, torchrun, or alone): ClusterEnv -> dist ->
exact checks of all-reduce, broadcast and all-gather, then an all-reduce bandwidth measurement.
Rank 0 prints the table of ranks, the bus bandwidth and `selftest: OK` or `selftest: FAILED ...`.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from ddpjob import console
from ddpjob.node.cluster import ClusterEnv
from ddpjob.node.dist import (DistContext, all_gather_object, all_reduce_, barrier, broadcast_,
                              broadcast_object)
from ddpjob.node.group import init_process_group

WARMUP, TIMED = 2, 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_sum(ctx: DistContext, device: torch.device) -> tuple[int, str | None]:
    """Integer sum of ranks: exact, so any lost or doubled contribution shows."""
    n = ctx.env.world_size
    t = torch.tensor([ctx.env.rank], dtype=torch.int64, device=device)
    all_reduce_(t)
    got, expected = int(t.item()), n * (n - 1) // 2
    return got, (None if got == expected else f"all_reduce sum of ranks {got}, expected {expected}")


def check_broadcast(ctx: DistContext, device: torch.device) -> str | None:
    """Rank 0's random tensor must arrive bit-exact: compare sha256 of the raw bytes."""
    t = torch.rand(4096, generator=torch.Generator().manual_seed(time.time_ns())).to(device)
    broadcast_(t, src=0)
    digest = hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
    reference = broadcast_object(digest)
    return None if digest == reference else f"broadcast differs on rank {ctx.env.rank}"


def check_layout(rows: list[tuple]) -> str | None:
    """The gathered (rank, local rank, node, host, ...) rows must describe a consistent job."""
    ranks = [r[0] for r in rows]
    if ranks != list(range(len(rows))):
        return f"all_gather returned ranks {ranks}, expected 0..{len(rows) - 1}"
    hosts_by_node: dict[int, set[str]] = {}
    local_by_node: dict[int, list[int]] = {}
    for _, local_rank, node, host, *_ in rows:
        hosts_by_node.setdefault(node, set()).add(host)
        local_by_node.setdefault(node, []).append(local_rank)
    for node, hosts in hosts_by_node.items():
        if len(hosts) != 1:
            return f"node {node} reported as several hosts {sorted(hosts)}"
        if sorted(local_by_node[node]) != list(range(len(local_by_node[node]))):
            return f"local ranks on node {node} are {sorted(local_by_node[node])}, expected 0..k-1"
    return None


def measure_bandwidth(ctx: DistContext, device: torch.device,
                      size_mb: float) -> tuple[float, float, str | None]:
    """Median all-reduce time and bus bandwidth (nccl-tests' busbw: bytes * 2(n-1)/n / time,
    the traffic each rank's link carries in a ring, so it is comparable across rank counts)."""
    n = ctx.env.world_size
    numel = max(1, int(size_mb * 1e6) // 4)
    x = torch.empty(numel, dtype=torch.float32, device=device)
    times, problem = [], None
    for i in range(WARMUP + TIMED):
        x.fill_(ctx.env.rank + 1)
        _sync(device)
        barrier()  # everyone starts together: the time is the collective's, not the stragglers'
        t0 = time.perf_counter()
        all_reduce_(x)
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        elif i == 0:
            expected = n * (n + 1) / 2  # small integers: exact in float32
            if not bool((x == expected).all()):
                problem = f"all_reduce of {size_mb:g} MB gave wrong values on rank {ctx.env.rank}"
    median = statistics.median(times)
    busbw = numel * 4 * 2 * (n - 1) / n / median / 1e9 if n > 1 else 0.0
    return median, busbw, problem


def cmd_selftest(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    argv = [] if args.local_rank is None else [f"--local-rank={args.local_rank}"]
    env = ClusterEnv.from_environ(argv=argv, num_gpus=torch.cuda.device_count())
    console.set_rank(env.rank)
    ctx = init_process_group(env, backend=args.backend, timeout_s=args.timeout)
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    try:
        total, problem = check_sum(ctx, device)
        problems = [problem, check_broadcast(ctx, device)]
        row = (env.rank, env.local_rank, env.node_rank, env.hostname, str(ctx.device), ctx.backend)
        rows = all_gather_object(row)
        problems.append(check_layout(rows))
        median, busbw, problem = measure_bandwidth(ctx, device, args.size_mb)
        problems.append(problem)
        found = [p for p in problems if p]
        everyone = sorted({p for ps in all_gather_object(found) for p in ps})
    except RuntimeError as exc:  # a collective failed or timed out: this rank cannot gather more
        print(f"selftest: FAILED rank {env.rank} on {env.hostname}: {' '.join(str(exc).split())[:300]}",
              flush=True)
        return 1
    finally:
        ctx.destroy()
    nodes = len({r[2] for r in rows})
    console.print0(f"selftest: {env.world_size} rank(s) on {nodes} node(s) via {env.source}, backend "
                   f"{ctx.backend}, master {env.master_addr}:{env.master_port}")
    if env.is_rank0:
        console.table("ranks", ["rank", "local rank", "node", "host", "device", "backend"], rows)
    n = env.world_size
    console.print0(f"all_reduce sum of ranks: {total} (expected {n * (n - 1) // 2}); broadcast of "
                   f"4096 random floats compared bit-exact on every rank; all_gather: {len(rows)} row(s)")
    if n > 1:
        console.print0(f"all-reduce bus bandwidth: {busbw:.3f} GB/s ({args.size_mb:g} MB, median of "
                       f"{TIMED} after {WARMUP} warm-up, {median * 1e3:.1f} ms each)")
    else:
        console.print0("all-reduce bus bandwidth: n/a with 1 rank")
    wall = time.perf_counter() - start
    if everyone:
        console.print0(f"selftest: FAILED {'; '.join(everyone)} ({wall:.1f} s)")
        return 1
    console.print0(f"selftest: OK ({wall:.1f} s)")
    return 0
