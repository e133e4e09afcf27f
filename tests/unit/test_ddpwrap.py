"""node/ddpwrap.py and the step timer's hooks in-process (a one-rank gloo group): the model
job.wrap returns, timed for the straggler watch, pickles and copies as the user's own module
would (`torch.save(model)`, `copy.deepcopy(model)`). The same after a real `ddpjob.init()` with
2 ranks: tests/ranks/test_wrap_pickle.py."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from ddpjob.node.ddpwrap import TimedDDP
from ddpjob.rank.steptimer import StepTimer


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_wrapped_model_pickles_and_copies_after_its_steps_were_timed(group: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    ddp = TimedDDP(model)
    timer = StepTimer(0, 2, None, waited=lambda: 0.0, load=lambda: (0.0, 1))
    timer.watch_forward(ddp, model)
    x = torch.randn(16, 4)
    for step in range(1, 3):  # the hooks ran: the pre-forward timed, the gradients stamped
        timer.step_started()
        ddp(x).sum().backward()
        timer.step_done(step)
    assert timer.arrived > 0.0 and timer._blocked > 0.0 and timer._blocked_waited >= 0.0

    for obj in (model, ddp):  # the user's module and what job.wrap returned
        loaded = torch.load(io.BytesIO(_saved(obj)), weights_only=False)
        twin = copy.deepcopy(obj)
        obj.eval(), loaded.eval(), twin.eval()
        with torch.no_grad():
            assert torch.equal(loaded(x), obj(x)) and torch.equal(twin(x), obj(x))
    # nothing of ddpjob's travels with the user's module: no hook, no reference to load
    assert b"ddpjob" not in _saved(model)
    loaded = torch.load(io.BytesIO(_saved(model)), weights_only=False)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in loaded.modules())
    assert all(p._post_accumulate_grad_hooks is None for p in loaded.parameters())
    assert isinstance(copy.deepcopy(ddp), nn.parallel.DistributedDataParallel)


def test_a_checkpoint_of_the_timed_ddp_holds_the_plain_names() -> None:
    """job.wrap's DDP is a subclass: the store still looks inside it (checkpoints hold `fc.weight`,
    not `module.fc.weight`, and load at any world size, also unwrapped)."""
    import torch

    from ddpjob.node.ddpwrap import TimedDDP
    from ddpjob.store.statecheck import plain_module, plain_state_dict

    inner = torch.nn.Linear(2, 1)
    wrapped = TimedDDP.__new__(TimedDDP)  # no process group needed to ask what it wraps
    torch.nn.Module.__init__(wrapped)
    wrapped.module = inner
    assert plain_module(wrapped) is inner and sorted(plain_state_dict(wrapped)) == ["bias", "weight"]
