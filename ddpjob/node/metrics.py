"""Step timing, progress and TensorBoard: data time vs compute time, images/s, the progress
line, rank 0's event files.

trainer.py wraps its batch iterator in `Meter.timed()` and, at each logging step, turns the
window into one `job.log()` record (RUN_DIR/metrics.jsonl, rank/records.py) and one progress update: a
rich bar on a terminal, fixed-width lines in batch logs (console.is_terminal).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ddpjob import console
from ddpjob.errors import DDPJobError

T = TypeVar("T")


class Meter:
    """Wall time per optimizer step, split into waiting for data and everything else.

    Host-side clocks only: nothing here synchronises the device. On a GPU the split is only
    meaningful over a logging window (the `.item()` at the logging step waits for the queue),
    which is why records report window averages, not single steps.
    """

    def __init__(self, images_per_step: int) -> None:
        self.images_per_step = images_per_step
        self._start = time.perf_counter()
        self._data = 0.0
        self._steps = 0
        self.last_step_s = 0.0  # for the deadline watch
        self._step_start = self._start

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield from `batches`, timing each fetch (data) and each fetch-to-fetch interval (step)."""
        return timed_fetches(batches, self._fetched)

    def _fetched(self, started: float, seconds: float) -> None:
        self._data += seconds
        self._step_start = started

    def step_done(self) -> None:
        now = time.perf_counter()
        self.last_step_s = now - self._step_start
        self._steps += 1

    def pause(self) -> None:
        """Exclude eval/checkpoint time from the next window (call after them)."""
        self._start = time.perf_counter()
        self._data = 0.0
        self._steps = 0

    def window(self) -> dict[str, float]:
        """Averages since the last window; resets it."""
        now = time.perf_counter()
        n = max(self._steps, 1)
        wall = max(now - self._start, 1e-9)
        out = {"img_s": round(self._steps * self.images_per_step / wall, 1),
               "data_ms": round(1000 * self._data / n, 3),
               "step_ms": round(1000 * wall / n, 3)}
        self._start, self._data, self._steps = now, 0.0, 0
        return out


class Progress:
    """Rank 0's view: a rich progress bar on a terminal, else one fixed-width line per log step."""

    def __init__(self, total: int, start: int, *, enabled: bool, terminal: bool | None = None) -> None:
        self.total, self.enabled = total, enabled
        self.terminal = console.is_terminal() if terminal is None else terminal
        self._bar: Any = None
        if enabled and self.terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeRemainingColumn

            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, epoch: int, loss: float, lr: float, timing: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            info = f"loss {loss:.4f} lr {lr:.4g} {timing['img_s']:.0f} img/s"
            self._bar.update(self._task, completed=step, info=info)
            return
        width = len(str(self.total))
        console.print0(f"step {step:>{width}}/{self.total} ep {epoch:>3} loss {loss:8.4f} "
                       f"lr {lr:9.3e} img/s {timing['img_s']:9.1f} data {timing['data_ms']:8.2f}ms "
                       f"step {timing['step_ms']:8.2f}ms")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            console.print0(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class TensorBoard:
    """Rank 0's TensorBoard event files ([train] tensorboard), in RUN_DIR/tb/ for the whole run.

    Every attempt adds its own event file to that one folder, and its first event purges what
    the previous attempt logged past the checkpoint this one resumed from (SummaryWriter's
    purge_step: a SessionLog START at that step), so TensorBoard shows one increasing series
    with no step twice. Flushed at every checkpoint: what a resume keeps is on disk by then."""

    def __init__(self, folder: Path, resumed_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise DDPJobError("train.tensorboard = true, but the tensorboard package is not "
                              "installed on the nodes, expected it importable",
                              "pip install 'ddpjob[tensorboard]' (or tensorboard) in the job's "
                              "environment, or set train.tensorboard = false") from None
        # Logged steps are 1-based (the step just done): after resuming at step S, S+1 onwards
        # of the earlier attempt are the ones this attempt replays.
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=resumed_step + 1)

    def add(self, step: int, kind: str, record: dict[str, Any]) -> None:
        for name, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{kind}/{name}", value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def timed_fetches(batches: Iterable[T], fetched: Callable[[float, float], None]) -> Iterator[T]:
    """Yield from `batches`, telling `fetched(start, seconds)` how long each item took to come
    (the meter's data time; Job.timed's data wait for the straggler watch)."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        fetched(t0, time.perf_counter() - t0)
        yield item
