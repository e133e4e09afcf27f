"""Console output: rich on a terminal, plain fixed-width lines in SLURM logs.

Login-node commands print through `table()`/`info()`; on compute nodes only rank 0 prints
(`print0`), so a 4-rank job's log does not repeat every line four times.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

_rank = 0


def set_rank(rank: int) -> None:
    """Called once by the node-side entry point after the ClusterEnv is known."""
    global _rank
    _rank = rank


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)())


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only, flushed (batch logs are files and would buffer otherwise)."""
    if _rank == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


# The first line of a rank's log at each start (rank/start.py); `ddpjob logs` turns it into a
# mark between the attempts of a log that every attempt appends to (launch/control.py).
ATTEMPT_LINE = re.compile(r"ddpjob: attempt (\d+) starts: rank \d+ on \S+, job (\S+)")


def attempt_line(restart: int, rank: int, host: str, job_id: str | None) -> str:
    return f"ddpjob: attempt {restart} starts: rank {rank} on {host}, job {job_id or '-'}"


def info(message: str) -> None:
    print(message, flush=True)


def warn(message: str) -> None:
    print(f"ddpjob: warning: {message}", file=sys.stderr, flush=True)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          stream: TextIO | None = None) -> None:
    """A table: rich box drawing on a terminal, aligned plain text otherwise (logs, pipes, tests)."""
    stream = stream or sys.stdout
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    if is_terminal(stream):
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        t = Table(title=title)
        for col in columns:
            t.add_column(col)
        for row in cells:
            t.add_row(*(Text(c) for c in row))  # Text: no markup, "n[1-2]" stays as written
        Console(file=stream).print(t)
        return
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    if title:
        print(title, file=stream)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(), file=stream)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=stream)
    stream.flush()
