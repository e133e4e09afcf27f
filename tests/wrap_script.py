"""A user script for tests/ranks/test_wrap_pickle.py: after `job.wrap` and a few timed steps
(the straggler watch on, its hooks run), it saves and copies its model the ways the PyTorch
examples do, on every rank, and says what it found: `torch.save(model)` (the DDP job.wrap
returned) and `torch.save(model.module)` (the user's own module) load back and compute the
same; `copy.deepcopy` of both works; the user's module carries no hook and no reference to
ddpjob."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn

import ddpjob


def main() -> None:
    job = ddpjob.init()
    torch.manual_seed(0)
    model = job.wrap(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt}
    x = torch.randn(32, 8)
    for step in job.steps(state, 6):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        job.log(step + 1, loss=loss)
    model.eval()
    with torch.no_grad():
        want = model(x)
    for what, obj in (("model", model), ("model.module", model.module)):
        buf = io.BytesIO()
        torch.save(obj, buf)  # the whole module, pickled, as the PyTorch examples save it
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False).eval()
        twin = copy.deepcopy(obj).eval()
        with torch.no_grad():
            same = torch.equal(loaded(x), want) and torch.equal(twin(x), want)
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in loaded.modules())
        print(f"rank {job.rank}: torch.save({what}) and copy.deepcopy({what}) work, same output {same}, "
              f"hooks {hooks}, ddpjob in the pickle {b'ddpjob' in buf.getvalue()}", flush=True)
    job.finish(model)


if __name__ == "__main__":
    main()
