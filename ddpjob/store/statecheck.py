"""What a state dict and a checkpoint of it hold, without the store: check_state (a state the
first checkpoint would refuse, refused at resume()), _code_inside (a checkpoint that would import
code when loaded), the module inside DDP / torch.compile wrappers (_target, plain_module,
plain_state_dict), which values are stateful and which plain (_stateful, _plain), and seed_for
(the seed of a rank's RNG streams when nothing was saved). StateStore (state.py) and the rank
layer use them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import MutableMapping
from typing import Any

import torch

from ddpjob.errors import DDPJobError
from ddpjob.store import perrank
from ddpjob.store.commit import CheckpointInfo
from ddpjob.store.loadable import check_loadable

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_RESERVED = {"values", "manifest"}


def _code_inside(info: CheckpointInfo) -> str:
    """The globals a .pt file of the checkpoint would import when unpickled, beyond what
    torch.load(weights_only=True) allows ("" when there are none): read from the pickle's
    opcodes, nothing is executed."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    for name in info.manifest.get("files", {}):
        if name.endswith(".pt"):
            try:
                found = get_unsafe_globals_in_checkpoint(info.path / name)
            except Exception:  # not a readable torch file: the load says so, in its own line
                continue
            if found:
                return f"{name} imports {', '.join(sorted(found)[:3])}"
    return ""


def check_state(state: Any) -> None:
    if not isinstance(state, MutableMapping) or not state:
        raise DDPJobError(f"the state is {type(state).__name__}, expected a non-empty dict of name -> "
                          "object with state_dict()/load_state_dict() or plain value",
                          "pass e.g. {'model': model, 'optimizer': optimizer, 'sampler': sampler}")
    for key in state:
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in _RESERVED:
            raise DDPJobError(f"state key {key!r} is not usable as a checkpoint file name, expected "
                              "letters, digits and _ (not 'values' or 'manifest')",
                              "rename the key, e.g. 'optimizer' or 'lr_scheduler'")
    # what the first checkpoint would refuse, refused now (at resume(), not steps later)
    for key, value in state.items():
        if isinstance(value, torch.Generator):
            raise DDPJobError(f"state[{key!r}] is a torch.Generator, which a checkpoint cannot hold as it is, "
                              "expected an object with state_dict()/load_state_dict() or a plain value",
                              f"each rank's own generator: state[{key!r}] = ddpjob.PerRank(generator) "
                              "(saved and resumed per rank, docs/api.md)")
        if _plain(value):
            check_loadable(value, [f"state[{key!r}]"])


# wrapper class -> the attribute holding the wrapped module (DDP, torch.compile)
_WRAPPERS = {"DistributedDataParallel": "module", "OptimizedModule": "_orig_mod"}


def _target(obj: Any) -> Any:
    """What to load into: the module inside DDP / torch.compile wrappers (in any nesting), so
    checkpoints hold plain names (`fc.weight`, not `module.fc.weight`) and load at any world
    size, also unwrapped."""
    while (attr := _wrapped_in(obj)) is not None:
        obj = getattr(obj, attr)
    return obj


def _wrapped_in(obj: Any) -> str | None:
    """The attribute holding the module `obj` wraps, by its class or a base class: job.wrap's
    DDP is a subclass (node/ddpwrap.TimedDDP), and a checkpoint holds the same plain names."""
    return next((_WRAPPERS[c.__name__] for c in type(obj).__mro__ if c.__name__ in _WRAPPERS), None)


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / torch.compile wrappers."""
    return _target(model)


def plain_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    return dict(_target(model).state_dict())


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _plain(obj: Any) -> bool:
    """A plain value of the state (values.pt, rank 0's): neither stateful nor per rank."""
    return not _stateful(obj) and not isinstance(obj, perrank.PerRank)


def seed_for(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest(), "little")
