"""trainer.py: learning, precision paths, frozen backbones, the accumulation all-reduce count,
and the pure building blocks (lr schedule, optimizer groups, AMP choice).

Single-process runs call fit() in this process (no process group); multi-rank behaviour is
checked with real processes (tests/ranks.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ranks import base_env, free_port

torch.set_num_threads(1)


_COUNT_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from ddpjob.train import trainer
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    calls = {"n": 0}
    def counting_hook(state, bucket):
        calls["n"] += 1
        return default_hooks.allreduce_hook(state, bucket)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                bucket_cap_mb=100)  # one bucket: one hook call = one all-reduce
    model.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss_fn = torch.nn.CrossEntropyLoss()
    K, steps = 4, 5
    micro = [[(torch.randn(3, 8), torch.randint(0, 4, (3,))) for _ in range(K)] for _ in range(steps)]
    for batches in micro:
        trainer.train_step(model, opt, scaler, batches, loss_fn=loss_fn, amp_dtype=None)
    with_no_sync = calls["n"]
    calls["n"] = 0
    for batches in micro:  # the naive loop, to show the counter would see the difference
        for x, y in batches:
            (loss_fn(model(x), y) / K).backward()
        opt.step(); opt.zero_grad()
    print(json.dumps({"train_step": with_no_sync, "naive": calls["n"]}))
    dist.barrier()
    # Free DDP (its reducer holds the group) before the destroy, so that gloo's worker threads
    # are joined now: one still dropping a Python hook's callback (it needs the GIL) when the
    # interpreter finalizes ends in std::terminate, SIGABRT (one CI run in ~30 on a busy machine).
    del model, opt
    dist.destroy_process_group()
""")


def test_one_all_reduce_per_optimizer_step_with_accumulation(tmp_path: Path) -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _COUNT_SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=base_env({"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                            "MASTER_PORT": str(port)})) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        counts = json.loads(out.strip().splitlines()[-1])
        assert counts == {"train_step": 5, "naive": 20}  # 5 steps x accumulation 4
