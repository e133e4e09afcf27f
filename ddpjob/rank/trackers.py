"""Rank 0's experiment trackers ([train] trackers: Weights & Biases, MLflow), one tracker run for
the whole ddpjob run across requeues, restarts in place and `ddpjob resume`. MetricLog
(records.py) hands each job.log() record here after metrics.jsonl (docs/trackers.md).

The tracker run's id is kept in RUN_DIR/trackers/NAME.json, written before its first record, so
every attempt continues that run. What a tracker holds for sure is its high-water mark per record
kind (RUN_DIR/trackers/NAME.sent): after each send for a tracker that stores as it is called
(MLflow), at a clean end for one that buffers in another process (W&B: an attempt killed with
SIGKILL leaves nothing of its own). Each start first catches the tracker up from metrics.jsonl
(the records after the mark: what a killed attempt lost), then sends only steps newer than
those: the steps a resume replays have the values already sent (bit-exact resume), so no step
reaches a tracker twice or goes back.

Each start and each clean close also hands every tracker the goodput summary of the history
recorded so far (ledger/goodput.py from events.jsonl and metrics.jsonl, without the scheduler's
record: the ranks have no sacct), so the tracker run ends with the whole run's.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

from ddpjob import console, fileio, rundir
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.ledger import events, goodput, metricslines

FOLDER = "trackers"
KINDS = ("train", "eval")  # MetricLog's record kinds: an eval may share its step with a train record
ENDS = ("finished", "stopped", "failed")  # how an attempt ends: done, stopped for a requeue, crashed
NOT_VALUES = tuple(sorted(metricslines.OWN_KEYS))  # metrics.jsonl's own keys


# The goodput categories a tracker gets: the queue wait needs sacct (`ddpjob status` has it).
SUMMED = tuple(c for c in goodput.CATEGORIES if c != "queue")


def summary(ledger: goodput.Ledger) -> dict[str, float]:
    """The goodput figures a tracker keeps, named after docs/openmetrics.md's series (the unit in
    the name): goodput_ratio (ddpjob_run_goodput_ratio), goodput/wall_seconds,
    goodput/<category>_seconds (ddpjob_run_seconds{category}), goodput/replayed_steps."""
    seconds = {f"goodput/{c.replace(' ', '_').replace('-', '_')}_seconds": round(ledger.seconds[c], 3) for c in SUMMED}
    return {"goodput_ratio": round(ledger.goodput, 4), "goodput/wall_seconds": round(ledger.wall_s, 3), **seconds,
            "goodput/replayed_steps": float(ledger.replayed_steps)}


def values(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's finite numbers (metrics.jsonl keeps NaN as a string: both paths send the same)."""
    return {k: float(v) for k, v in record.items() if k not in NOT_VALUES and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class Mark:
    """The newest step per record kind a tracker holds for sure, in a fixed-width file rewritten in
    place (one pwrite: no rename, no fsync)."""

    def __init__(self, path: Path) -> None:
        try:
            self.held = {k: int(v) for k, v in zip(KINDS, path.read_text().split(), strict=True)}
        except (OSError, ValueError):  # none yet (a torn one cannot be: 42 bytes, one write)
            self.held = dict.fromkeys(KINDS, 0)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def hold(self, sent: Mapping[str, int]) -> None:
        self.held = {k: max(self.held[k], sent[k]) for k in KINDS}
        os.pwrite(self._fd, " ".join(f"{self.held[k]:>20}" for k in KINDS).encode() + b"\n", 0)

    def close(self) -> None:
        os.close(self._fd)


def _package(name: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DDPJobError(f"train.trackers has \"{name}\", but the {name} package is not installed in the "
                          "job's environment", f"pip install 'ddpjob[{name}]' (or remove \"{name}\" from "
                          "train.trackers)") from None


def _flat(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in cfg.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class _Wandb:
    """W&B: the run id is ours (wandb.init(id=..., resume="allow")); offline (WANDB_MODE=offline)
    each attempt writes its own folder under RUN_DIR/wandb/, which `wandb sync` joins into the run.
    Its records reach disk through wandb's own service process: held for sure after finish()."""

    stores_on_send = False

    def __init__(self, state: dict[str, Any], save: Any, cfg: JobConfig, run_dir: Path) -> None:
        wandb = _package("wandb", "wandb")
        if "id" not in state:
            state["id"] = secrets.token_hex(8)
            save(state)
        # console off: the ranks' output is in RUN_DIR/logs/ already, and stays as it is
        self._run = wandb.init(id=state["id"], resume="allow", project=cfg.train.tracker_project or cfg.name,
                               name=cfg.name, dir=str(run_dir), settings=wandb.Settings(console="off"))
        self._run.config.update(cfg.to_dict(), allow_val_change=True)  # Free keys may change at a resume

    def send(self, step: int, values: dict[str, float], when: float) -> None:
        self._run.log(values, step=step)  # W&B stamps its own _timestamp

    def note(self, info: dict[str, Any]) -> None:
        self._run.summary.update({f"ddpjob/{k}": v for k, v in info.items()})

    def summarize(self, figures: dict[str, float], step: int) -> None:
        self._run.summary.update({f"ddpjob/{k}": v for k, v in figures.items()})  # the run's, not a step's

    def close(self, end: str) -> None:
        if end == "stopped":
            self._run.mark_preempting()  # W&B's own word for a run that comes back
        self._run.finish(exit_code=1 if end == "failed" else 0)


class _Mlflow:
    """MLflow: the run is created once (MlflowClient.create_run), its id kept; later attempts set
    it RUNNING again. The job's config goes in as params once (MLflow refuses changed params).
    log_batch returns once the store has the values."""

    stores_on_send = True

    def __init__(self, state: dict[str, Any], save: Any, cfg: JobConfig, run_dir: Path) -> None:
        _package("mlflow", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=cfg.train.mlflow_uri or None)
        c = self._client
        if "run_id" in state:
            c.update_run(state["run_id"], status="RUNNING")
        else:
            name = cfg.train.tracker_project or cfg.name
            exp = c.get_experiment_by_name(name)
            run = c.create_run(exp.experiment_id if exp else c.create_experiment(name), run_name=cfg.name,
                               tags={"ddpjob.run_dir": str(run_dir.absolute())})
            state["run_id"] = run.info.run_id
            save(state)
            params = [Param(k, v[:6000]) for k, v in _flat(cfg.to_dict()).items()]
            for i in range(0, len(params), 100):  # MLflow's limit per batch
                c.log_batch(state["run_id"], params=params[i:i + 100])
        self._run_id = state["run_id"]

    def send(self, step: int, values: dict[str, float], when: float) -> None:
        from mlflow.entities import Metric

        ms = int(when * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def note(self, info: dict[str, Any]) -> None:
        for k, v in info.items():
            self._client.set_tag(self._run_id, f"ddpjob.{k}", str(v))

    def summarize(self, figures: dict[str, float], step: int) -> None:
        """As metrics: a param may not change and a tag is a string, which no chart or run
        comparison sorts by. Logged at the newest training step so far, so the runs table and
        compare view show the newest summary (MLflow's latest value is the highest step's, then
        the newest), and each metric's history charts the goodput along the training."""
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(f"ddpjob.{k.replace('/', '.')}", v, ms, step)
                                                      for k, v in figures.items()])

    def close(self, end: str) -> None:
        self._client.set_terminated(self._run_id, {"finished": "FINISHED", "stopped": "KILLED",
                                                   "failed": "FAILED"}[end])


KINDS_OF: dict[str, Any] = {"wandb": _Wandb, "mlflow": _Mlflow}  # validate.TRACKERS


class Trackers:
    """The trackers of train.trackers, opened at the start of an attempt (a missing package or a
    tracker that refuses the run stops the start, with its line), caught up from metrics.jsonl
    and given the goodput summary of the attempts before. A tracker that fails later is said
    once and dropped: the training goes on."""

    def __init__(self, cfg: JobConfig, run_dir: Path, *, job_id: str, attempt: int) -> None:
        """`attempt`: this attempt's number in the run (ledger/attempts.py: one numbering across
        requeues, restarts in place and `ddpjob resume`), so the tracker sees attempt + 1 of them."""
        folder = run_dir / FOLDER
        folder.mkdir(mode=0o700, exist_ok=True)
        self._run_dir = run_dir
        self._summed = True  # the goodput summary is sent (False once its records failed it)
        attempts = attempt + 1
        self._open: dict[str, tuple[Any, Mark, dict[str, int]]] = {}  # tracker, mark, newest sent
        for name in cfg.train.trackers:
            path = folder / f"{name}.json"
            state = fileio.read_json(path, {}) or {}
            try:
                tracker = KINDS_OF[name](state, lambda s, p=path: fileio.write_json_atomic(p, s), cfg, run_dir)
                tracker.note({"job_id": job_id, "attempts": attempts})
            except DDPJobError:
                raise
            except Exception as exc:  # the tracker's own (a refused URI, an unreachable server)
                raise DDPJobError(f"train.trackers: {name} did not open its run ({type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())[:300]})", f"fix {name}'s settings, or remove "
                                  f"\"{name}\" from train.trackers") from None
            mark = Mark(folder / f"{name}.sent")
            self._open[name] = (tracker, mark, dict(mark.held))
        if self._open:
            self._summarize(self._catch_up(run_dir))

    def _catch_up(self, run_dir: Path) -> list[dict[str, Any]] | None:
        """The records after each tracker's mark, the newest of each step and kind, in step order;
        returns metrics.jsonl's records (None: unreadable, said)."""
        try:
            records = fileio.read_jsonl(run_dir / rundir.METRICS)
        except (ValueError, OSError) as exc:
            console.warn(f"train.trackers: metrics.jsonl unreadable ({exc}); the trackers are not caught up "
                         "and get no goodput summary")
            self._summed = False
            return None
        newest = {(r["step"], KINDS.index(r["kind"])): r for r in records
                  if r.get("kind") in KINDS and isinstance(r.get("step"), int)}
        for (step, kind), record in sorted(newest.items()):
            self.log(step, KINDS[kind], record)
        return records

    def _summarize(self, metrics: list[dict[str, Any]] | None) -> None:
        """Each tracker's goodput summary of the history recorded so far (`metrics`: metrics.jsonl's
        records, None: read them). At a start and a clean close only: nothing per step."""
        if not self._open or not self._summed:
            return
        try:
            if metrics is None:
                metrics = fileio.read_jsonl(self._run_dir / rundir.METRICS)
            ledger = goodput.build(events.read(self._run_dir), metrics, {}, now=time.time(), running=False,
                                   queue_unknown=True)
        except Exception as exc:  # damaged records: a summary never stops the training
            console.warn(f"train.trackers: no goodput summary in this attempt ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]})")
            self._summed = False
            return
        if ledger is None:  # the run's first start: no attempt before it
            return
        figures, step = summary(ledger), max((a.last_step for a in ledger.attempts), default=0)
        for name, (tracker, _, _) in list(self._open.items()):
            self._call(name, lambda: tracker.summarize(figures, step))

    def log(self, step: int, kind: str, record: Mapping[str, Any]) -> None:
        sent, when = values(record), record.get("time")
        when = float(when) if isinstance(when, (int, float)) else time.time()  # caught up: as first logged
        for name, (tracker, mark, newest) in list(self._open.items()):
            if sent and step > newest[kind]:
                self._call(name, lambda: tracker.send(step, sent, when))
                newest[kind] = step
                if tracker.stores_on_send and name in self._open:
                    mark.hold(newest)

    def close(self, end: str) -> None:
        """`end`: one of ENDS."""
        self._summarize(None)
        for name, (tracker, mark, newest) in list(self._open.items()):
            self._call(name, lambda: tracker.close(end))
            if name in self._open:
                mark.hold(newest)  # ended cleanly: everything sent is held
                self._open.pop(name)[1].close()

    def _call(self, name: str, action: Any) -> None:
        try:
            action()
        except Exception as exc:  # a tracker's server gone mid-run: said once, the training goes on
            console.warn(f"train.trackers: {name} failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                         "no more records to it in this attempt")
            self._open.pop(name)[1].close()
