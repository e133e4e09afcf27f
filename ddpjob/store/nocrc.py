"""torch.save without the zip's CRC32, for the checkpoint store's own files only.

Why: torch.save computes a CRC32 of every zip record; that costs as much CPU as our sha256 (25 ms
per 45 MB on the benchmark VM, on the rank's one core) and protects nothing here: torch.load never
checks it (a flipped data byte loads without a word) while the manifest's sha256, verified before
any load, covers every byte. The files keep torch.save's records and layout with CRC fields 0:
torch.load (weights_only too) reads them, `unzip -t` complains.

How: torch's public switch, torch.serialization.set_crc32_options. It is process-wide, so it is
off only while one of our saves needs it and the caller's value comes back afterwards: a user's
own torch.save, before or after ours, keeps its CRC. torch reads the switch when torch.save opens
its zip writer and its first write comes once the object is pickled (a state dict: milliseconds),
so the switch comes back at that first write, and at the latest when the save ends or fails
(tests/unit/test_checkpoint.py checks that every record still has CRC 0: a torch that read the switch
later would fail it, not break a checkpoint); a user's torch.save in another thread that opens its writer inside that window would go without
CRC (still loadable). Saves of ours that overlap (threads) share one window: a count, not each its
own get/set pair, or the last to finish could put back the first one's False. An older torch
without the switch (setup.cfg allows 2.1) gets plain torch.save.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Callable

import torch

# None on an older torch without the switch.
_get: Callable[[], bool] | None = getattr(torch.serialization, "get_crc32_options", None)
_set: Callable[[bool], None] | None = getattr(torch.serialization, "set_crc32_options", None)

_lock = threading.Lock()
_saves = 0  # our saves inside their window now
_before = True  # the caller's value, put back when the last of them leaves


def save(obj: Any, f: Any) -> None:
    """torch.save(obj, f), f a file object, without the zip's CRC32 records (see the module)."""
    if _get is None or _set is None:
        torch.save(obj, f)
        return
    with _Crc32Off() as off:
        torch.save(obj, _FirstWrite(f, off.restore))  # type: ignore[arg-type]  # write + flush suffice


class _Crc32Off:
    """Turns torch.save's CRC32 off from __enter__ until restore() or __exit__, whichever first."""

    def __init__(self) -> None:
        self._on = False

    def __enter__(self) -> _Crc32Off:
        global _saves, _before
        with _lock:
            if _saves == 0:
                assert _get is not None and _set is not None
                _before = _get()
                _set(False)
            _saves += 1
            self._on = True
        return self

    def restore(self) -> None:
        global _saves
        with _lock:
            if not self._on:
                return
            self._on = False
            _saves -= 1
            if _saves == 0:
                assert _set is not None
                _set(_before)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.restore()


class _FirstWrite:
    """File wrapper that calls `first` before the first byte goes out (torch has read the switch
    by then: its zip writer is open). torch.save needs write and flush only."""

    def __init__(self, f: Any, first: Callable[[], None]) -> None:
        self._f = f
        self._first: Callable[[], None] | None = first

    def write(self, data: Any) -> int:
        if self._first is not None:
            first, self._first = self._first, None
            first()
        n: int = self._f.write(data)
        return n

    def flush(self) -> None:
        self._f.flush()
