"""Runs as Prometheus series, the one owner of their names (docs/openmetrics.md): the login side's
`status/ls --format openmetrics` (from report.py's JSON records: the values `--json` prints) and
rank 0's node_exporter textfile ([train] metrics_textfile, from what the rank knows itself).
prometheus-client writes them (an optional extra); no torch, shared by both sides.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from ddpjob import fileio
from ddpjob.errors import DDPJobError

PIP_HINT = "pip install 'ddpjob[openmetrics]' (or pip install prometheus-client)"
# Prometheus scrapes every 15 s to 1 min: a textfile rewritten more often is never read.
TEXTFILE_EVERY_S = 10.0


def client(what: str) -> Any:
    """prometheus_client, or the one line that says how to get it."""
    try:
        import prometheus_client
    except ImportError:
        raise DDPJobError(f"{what} needs the prometheus-client package, which is not installed",
                          PIP_HINT) from None
    return prometheus_client


def _finite(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


class _Series:
    """Families by name, each with one sample per run (label `run`, plus `category` for the
    seconds); a value that is unknown (None, NaN) leaves its sample out rather than lying."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._families: dict[str, Any] = {}

    def _family(self, kind: str, name: str, doc: str, labels: list[str]) -> Any:
        if name not in self._families:
            self._families[name] = getattr(self._core, kind)(name, doc, labels=labels)
        return self._families[name]

    def gauge(self, name: str, doc: str, run: str, value: Any, **labels: str) -> None:
        if (v := _finite(value)) is not None:
            self._family("GaugeMetricFamily", name, doc, ["run", *labels]).add_metric([run, *labels.values()], v)

    def counter(self, name: str, doc: str, run: str, value: Any) -> None:
        if (v := _finite(value)) is not None:  # the family adds `_total` to the sample's name
            self._family("CounterMetricFamily", name, doc, ["run"]).add_metric([run], v)

    def info(self, run: str, labels: Mapping[str, Any]) -> None:
        self._family("InfoMetricFamily", "ddpjob_run", "facts about the run as labels (value 1; join on run)",
                     ["run"]).add_metric([run], {k: "" if v is None else str(v) for k, v in labels.items()})

    def collect(self) -> Iterator[Any]:
        return iter(self._families.values())


def _run_series(s: _Series, run: str, step: Any, loss: Any, restarts: Any, checkpoint_step: Any) -> None:
    """The series both sides write, with the same meaning."""
    s.gauge("ddpjob_run_step", "the newest logged training step", run, step)
    s.gauge("ddpjob_run_loss", "the loss logged at that step", run, loss)
    s.counter("ddpjob_run_restarts", "restarts of the run so far (requeues, restarts in place, successor jobs)",
              run, restarts)
    s.gauge("ddpjob_run_checkpoint_step", "the step of the newest checkpoint a resume would use", run,
            checkpoint_step)


