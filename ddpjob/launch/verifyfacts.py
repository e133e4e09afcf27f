"""The facts `ddpjob verify` reads from a run dir (launch/verify.py runs them, launch/verdict.py
judges them): every scalar each step logged, the step a run resumed from, each rank's view of its
loop at every step (rank/probe.py, rank/loopview.py), each rank's digests of its `state` at the
end, and the tensors of the final model and the last checkpoint. torch is imported only where
the .pt files are loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ddpjob import fileio, probeplan, rundir
from ddpjob.ledger import events

BN_STATISTICS = ("running_mean", "running_var")
META = ("kind", "time", "step", "restart")  # a metric record's own fields, not logged values
Views = dict[int, dict[int, dict[str, tuple[str, str, str]]]]  # rank -> step -> name -> entry


def scalars(run_dir: Path) -> dict[int, dict[str, float | str]]:
    """step -> {name: value} of every value logged at that step, each name's newest record (a
    replayed step's record comes later in the file; after `ddpjob resume` the `restart` field
    starts again, so the file order decides)."""
    out: dict[int, dict[str, float | str]] = {}
    try:
        text = (run_dir / rundir.METRICS).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        mine = out.setdefault(rec["step"], {})
        for name, v in rec.items():
            if name not in META and isinstance(v, (int, float, str)):
                mine[name] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
    return out


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of each step's newest record."""
    return {s: float(v["loss"]) for s, v in scalars(run_dir).items() if isinstance(v.get("loss"), float)}


def resumed_step(run_dir: Path) -> int | None:
    """The step the run continued from after its interruption (the checkpoint's or the
    in-memory snapshot's), from the second `start` record of events.jsonl; None if it never
    restarted."""
    starts = [e for e in events.read(run_dir) if e.get("event") == "start"]
    if len(starts) < 2:
        return None
    step = starts[1].get("resumed_step")
    return int(step) if isinstance(step, int) else 0


def views(run_dir: Path) -> Views:
    """rank -> step -> each loop variable's (kind, digest, shown), the newest line per step."""
    out: Views = {}
    for path in sorted((run_dir / probeplan.FOLDER).glob("steps-rank-*.jsonl")):
        rank = path.name[len("steps-rank-"):-len(".jsonl")]
        if not rank.isdigit():
            continue
        mine = out.setdefault(int(rank), {})
        for rec in fileio.read_jsonl(path):
            if isinstance(rec.get("step"), int) and isinstance(rec.get("view"), dict):
                mine[rec["step"]] = {k: tuple(v) for k, v in rec["view"].items()
                                     if isinstance(v, list) and len(v) == 3}
    return out


def digests(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its rank/probe.py record of the final save."""
    out = {}
    for path in sorted((run_dir / probeplan.FOLDER).glob("rank-*.json")):
        rec = fileio.read_record(path)
        if rec and path.stem[5:].isdigit():
            out[int(path.stem[5:])] = rec
    return out


def final_files(run_dir: Path) -> dict[str, Path]:
    """The files compared: final/model.pt and the newest checkpoint's .pt files."""
    files = {"final/model.pt": run_dir / rundir.FINAL / "model.pt"}
    steps = [p for p in (run_dir / rundir.CHECKPOINTS).glob("step-*") if p.name[5:].isdigit()]
    if steps:
        last = max(steps, key=lambda p: int(p.name[5:]))
        files.update({p.name: p for p in sorted(last.glob("*.pt"))})
    return {k: v for k, v in files.items() if v.is_file()}


def tensor_differences(ref: Path, got: Path) -> dict[str, float]:
    """'FILE: key.path' -> relative max difference, for every tensor or value that differs
    between the two runs' final files (a file or key only one run has counts as differing)."""
    import torch

    out: dict[str, float] = {}
    a_files, b_files = final_files(ref), final_files(got)
    for name in sorted(set(a_files) | set(b_files)):
        if name not in a_files or name not in b_files:
            out[f"{name}: (only in one run)"] = math.inf
            continue
        a = torch.load(a_files[name], map_location="cpu", weights_only=True)
        b = torch.load(b_files[name], map_location="cpu", weights_only=True)
        _compare(a, b, f"{name}: ", out)
    return out


def _compare(a: Any, b: Any, path: str, out: dict[str, float]) -> None:
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out[f"{path}{k}"] = math.inf
            else:
                _compare(a[k], b[k], f"{path}{k}.", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{path}{i}.", out)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            out[path.rstrip(".")] = math.inf
        elif not torch.equal(a, b):
            x, y = a.double(), b.double()
            out[path.rstrip(".")] = float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
    elif a != b:
        out[path.rstrip(".")] = math.inf


def parameter_distance(ref: Path, got: Path) -> tuple[float, str]:
    """The relative L2 distance of the two final models' parameters (every floating tensor of
    final/model.pt as one vector, less BatchNorm's running statistics, which another world size
    updates once per micro-batch), and the tensor that contributes most (the world-size kind)."""
    import torch

    a = torch.load(ref / rundir.FINAL / "model.pt", map_location="cpu", weights_only=True)
    b = torch.load(got / rundir.FINAL / "model.pt", map_location="cpu", weights_only=True)
    diff: dict[str, float] = {}
    norm = 0.0
    for k, x in a.items():
        y = b.get(k)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape:
            return math.inf, k
        if x.is_floating_point() and not k.endswith(BN_STATISTICS):
            diff[k] = float((x.double() - y.double()).pow(2).sum())
            norm += float(x.double().pow(2).sum())
    worst = max(diff, key=lambda k: diff[k], default="")
    return math.sqrt(sum(diff.values()) / max(norm, 1e-24)), worst
