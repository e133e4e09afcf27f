"""The DistributedDataParallel that `job.wrap` returns: torch's own, whose pre-forward (its broadcast
of rank 0's buffers, a wait for rank 0) is told to a listener as it begins and ends.

The straggler watch (rank/straggler.py) needs that wait taken out of a rank's work. It used to
time it with forward pre-hooks (lambdas) on DDP and on the user's module, and those made the
module unpicklable: `torch.save(model)` and `copy.deepcopy(model)` failed on "Can't pickle local
object". Here nothing is registered on any module: the subclass overrides one method, and the
listener is held outside the module (a WeakKeyDictionary keyed by it), so the module pickles and
copies as plain DDP does (a copy or a loaded one is simply not timed).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel


class Listener(Protocol):
    """Told when each pre-forward begins and ends (rank/steptimer.StepTimer)."""

    def pre_forward_began(self) -> None: ...

    def pre_forward_ended(self) -> None: ...


# ddp -> its listener; outside the module, never pickled
_LISTENERS: weakref.WeakKeyDictionary[Any, Listener] = weakref.WeakKeyDictionary()


class TimedDDP(DistributedDataParallel):
    """DistributedDataParallel (isinstance holds, every argument is DDP's) whose pre-forward is
    timed for a listener set with `listen`. Without one it is plain DDP."""

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        listener = _LISTENERS.get(self)
        if listener is None or torch.compiler.is_compiling():  # nothing of ours in a traced graph
            return super()._pre_forward(*inputs, **kwargs)
        listener.pre_forward_began()
        try:
            return super()._pre_forward(*inputs, **kwargs)
        finally:
            listener.pre_forward_ended()


def listen(ddp: Any, listener: Listener) -> bool:
    """Tell `listener` when each of `ddp`'s pre-forwards begins and ends; False where `ddp` is
    not a TimedDDP (nothing is timed then)."""
    if not isinstance(ddp, TimedDDP):
        return False
    _LISTENERS[ddp] = listener
    return True