def of_records(records: list[dict[str, Any]]) -> Any:
    """`status/ls --format openmetrics`: report.record()'s objects (docs/status-json.md) as series."""
    core = client("--format openmetrics").metrics_core
    s = _Series(core)
    for r in records:
        run = os.path.abspath(r["run_dir"])  # the label rank 0's textfile gives it too
        s.info(run, {"job_id": r["job_id"], "backend": r["backend"], "state": r["state"], "point": r["point"]})
        s.gauge("ddpjob_run_completed", "1 once the training finished (RUN_DIR/COMPLETED), else 0", run,
                int(r["completed"]))
        _run_series(s, run, r["step"], r["loss"], r["restarts"], (r["checkpoint"] or {}).get("step"))
        slow = r.get("slowdowns") or []
        s.counter("ddpjob_run_slowdowns", "times the job ran slower than its own baseline (rank/slowdown.py)",
                  run, len(slow))
        # 1 while the job runs at its own speed; the newest slowdown's ratio while it lasts
        s.gauge("ddpjob_run_speed_ratio", "the job's speed against its own baseline (1: as fast; 0.62: 0.62x)",
                run, slow[-1]["ratio"] if slow and slow[-1].get("until_step") is None
                else 1.0 if r.get("baseline_step_ms") is not None else None)  # no baseline yet: no sample
        s.gauge("ddpjob_run_baseline_step_seconds", "the run's own step time (median after the warm-up)", run,
                r["baseline_step_ms"] / 1000 if r.get("baseline_step_ms") is not None else None)
        g = r["goodput"]
        if g is None:  # nothing started yet: no ledger
            continue
        s.gauge("ddpjob_run_wall_seconds", "wall time from the first submission to the end or now, idle excluded",
                run, g["wall_s"])
        for category, seconds in g["seconds"].items():
            s.gauge("ddpjob_run_seconds", "the wall time by category (they add up to ddpjob_run_wall_seconds)",
                    run, seconds, category=category)
        s.gauge("ddpjob_run_goodput_ratio", "productive seconds / wall seconds, 0 to 1", run, g["goodput"])
        s.gauge("ddpjob_run_idle_seconds", "seconds with no job queued or running (before a person's resume)",
                run, g["idle_s"])
        s.counter("ddpjob_run_attempts", "starts of the ranks over the run", run, len(g["attempts"]))
        s.counter("ddpjob_run_replayed_steps", "steps run more than once (the work crashes lost)", run,
                  g["replayed_steps"])
        s.gauge("ddpjob_run_start_time_seconds", "the first submission, seconds since the epoch", run, g["begin"])
    registry = client("--format openmetrics").CollectorRegistry(auto_describe=False)
    registry.register(s)
    return registry


def exposition(registry: Any) -> str:
    """The OpenMetrics text (ends with `# EOF`)."""
    from prometheus_client.openmetrics import exposition as om

    return str(om.generate_latest(registry).decode())


class Textfile:
    """Rank 0's series for node_exporter's textfile collector ([train] metrics_textfile):
    rewritten whole, atomically, at each checkpoint and end, and with a job.log() record when
    TEXTFILE_EVERY_S passed since the last write (never per step). The file is 0644: the collector
    often runs as another user; nobody else may write it (fileio.UserOutput: a temp file beside
    it, renamed over it)."""

    def __init__(self, path: str, run_dir: Path, *, job_id: str, restart: int) -> None:
        self._core = client("train.metrics_textfile")
        self._path, self._run, self._job_id, self._restart = path, os.path.abspath(run_dir), job_id, restart
        self._step: int | None = None
        self._loss: float | None = None
        self._checkpoint: tuple[int, float] | None = None
        self._first: tuple[int, float] | None = None  # this attempt's first record: its speed
        self._began = time.time()
        self._written = -math.inf

    def logged(self, step: int, record: Mapping[str, Any]) -> None:
        self._step, self._loss = step, _finite(record.get("loss"))
        if self._first is None:
            self._first = (step, time.monotonic())
        if time.monotonic() - self._written >= TEXTFILE_EVERY_S:
            self.write()

    def checkpointed(self, step: int) -> None:
        self._checkpoint = (step, time.time())
        self._step = step if self._step is None else max(self._step, step)
        self.write()

    def write(self) -> None:
        s = _Series(self._core.metrics_core)
        run = self._run
        s.info(run, {"job_id": self._job_id})
        _run_series(s, run, self._step, self._loss, self._restart, self._checkpoint and self._checkpoint[0])
        s.gauge("ddpjob_run_checkpoint_time_seconds", "when that checkpoint was written, seconds since the epoch",
                run, self._checkpoint and self._checkpoint[1])
        s.gauge("ddpjob_run_attempt_start_time_seconds", "this attempt's start on rank 0, seconds since the epoch",
                run, self._began)
        if self._first is not None and self._step is not None and self._step > self._first[0]:
            s.gauge("ddpjob_run_steps_per_second", "optimizer steps per second of this attempt", run,
                    (self._step - self._first[0]) / max(time.monotonic() - self._first[1], 1e-9))
        registry = self._core.CollectorRegistry(auto_describe=False)
        registry.register(s)
        # the Prometheus text format (0.0.4): what node_exporter's textfile collector parses
        fileio.UserOutput(self._path, flag="train.metrics_textfile").write(self._core.generate_latest(registry))
        self._written = time.monotonic()
