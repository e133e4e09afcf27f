"""The run directory: one folder per submission, the only thing the compute nodes read.

Written on the login node (config.json, job.json, the submitted script) and appended to by the
ranks (events.jsonl, metrics.jsonl, checkpoints/). Layout in docs/design.md. Small JSON records
are written atomically (temp file + rename) so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from ddpjob.errors import DDPJobError

CONFIG = "config.json"
JOB = "job.json"
EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
COMPLETED = "COMPLETED"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
FINAL = "final"


def new_run_dir(runs_root: str | Path, name: str) -> Path:
    """runs/<name>-<UTC time>-<random>: unique without coordination, sorts by time."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(runs_root) / f"{name}-{stamp}-{secrets.token_hex(2)}"


def write_json_atomic(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: str | Path, text: str, mode: int = 0o644) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_json(path: str | Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One O_APPEND write per record: lines from several ranks/restarts never interleave."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records; a torn last line (killed writer) is ignored."""
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def record_event(run_dir: str | Path, event: str, **fields: Any) -> None:
    """A (re)start or stop, with its reason: what `status`, `plot` and the tests read."""
    append_jsonl(Path(run_dir) / EVENTS, {"time": time.time(), "event": event, **fields})


def events(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / EVENTS)


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def require_run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not is_run_dir(p):
        raise DDPJobError(f"'{path}' is not a ddpjob run directory (no {CONFIG})",
                          "pass a folder made by `ddpjob submit`; `ddpjob ls` lists them")
    return p


def completed(run_dir: str | Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / COMPLETED)


def mark_completed(run_dir: str | Path, **info: Any) -> None:
    write_json_atomic(Path(run_dir) / COMPLETED, {"time": time.time(), **info})
