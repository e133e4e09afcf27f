"""StateStore on 2 real gloo ranks: who writes which file of a DDP checkpoint (rank 0 the model,
rank 1 the optimizer), that the manifest still verifies with every file's sha256, that the files
hold what a resume must load (rank 0's BatchNorm statistics), and that one rank's failed write
leaves no committed checkpoint and stops every rank with a line naming it. The whole training
loop on top (stop, resume, bit-exact result) is tests/ranks/test_api.py's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpjob.config import JobConfig
from ddpjob.store.commit import CheckpointStore
from ranks import REPO, TESTS, assert_bit_equal

WORKER = textwrap.dedent("""
    import errno, json, sys
    from pathlib import Path
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddpjob.config import CheckpointConfig, JobConfig
    from ddpjob.node import dist, group
    from ddpjob.node.cluster import ClusterEnv
    from ddpjob.store import commit
    from ddpjob.store.commit import CheckpointStore
    from ddpjob.store.state import StateStore

    root, how, fail = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    env = ClusterEnv.from_environ(argv=[])
    ctx = group.init_process_group(env, backend="gloo", timeout_s=60, threads=1)
    wrote = []
    original, save = CheckpointStore._write_file, commit._torch_save

    def write_file(self, staging, name, obj, **kw):
        wrote.append(name)
        return original(self, staging, name, obj, **kw)

    def torch_save(obj, f):
        if fail == f"{env.rank}:{wrote[-1]}:{wrote.count(wrote[-1])}":  # the disk is full for this file
            raise OSError(errno.ENOSPC, "No space left on device")
        save(obj, f)

    CheckpointStore._write_file, commit._torch_save = write_file, torch_save
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = JobConfig(checkpoint=CheckpointConfig(keep_last=3, async_save=how == "async"))
    store = StateStore(cfg, env, root.parent, control=dist.Control(ctx), restart=0)
    state = {"model": model, "optimizer": opt, "note": "x"}
    error = ""
    for step in (1, 2):
        # each rank its own batch: the BatchNorm statistics differ between the ranks after a step
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(10 * step + env.rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        try:
            store.save(step, state, blocking=False)
            store.finish_pending()  # async: waits for the write, then rank 0 commits
        except Exception as exc:
            error = str(exc)
            break
    inner = model.module
    torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict()}, root.parent / f"held-{env.rank}.pt")
    print("RESULT " + json.dumps({"rank": env.rank, "wrote": wrote, "error": error}), flush=True)
    ctx.destroy()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_ranks(root: Path, how: str, fail: str = "") -> list[dict[str, Any]]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "RANK", "LOCAL_", "WORLD_", "MASTER_", "GROUP_", "DDPJOB_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])})
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), how, fail], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and "RESULT " in out, out + err
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    return results


@pytest.mark.parametrize("how", ["async", "blocking"])
def test_two_ranks_split_the_files_and_the_manifest_verifies(tmp_path: Path, how: str) -> None:
    root = tmp_path / "checkpoints"
    r0, r1 = _two_ranks(root, how)
    assert r0["error"] == r1["error"] == ""
    # each save: rank 0 the model, the plain values and its RNG streams; rank 1 the optimizer
    assert r0["wrote"] == ["rank-0.pt", "model.pt", "values.pt"] * 2
    assert r1["wrote"] == ["rank-1.pt", "optimizer.pt"] * 2
    store = CheckpointStore(root, config_hash=JobConfig().hash())
    info = store.latest(log=lambda _: None)  # every file's sha256 checked
    assert info is not None and info.step == 2 and [i.step for i in store.list()] == [2, 1]
    assert sorted(info.manifest["files"]) == ["model.pt", "optimizer.pt", "rank-0.pt", "rank-1.pt", "values.pt"]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no staging left
    held = [torch.load(tmp_path / f"held-{r}.pt", weights_only=True) for r in range(2)]
    # what a resume loads: rank 0's model (its BatchNorm statistics, which DDP's next forward
    # would have given every rank) and the optimizer state, the same bits on both ranks
    assert_bit_equal(store.load(info, "model.pt"), held[0]["model"], "model.pt")
    assert not torch.equal(held[0]["model"]["1.running_mean"], held[1]["model"]["1.running_mean"])
    assert_bit_equal(held[0]["optimizer"], held[1]["optimizer"], "the ranks' optimizers")
    assert_bit_equal(store.load(info, "optimizer.pt"), held[1]["optimizer"], "optimizer.pt")
    assert store.load(info, "values.pt") == {"note": "x"}


@pytest.mark.parametrize("how", ["async", "blocking"])
def test_one_ranks_failed_write_commits_nothing_and_stops_both(tmp_path: Path, how: str) -> None:
    """Rank 1 cannot write the optimizer of step 2 (disk full): step 1 stays the newest
    checkpoint, no staging folder is left, and both ranks raise at once (no rank waits for the
    other in a barrier until the timeout)."""
    root = tmp_path / "checkpoints"
    r0, r1 = _two_ranks(root, how, fail="1:optimizer.pt:2")  # the 2nd time
    assert "No space left on device" in r1["error"] and "disk or quota full" in r1["error"]
    assert "rank 1 could not write its files of checkpoint" in r0["error"], r0
    assert "No space left on device" in r0["error"]
    store = CheckpointStore(root, config_hash=JobConfig().hash())
    assert [i.step for i in store.list()] == [1]
    assert store.latest(log=lambda _: None).step == 1
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
