"""What `ddpjob verify` concludes from two runs of one job (launch/verify.py runs them): the
reference, run through, and one interrupted.

The facts come from each run dir: the per-step losses (metrics.jsonl), every tensor of the
final model and of the last checkpoint (the `state` files, values.pt, each rank's RNG file), and
each rank's digests (rank/probe.py: every `state` object as that rank holds it, the generators
its code keeps outside `state`). `diagnose` turns them into one line: exact, close (a resume at
another world size), or the first step that differs, what differs and the likely cause. Pure but
for `tensor_differences`, which loads the files (torch, imported there).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpjob import fileio, rundir

# Below this relative difference at the first differing loss, the same data met other
# arithmetic (a reduction order, a kernel); above it, the step saw other data or other draws.
ARITHMETIC_RTOL = 1e-5
# A resume at another world size is "close" when every loss and the final model's parameters (the
# relative L2 distance of all of them as one vector) are within this of the reference's: the
# ranks' dropout streams and the order of the gradient sums change, nothing else may.
CLOSE_RTOL = 0.05
BN_STATISTICS = ("running_mean", "running_var")


@dataclass
class Facts:
    """What differs between the reference and one interrupted run."""

    at: int  # the step at which the run was interrupted
    losses: dict[int, float]  # the reference's
    got: dict[int, float]  # the interrupted run's (each step's newest record)
    state_files: dict[str, float] = field(default_factory=dict)  # "optimizer.pt: state.0.exp_avg" -> rel
    rng_ranks: dict[int, str] = field(default_factory=dict)  # rank -> the first differing stream
    per_rank: list[str] = field(default_factory=list)  # state keys the reference's ranks hold differently
    copied: list[tuple[str, int]] = field(default_factory=list)  # (key, rank): rank holds rank 0's after the resume
    outside: list[str] = field(default_factory=list)  # generators outside `state` that differ


@dataclass(frozen=True)
class Verdict:
    ok: bool
    line: str
    cause: str = ""  # a short class: nondeterministic, per-rank, outside-generator, rng, data, arithmetic, state


def first_loss_difference(ref: dict[int, float], got: dict[int, float]) -> int | None:
    """The first step whose loss differs (or is missing in one run), None if all are equal."""
    for step in sorted(set(ref) | set(got)):
        a, b = ref.get(step), got.get(step)
        if a is None or b is None or not (a == b or (math.isnan(a) and math.isnan(b))):
            return step
    return None


def diagnose(f: Facts) -> Verdict:
    """Exact, or what differs first and its likely cause, in one line."""
    step = first_loss_difference(f.losses, f.got)
    tensors = sorted(f.state_files)
    if step is None and not tensors and not f.rng_ranks:
        return Verdict(True, f"exact ({len(f.losses)} losses, every tensor of the final state equal)")
    what = _what(f, step, tensors)
    if step is not None and step <= f.at:
        return Verdict(False, f"{what}, before the interruption at step {f.at}: the run itself is not "
                       "deterministic (two uninterrupted runs differ): train.deterministic, or data "
                       "drawn from an unseeded source", "nondeterministic")
    if f.copied:
        key, rank = f.copied[0]
        return Verdict(False, f"{what}; rank {rank}'s `{key}` equals rank 0's after the resume: a per-rank "
                       f"object saved through `state` (rank 0's is saved and loaded into every rank)", "per-rank")
    if f.outside:
        return Verdict(False, f"{what}; the generator `{f.outside[0]}` held outside `state` differs: an own "
                       "generator not in `state` starts again from its seed at a resume", "outside-generator")
    if f.rng_ranks:
        rank, stream = next(iter(sorted(f.rng_ranks.items())))
        return Verdict(False, f"{what}; rank {rank}'s RNG file differs ({stream}): the resumed run drew another "
                       "number of random numbers, e.g. random draws before `resume()`", "rng")
    if step is None:
        return Verdict(False, f"{what} while every loss is equal: a `state` object that is saved but not "
                       "restored as it was (its load_state_dict)", "state")
    a, b = f.losses.get(step), f.got.get(step)
    if a is not None and b is not None and abs(a - b) <= ARITHMETIC_RTOL * max(abs(a), 1e-12):
        return Verdict(False, f"{what}; only the arithmetic (relative {abs(a - b) / max(abs(a), 1e-12):.1e}): "
                       "non-deterministic kernels or another reduction order (train.deterministic, "
                       "train.deterministic_reduce)", "arithmetic")
    return Verdict(False, f"{what} while the RNG files are equal: a batch made before `resume()`, or a "
                   "prefetch (a batch drawn before the step ends, held outside `state`)", "data")


def _what(f: Facts, step: int | None, tensors: list[str]) -> str:
    parts = []
    if step is not None:
        a, b = f.losses.get(step), f.got.get(step)
        shown = f" ({a:.6g} vs {b:.6g})" if a is not None and b is not None else " (missing in one run)"
        n = sum(1 for s in f.losses if f.got.get(s) != f.losses[s])
        parts.append(f"losses differ from step {step}{shown}, {n} of {len(f.losses)}")
    if tensors:
        files = sorted({t.split(":")[0] for t in tensors})
        keys = [f"`{n[:-3]}`" for n in files if n.endswith(".pt") and "/" not in n and n != "values.pt"]
        named = (["state keys " + ", ".join(keys)] if keys else []) + \
            [n for n in files if n.endswith(("/model.pt", "values.pt"))]
        parts.append(f"{', '.join(named)} differ (first: {tensors[0]})")
    if f.rng_ranks:
        parts.append("RNG files of rank(s) " + ", ".join(map(str, sorted(f.rng_ranks))) + " differ")
    return "; ".join(parts)


def close(f: Facts, params: tuple[float, str], rtol: float = CLOSE_RTOL) -> Verdict:
    """A resume at another world size: every loss and the final model (`params`: its relative
    L2 distance, the tensor that differs most) within `rtol` of the reference's."""
    worst_loss, worst_step = 0.0, None
    for step, a in sorted(f.losses.items()):
        b = f.got.get(step)
        if b is None:
            return Verdict(False, f"the loss of step {step} is missing after the resume", "data")
        rel = abs(a - b) / max(abs(a), 1e-12)
        if rel > worst_loss:
            worst_loss, worst_step = rel, step
    distance, tensor = params
    line = (f"largest loss difference {worst_loss:.2%} (step {worst_step}), final model {distance:.2%} "
            f"(most in {tensor or '-'}); tolerance {rtol:.0%}")
    if worst_loss <= rtol and distance <= rtol:
        return Verdict(True, f"close: {line}")
    return Verdict(False, f"not close: {line}: the data order or the batch depends on the world size "
                   "(a per-rank batch, a sampler split by rank)", "world-size")


