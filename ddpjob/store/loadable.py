"""What torch.load(weights_only=True) accepts, the rule of every checkpoint file: checked at
save time (check_loadable, before a byte is written) and applied at load time (load_file).
commit.py and state.py check each value they write; commit.py, peers.py load with it.
"""

from __future__ import annotations

import pickle
import re
from collections import Counter, OrderedDict
from typing import Any

import torch

from ddpjob.errors import DDPJobError


def load_file(src: Any, map_location: Any, what: str) -> Any:
    """torch.load with weights_only=True: a file that would import anything beyond tensors and
    plain values is refused in one line, never unpickled."""
    try:
        return torch.load(src, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        why = f"it would import {found.group(1)}" if found else str(err).splitlines()[0]
        raise DDPJobError(f"refusing to load {what}: it holds more than tensors and plain values ({why})",
                          "load only checkpoints you trust; ddpjob loads with weights_only=True and "
                          "never runs code from a file") from None


_SAFE_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None),
                torch.Tensor, torch.nn.Parameter, torch.Size, torch.device, torch.dtype)


def check_loadable(obj: Any, where: list[Any]) -> None:
    """Refuse at save time what weights_only loading would refuse at resume time (exact types:
    a numpy float64 is a float subclass yet does not load)."""
    kind = type(obj)
    if kind in _SAFE_LEAVES:
        return
    if kind in (dict, OrderedDict, Counter):
        for key, value in obj.items():
            where.append(key)
            check_loadable(key, where)
            check_loadable(value, where)
            where.pop()
    elif kind in (list, tuple, set):
        for i, value in enumerate(obj):
            where.append(i)
            check_loadable(value, where)
            where.pop()
    elif kind not in torch.serialization.get_safe_globals():
        at = str(where[0]) + "".join(f"[{k!r}]" for k in where[1:])
        raise DDPJobError(f"checkpoint value {at} is a {kind.__module__}.{kind.__qualname__}, which "
                          "torch.load(weights_only=True) refuses",
                          "store only tensors, numbers, strings, lists and dicts (torch.from_numpy for "
                          "arrays, .state_dict() for objects)")
