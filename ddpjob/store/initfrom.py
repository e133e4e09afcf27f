"""`[checkpoint] init_from`: a fresh run starts from another run's checkpoint or a weights file.

Only when the run has nothing of its own to resume (its own checkpoints always win, so a
requeued fine-tuning run resumes itself, not the source again). The run still starts at step 0
with its own schedule and freshly seeded RNGs: what comes from the source are the state keys
named in `init_keys` ("model": weights only; add "optimizer" for its moments). Sources: a run dir
(its newest valid checkpoint), one `step-N` folder (verified: sizes and sha256), or a file
holding a model state_dict. Everything loads with weights_only=True.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch

from ddpjob import rundir
from ddpjob.console import print0
from ddpjob.errors import DDPJobError
from ddpjob.node import dist, fsdp, modelsync
from ddpjob.store import manifest
from ddpjob.store.commit import CheckpointInfo

_HINT = "set checkpoint.init_from to a run dir, RUN_DIR/checkpoints/step-N or a weights file"


def _source(path: Path) -> CheckpointInfo | Path:
    """Rank 0: the checkpoint (or weights file) `path` names; DDPJobError when none is usable."""
    if path.is_file():
        return path
    m = manifest.STEP_DIR.fullmatch(path.name)
    if m and path.is_dir():
        reason = manifest.verify(path, int(m.group(1)))
        if reason is not None:
            raise DDPJobError(f"checkpoint.init_from {path} is not a valid checkpoint ({reason})", _HINT)
        return CheckpointInfo(path, int(m.group(1)), manifest.read(path))
    if (path / rundir.CHECKPOINTS).is_dir():
        found = manifest.newest_valid(path / rundir.CHECKPOINTS)
        if found is None:
            raise DDPJobError(f"checkpoint.init_from {path} holds no valid checkpoint", _HINT)
        return CheckpointInfo(found[1], found[0], manifest.read(found[1]))
    raise DDPJobError(f"checkpoint.init_from '{path}' is neither a run dir, a step-N folder nor a "
                      "file, expected an existing checkpoint", _HINT)


def _load_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = str(err)
        # torch's own advice (weights_only=False: run whatever the file holds) is not repeated
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise DDPJobError(f"refusing to load {path}: it holds more than tensors and plain values "
                              f"({found.group(1)} objects)", "save it with torch.save(model.state_dict(), path)") from None
        what = re.search(r"Unsupported operand \d+", text)
        raise DDPJobError(f"cannot read {path} as weights saved by torch.save"
                          + (f" ({what.group(0)})" if what else ""), _HINT) from None
    except (RuntimeError, OSError, EOFError, KeyError, IndexError, ValueError, TypeError, AttributeError) as err:
        # a text file or random bytes fail inside the legacy unpickler in many ways (KeyError: 101)
        why = " ".join(str(err).split())[:120]
        raise DDPJobError(f"cannot read {path} as weights saved by torch.save ({type(err).__name__}: {why})",
                          _HINT) from None


def load(state: MutableMapping[str, Any], source: str, keys: tuple[str, ...], rank: int,
         target: Any) -> None:
    """Every rank: load `keys` of the source into the state objects (target() unwraps DDP)."""
    found = dist.rank0_decides(rank == 0, lambda: _source(Path(source)), what="the choice of checkpoint.init_from")
    if isinstance(found, Path):
        keys = ("model",)
        loaded = {"model": _load_file(found)}
    else:
        files = found.manifest.get("files", {})
        in_dcp = [k for k in keys if k in found.manifest.get("sharded", [])]
        if in_dcp:
            raise DDPJobError(f"checkpoint.init_from {found.path} holds {', '.join(in_dcp)} as DCP shards "
                              "(written with train.strategy = \"fsdp\"), expected <key>.pt files",
                              f"set checkpoint.init_from to {found.path.parent.parent / rundir.FINAL / 'model.pt'} "
                              "(the whole model that run finished with)")
        missing = [k for k in keys if f"{k}.pt" not in files]
        if missing:
            raise DDPJobError(f"checkpoint.init_from {found.path} has no {', '.join(missing)} (it holds "
                              f"{', '.join(sorted(f[:-3] for f in files if not f.startswith('rank-')))})",
                              "list only saved keys in checkpoint.init_keys")
        loaded = {k: _load_file(found.path / f"{k}.pt") for k in keys}
    for key in keys:
        if key not in state:
            raise DDPJobError(f"checkpoint.init_keys names '{key}', which this run's state does not "
                              f"have (it has {', '.join(state)})", "name keys of the dict given to job.resume()")
        obj = target(state[key])
        try:
            if fsdp.is_sharded(obj):  # strategy fsdp: the whole weights scattered into the shards
                if not isinstance(obj, torch.nn.Module):
                    raise DDPJobError(f"checkpoint.init_keys names '{key}', a sharded optimizer: its "
                                      "saved state is keyed by position, a sharded one by parameter name",
                                      "start a fsdp run from the weights only: init_keys = [\"model\"]")
                modelsync.load_full_state_dict(obj, loaded[key])
            else:
                obj.load_state_dict(loaded[key])
        except DDPJobError:
            raise
        except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as err:
            raise DDPJobError(f"checkpoint.init_from: '{key}' does not fit this run's "
                              f"{type(state[key]).__name__} ({' '.join(str(err).split())[:200]})",
                              "start from a checkpoint of the same model") from None
    where = found if isinstance(found, Path) else f"{found.path} (step {found.step})"
    print0(f"initialised {', '.join(keys)} from {where}; training starts at step 0")
