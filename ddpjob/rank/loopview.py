"""What a user's loop holds outside `state`, as `ddpjob verify` sees it at each step (rank/probe.py
calls `view` as `job.steps()` hands a step out; launch/verifyfacts.py compares two runs' views).

The loop's variables (the frame iterating `job.steps()`: its locals and, for a function, its
module's globals) are fingerprinted by content, each with a kind: a number or string, a tensor
without grad (a batch, a carried hidden state), an own random generator, an optimizer, GradScaler
or LR scheduler, another object with state_dict(). What `state` holds is left out (it is
resumed), and so is what cannot carry a value from one step to the next that matters here
(modules, functions, the model's parameters, results such as a dict of logged values).
"""

from __future__ import annotations

import hashlib
from types import FrameType, FunctionType, ModuleType
from typing import Any

MAX_NUMEL = 1 << 20  # a tensor larger than this is not a batch verify's small runs would hold
MAX_TEXT = 4096
# (kind, digest, shown): shown is the value as text for a number or string, for the line
Entry = tuple[str, str, str]


def inside_ids(state: dict[str, Any]) -> set[int]:
    """The objects `state` holds (its values, a PerRank's object, and their attributes): resumed,
    so not the loop's own."""
    out: set[int] = set()
    for v in state.values():
        for obj in (v, getattr(v, "obj", None)):
            if obj is None:
                continue
            out.add(id(obj))
            out.update(id(a) for a in list(getattr(obj, "__dict__", {}).values()))
            module = getattr(obj, "module", None)  # DDP: the model inside
            if module is not None:
                out.add(id(module))
    return out


def view(frame: FrameType | None, inside: set[int], cache: dict[int, tuple[Any, Entry]]) -> dict[str, Entry]:
    """name -> (kind, digest, shown) of each variable of the loop's frame that verify compares.
    `cache` keeps a tensor's entry while it is the same object, unchanged in place (a data set
    held as one tensor is fingerprinted once, not at every step)."""
    if frame is None:
        return {}
    scopes = [frame.f_locals] + ([frame.f_globals] if frame.f_globals is not frame.f_locals else [])
    out: dict[str, Entry] = {}
    for scope in scopes:
        for name, value in list(scope.items()):
            if name in out or name.startswith("__") or id(value) in inside:
                continue
            entry = _entry(value, cache)
            if entry is not None:
                out[name] = entry
    return out


def _entry(value: Any, cache: dict[int, tuple[Any, Entry]]) -> Entry | None:
    import torch

    if isinstance(value, (ModuleType, type, FunctionType)) or callable(value) and not hasattr(value, "state_dict") \
            and not is_generator(value):
        return None
    if isinstance(value, bool) or isinstance(value, (int, float, str)):
        if isinstance(value, str) and len(value) > MAX_TEXT:
            return None  # a script's text or path: read once, never a value that changes
        return ("number" if not isinstance(value, str) else "text", digest(value), repr(value)[:40])
    if isinstance(value, torch.Tensor) or _tensors(value):
        tensors = [value] if isinstance(value, torch.Tensor) else _tensors(value)
        if any(t.requires_grad or t.numel() > MAX_NUMEL for t in tensors):
            return None  # a parameter, or an output still attached to the graph: not carried
        versions = tuple(t._version for t in tensors)
        held = cache.get(id(value))
        if held is not None and held[0][0] is value and held[0][1] == versions:
            return held[1]
        kind = "zeros" if all(not t.any() for t in tensors if t.numel()) else \
            "float" if any(t.is_floating_point() for t in tensors) else "int"
        entry = (f"tensor:{kind}", digest(tensors), "")
        cache[id(value)] = ((value, versions), entry)
        return entry
    if is_generator(value):
        return ("generator", digest(generator_state(value)), _generator_type(value))
    if isinstance(value, torch.optim.Optimizer):
        return ("optimizer", digest(_optimizer_view(value)), type(value).__name__)
    if isinstance(value, torch.amp.GradScaler) or type(value).__name__ == "GradScaler":
        return ("scaler", digest(value.state_dict()), "GradScaler")
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        d = value.state_dict()
        return ("scheduler", digest({k: d[k] for k in ("last_epoch", "_last_lr", "_step_count") if k in d}),
                type(value).__name__)
    if isinstance(value, torch.nn.Module):
        return None  # the model, or a copy of it: its parameters are compared at the end
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        top = type(value).__module__.split(".")[0]
        if top in ("ddpjob", "torch"):
            return None  # ddpjob's own (the Job's parts) or torch's (a DataLoader's sampler)
        try:
            return ("stateful", digest(value.state_dict()), type(value).__name__)
        except Exception:  # noqa: BLE001 - its state_dict() fails outside its use: not fingerprinted
            return None
    return None


def _tensors(value: Any) -> list[Any]:
    """The tensors of a batch held as a tuple, list or dict of up to 16 of them ([] otherwise)."""
    import torch

    items = list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, (tuple, list)) else []
    if not items or len(items) > 16 or not all(isinstance(t, torch.Tensor) for t in items):
        return []
    return items


def _optimizer_view(opt: Any) -> Any:
    """Light: each group's hyperparameters and each parameter's step count, not its moments (a
    model's size in every step); a missing optimizer restarts with no state at all."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    steps = [float(s["step"]) if "step" in s else len(s) for s in list(opt.state.values())[:4]]
    return groups, len(opt.state), steps


def is_generator(value: Any) -> bool:
    """An own random generator (torch, numpy, random), not a library's global one."""
    import random

    import numpy as np
    import torch

    if isinstance(value, torch.Generator):
        return value is not torch.default_generator and all(value is not g for g in torch.cuda.default_generators)
    if isinstance(value, (np.random.Generator, np.random.RandomState)):
        return value is not np.random.mtrand._rand
    return isinstance(value, random.Random) and value is not getattr(random, "_inst", None)


def _generator_type(g: Any) -> str:
    top = type(g).__module__.split(".")[0]
    return f"{'numpy.random' if top == 'numpy' else top}.{type(g).__name__}"


def generator_state(g: Any) -> Any:
    if hasattr(g, "bit_generator"):
        return g.bit_generator.state
    if hasattr(g, "get_state"):
        return g.get_state()  # torch.Generator, numpy RandomState
    return g.getstate()


def digest(value: Any) -> str:
    """sha256 of a nested value of tensors, arrays, numbers and strings, the same for equal
    contents whatever the object identities (a state_dict, a generator's state)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:16]


def _feed(h: Any, value: Any) -> None:
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard
        t = local.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray):
        h.update(f"A{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=str):
            h.update(repr(k).encode())
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(value).encode())
