"""What a resume reads its files from: a durable checkpoint, or an in-memory snapshot whose files
are this rank's own or (some of them) received from a peer (peers.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpjob.store.commit import CheckpointInfo, CheckpointStore


@dataclass(frozen=True)
class Source:
    """What a resume loads from: a durable checkpoint, or an in-memory snapshot whose files are
    this rank's own or (some of them) received from a peer."""

    step: int
    manifest: dict[str, Any]
    files: set[str]
    read: Callable[[str], Any]
    name: str  # for the "resumed from" line
    where: str  # for errors

    @staticmethod
    def of(store: CheckpointStore, info: CheckpointInfo) -> Source:
        return Source(info.step, info.manifest, set(info.manifest.get("files", {})),
                      lambda name: store.load(info, name), info.path.name, str(info.path))
