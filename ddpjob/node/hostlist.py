"""SLURM's compact list syntaxes: hostlists (`n[1-2]`, `rack[1-2]-node[01-02]`) and task
counts (`2(x3),1`).

Used by cluster.py to find MASTER_ADDR (the first host of the step) and this node's task count;
pure string functions, checked against the real `scontrol show hostnames` in the tests.
"""

from __future__ import annotations

import itertools
import re

from ddpjob.errors import DDPJobError


def parse_hostlist(s: str) -> list[str]:
    """Expand a SLURM hostlist (`n[1-2]`, `host[1,5-9]`, `rack[1-2]-node[01-02]`, `a1,b[2-3]`).

    Same expansion and order as `scontrol show hostnames`; zero padding follows the width of
    the range's lower bound, as in SLURM (`node[008-010]` -> node008, node009, node010).
    """
    text = s.strip()
    if not text:
        raise DDPJobError("the SLURM hostlist is empty", "expected a form like n[1-2] or n1,n2")
    hosts: list[str] = []
    for item in _split_top_level(text, s):
        hosts.extend(_expand(item, s))
    return hosts


def first_host(s: str) -> str:
    """The first host of a hostlist: where SLURM starts rank 0, so the MASTER_ADDR."""
    return parse_hostlist(s)[0]


def _bad_hostlist(s: str, why: str) -> DDPJobError:
    return DDPJobError(f"cannot parse the SLURM hostlist {s!r}: {why}",
                       "expected forms like n1, n[1-2], host[1,5-9], rack[1-2]-node[01-02], a1,b[2-3]")


def _split_top_level(text: str, orig: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad_hostlist(orig, "nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(orig, "']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise _bad_hostlist(orig, "'[' without ']'")
    items.append(text[start:])
    if any(not it.strip() for it in items):
        raise _bad_hostlist(orig, "empty host name between commas")
    return [it.strip() for it in items]


_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


def _expand(item: str, orig: str) -> list[str]:
    """One comma-free item: literal text and bracket groups, `lit0[g1]lit1[g2]...[gk]litk`."""
    parts = re.split(r"\[([^\]]*)\]", item)  # balanced and unnested: checked by _split_top_level
    literals, groups = parts[0::2], [_range_values(body, orig) for body in parts[1::2]]
    if not groups:
        return [item]
    # scontrol's order (SLURM 22.05, checked against it): the last group varies fastest, then
    # the first, the second, ...: a[1-2]b[1-2]c[1-2] -> a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...
    order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1] if len(groups) > 1 else [0]
    hosts = []
    for combo in itertools.product(*(groups[g] for g in order)):
        chosen = dict(zip(order, combo))
        hosts.append(literals[0] + "".join(chosen[g] + literals[g + 1] for g in range(len(groups))))
    return hosts


def _range_values(body: str, orig: str) -> list[str]:
    """`1,5-9` -> 1 5 6 7 8 9; zero padding follows the lower bound's width (`08-11`)."""
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise _bad_hostlist(orig, f"{part!r} is not a number or a range lo-hi")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if lo > hi:
            raise _bad_hostlist(orig, f"range {part!r} goes backwards")
        values.extend(str(n).zfill(len(lo_text)) for n in range(lo, hi + 1))
    return values


def parse_tasks_per_node(s: str) -> list[int]:
    """SLURM_TASKS_PER_NODE `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in s.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise DDPJobError(f"SLURM_TASKS_PER_NODE={s!r} is not of the form 2(x3),1",
                              "this variable is set by SLURM; do not export it yourself")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
