"""`ddpjob submit --sweep KEY=V1,V2`: the grid of a sweep, one SweepPoint per combination.

Pure (no I/O): submit.py makes one run dir per point, SWEEP/<point id>, and hands them to the
backend as one job array on SLURM (the point id is the array index), one after another locally.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from ddpjob import jobfile
from ddpjob.errors import UsageError

MAX_POINTS = 1000  # SLURM's default MaxArraySize is 1001


@dataclass(frozen=True)
class SweepPoint:
    index: int
    values: dict[str, Any]  # "train.lr" -> 0.1 (typed like --set)
    overrides: tuple[str, ...]  # ("train.lr=0.1", ...)

    @property
    def id(self) -> str:  # the point's folder name, = its SLURM array index
        return str(self.index)


def split_values(text: str) -> list[str]:
    """`0.1,0.05` -> ['0.1', '0.05']; commas inside [...] or quotes do not split."""
    items, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
            continue
        cur += ch
    items.append(cur.strip())
    return items


def expand_sweep(specs: list[str]) -> list[SweepPoint]:
    """The cartesian product of `--sweep KEY=V1,V2` axes, first axis varying slowest
    ([] without axes: not a sweep)."""
    if not specs:
        return []
    axes: list[tuple[str, list[tuple[str, Any]]]] = []
    for spec in specs:
        if "=" not in spec:
            raise UsageError(f"--sweep '{spec}' has no '=', expected section.key=v1,v2",
                             "e.g. --sweep train.lr=0.1,0.05")
        key, text = (s.strip() for s in spec.split("=", 1))
        values = split_values(text)
        if not text.strip() or any(v == "" for v in values):
            raise UsageError(f"--sweep '{spec}' has an empty value, expected v1,v2,...",
                             "e.g. --sweep train.lr=0.1,0.05")
        if key in [k for k, _ in axes]:
            raise UsageError(f"--sweep key '{key}' is given twice", "list all its values in one --sweep")
        axes.append((key, [(v, jobfile.parse_override(f"{key}={v}")[1]) for v in values]))
        count = math.prod(len(vals) for _, vals in axes)  # before the product is built, not after
        if count > MAX_POINTS:
            raise UsageError(f"the sweep has {count} points, expected at most {MAX_POINTS}",
                             "split it into several sweeps (SLURM limits job arrays)")
    points = []
    for i, combo in enumerate(itertools.product(*[vals for _, vals in axes])):
        keys = [k for k, _ in axes]
        points.append(SweepPoint(i, {k: typed for k, (_, typed) in zip(keys, combo)},
                                 tuple(f"{k}={raw}" for k, (raw, _) in zip(keys, combo))))
    if len(points) > MAX_POINTS:
        raise UsageError(f"the sweep has {len(points)} points, expected at most {MAX_POINTS}",
                         "split it into several sweeps (SLURM limits job arrays)")
    return points
