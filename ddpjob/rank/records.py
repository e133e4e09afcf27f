"""What a rank writes about its training besides checkpoints: rank 0's metric records
(RUN_DIR/metrics.jsonl, read by `ddpjob plot` and `status`, TensorBoard with
train.tensorboard, node_exporter's textfile with train.metrics_textfile, the experiment trackers
of train.trackers) and each rank's sample log (RUN_DIR/samples/rank-R.jsonl). The Job
(job.py) decides when; these only append whole lines, so a kill tears at most the last one.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO, Any, Callable

from ddpjob import console, fileio, rundir
from ddpjob.errors import DDPJobError
from ddpjob.openmetrics import Textfile
from ddpjob.rank.trackers import Trackers


def kind_of(names: list[str]) -> str:
    """A record's kind: "eval" when every name starts with eval_ (or is epoch), else "train"."""
    return "eval" if names and all(k.startswith("eval_") or k == "epoch" for k in names) else "train"


class MetricLog:
    """Rank 0's metrics.jsonl records, mirrored to TensorBoard once `open_tensorboard()` ran and
    summed up in the textfile (`textfile`: train.metrics_textfile, relative to the run dir)."""

    def __init__(self, run_dir: Path, restart: int, *, job_id: str = "", textfile: str = "",
                 trackers: Trackers | None = None) -> None:
        self._run_dir, self._restart, self._trackers = run_dir, restart, trackers
        self._tb: Any = None  # node/metrics.TensorBoard
        self._kinds: tuple[int, set[str]] = (-1, set())  # the kinds written at the latest step
        self._said_twice = False
        self._textfile = Textfile(str(run_dir / textfile), run_dir, job_id=job_id, restart=restart) \
            if textfile else None
        if self._textfile is not None:
            self._textfile.write()  # a missing folder or package stops the start, with its line

    def open_tensorboard(self, resumed_step: int) -> None:
        """From the resumed step on: TensorBoard drops what a resume replays (once per process)."""
        if self._tb is None:
            from ddpjob.node.metrics import TensorBoard

            self._tb = TensorBoard(self._run_dir / "tb", resumed_step=resumed_step)

    def write(self, step: int, record: dict[str, Any]) -> None:
        """One record of plain values: names starting with eval_ (and epoch) make an eval record."""
        # JSON has no NaN/inf: keep the line parseable, as "nan"/"inf" strings
        line = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        kind = kind_of(list(line))
        self._check_once_per_step(int(step), kind, list(line))
        fileio.append_jsonl(self._run_dir / rundir.METRICS,
                            {"kind": kind, "time": time.time(), "step": int(step),
                             "restart": self._restart, **line})
        if self._tb is not None:
            self._tb.add(int(step), kind, record)
        if kind == "train":
            self._to_textfile(lambda t: t.logged(int(step), record))
        if self._trackers is not None:
            self._trackers.log(int(step), kind, record)

    def _check_once_per_step(self, step: int, kind: str, names: list[str]) -> None:
        """A second record of one kind for one step: `plot` and `status` expect one per step and
        a reader keeping one loses the other's values. Said once, at the first."""
        at, kinds = self._kinds
        if at != step:
            self._kinds = (step, {kind})
            return
        if kind in kinds and not self._said_twice:
            self._said_twice = True
            console.warn(f"job.log({step}, {', '.join(n + '=...' for n in names)}) writes a second {kind} "
                         f"record for step {step}: `ddpjob plot` and `status` expect one {kind} record per step. "
                         "Hint: log a step's values in one call, job.log(step, loss=..., lr=...); "
                         "name evaluation values eval_* (an eval record)")
        kinds.add(kind)

    def saved(self, step: int) -> None:
        """After a checkpoint of `step`: what a resume from it keeps is on disk."""
        if self._tb is not None:
            self._tb.flush()
        self._to_textfile(lambda t: t.checkpointed(step))

    def _to_textfile(self, update: Callable[[Textfile], None]) -> None:
        if self._textfile is None:
            return
        try:
            update(self._textfile)
        except DDPJobError as exc:  # a full disk or a folder gone mid-run: said once, training goes on
            console.warn(f"train.metrics_textfile is not updated any more in this attempt: {exc.message}")
            self._textfile = None

    def close(self, end: str = "finished") -> None:
        """`end`: how the attempt ended (trackers.ENDS)."""
        if self._tb is not None:
            self._tb.close()
        if self._trackers is not None:
            self._trackers.close(end)
        self._to_textfile(Textfile.write)  # the newest values stay (node_textfile_mtime_seconds says how old)


class SampleLog:
    """This rank's global sample ids per optimizer step, for exactly-once-per-epoch checks
    across requeues. Steps replayed after a kill are appended again: readers keep the newest
    restart's. The file opens at the first write."""

    def __init__(self, run_dir: Path, *, rank: int, restart: int, world_size: int) -> None:
        self._folder = run_dir / "samples"
        self._rank, self._restart, self._world_size = rank, restart, world_size
        self._file: IO[str] | None = None

    def write(self, step: int, epoch: int, ids: Any) -> None:
        if self._file is None:
            self._folder.mkdir(exist_ok=True)
            self._file = open(self._folder / f"rank-{self._rank}.jsonl", "a", encoding="utf-8", buffering=1)
        record = {"step": int(step), "epoch": int(epoch), "rank": self._rank, "restart": self._restart,
                  "world_size": self._world_size, "ids": [int(i) for i in ids]}
        self._file.write(json.dumps(record) + "\n")  # whole lines: a kill tears at most one

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
