"""How many in-memory snapshots fit a node (store/memsnap.py takes them, `ddpjob doctor` checks
the same arithmetic before the job is submitted, launch/restartchecks.py): each rank keeps KEEP
snapshots plus the one being written, and the node's ranks' need() must fit the snapshot
folder's free room and stay under the job's memory cgroup (tmpfs pages count against it). A
shortfall keeps 1, or none (keep_for()), never an OOM kill or a failed write mid-run. Torch-free
and pure but for the reads of the file system and the cgroup files."""

from __future__ import annotations

import shutil
from pathlib import Path

KEEP = 2  # the newest is being written while the one before stays whole
CGROUP = Path("/sys/fs/cgroup")
MEM_MARGIN = 0.05  # of a memory limit kept free for what a snapshot does not account for
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def need(state: int, ranks: int, keep: int = KEEP) -> int:
    """Bytes the snapshots of `ranks` ranks on one node hold at most: each rank's `keep` kept ones
    plus the one being written (pruning follows the commit)."""
    return ranks * (keep + 1) * state if keep > 0 else 0


def size_text(n: int) -> str:
    """Bytes for a line: MiB, or KiB below one MiB (a small model's snapshot)."""
    return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def keep_for(state: int, ranks: int, room: int | None, mem_left: int | None) -> int:
    """How many snapshots each rank keeps: KEEP, else 1, else 0 (none) - the most whose need()
    fits both the folder's free `room` and the memory cgroup's `mem_left` (None: no limit)."""
    for keep in range(KEEP, 0, -1):
        if all(limit is None or need(state, ranks, keep) <= limit for limit in (room, mem_left)):
            return keep
    return 0


def memory_left(proc_cgroup: str, root: Path = CGROUP) -> int | None:
    """What this process's memory cgroup lets it still use: the least of limit - usage - margin
    over its cgroup and every parent that has a limit (v2 memory.max / memory.current, v1
    memory.limit_in_bytes / memory.usage_in_bytes); None without a limit. `proc_cgroup`: the text
    of /proc/self/cgroup."""
    found: list[int] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            here, files = root / parts[2].lstrip("/"), ("memory.max", "memory.current")
        elif "memory" in parts[1].split(","):
            here, files = root / "memory" / parts[2].lstrip("/"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for folder in [here, *here.parents]:
            if folder != root and root not in folder.parents:
                break
            try:
                limit_text = (folder / files[0]).read_text().strip()
                used = int((folder / files[1]).read_text().strip())
            except (OSError, ValueError):
                continue
            if limit_text.isdigit() and int(limit_text) < UNLIMITED:
                limit = int(limit_text)
                found.append(limit - used - int(limit * MEM_MARGIN))
    return max(0, min(found)) if found else None


def free(base: Path) -> int | None:
    """Free bytes on the file system of `base` (its nearest existing parent: the folder is made at
    the first snapshot); None when it cannot be asked."""
    probe = base
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def bytes_under(folder: Path) -> int:
    try:
        return sum(f.lstat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
    except OSError:  # a prune removing files meanwhile
        return 0