# ------------------------------------------------------------------ reading the run dirs
def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of each step's newest record (a replayed step's record comes later in the
    file; after `ddpjob resume` the `restart` field starts again, so the file order decides)."""
    out: dict[int, float] = {}
    try:
        text = (run_dir / rundir.METRICS).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        loss = rec.get("loss") if isinstance(rec, dict) else None
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and isinstance(rec.get("step"), int):
            out[rec["step"]] = float(loss)
    return out


def digests(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its rank/probe.py record of the final save."""
    out = {}
    for path in sorted((run_dir / "verify").glob("rank-*.json")):
        rec = fileio.read_record(path)
        if rec and path.stem[5:].isdigit():
            out[int(path.stem[5:])] = rec
    return out


def digest_facts(f: Facts, ref: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]]) -> None:
    """Per-rank state in the reference, copied from rank 0 in the run; outside generators."""
    base = ref.get(0, {}).get("state", {})
    for key in sorted(base):
        if any(r.get("state", {}).get(key) != base[key] for r in ref.values()):
            f.per_rank.append(key)
            mine = got.get(0, {}).get("state", {}).get(key)
            f.copied += [(key, rank) for rank, r in sorted(got.items())
                         if rank and r.get("state", {}).get(key) == mine != ref.get(rank, {}).get("state", {}).get(key)]
    for rank, r in sorted(ref.items()):
        theirs = got.get(rank, {}).get("outside", {})
        f.outside += [f"{name} (rank {rank})" for name, d in sorted(r.get("outside", {}).items())
                      if theirs.get(name) != d]


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


def split_files(diffs: dict[str, float], f: Facts) -> None:
    """rank-R.pt differences go to the RNG facts, the rest to the state's."""
    for key, rel in diffs.items():
        name, _, inner = key.partition(": ")
        if name.startswith("rank-") and name[5:-3].isdigit():
            f.rng_ranks.setdefault(int(name[5:-3]), inner.split(".")[0] or "the file")
        else:
            f.state_files[key] = rel


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
