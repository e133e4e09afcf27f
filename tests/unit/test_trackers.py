"""rank/trackers.py in-process, with a stand-in tracker in place of W&B and MLflow: what reaches a
tracker across attempts that end cleanly, are killed, or replay steps; the lines for a missing
package and a tracker that refuses the run. The real packages, offline, with real ranks through a
preemption, a restart in place and `ddpjob resume`: tests/ranks/test_trackers_ranks.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ddpjob import jobfile
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.rank import trackers
from ddpjob.rank.records import MetricLog
from ddpjob.ledger.events import record as record_event

STORED: list[tuple[str, int, dict[str, float]]] = []  # what the stand-in's store holds: (id, step, values)


class StandIn:
    """Keeps its id in the run dir like the real ones; stores on send when `stores_on_send`,
    else (like W&B) only what a clean close() flushed: a killed attempt leaves nothing."""

    stores_on_send = True

    def __init__(self, state: dict[str, Any], save: Any, cfg: Any, run_dir: Path) -> None:
        if "id" not in state:
            state["id"] = f"run-{len(STORED)}"
            save(state)
        self.id, self.buffer = state["id"], []

    def send(self, step: int, values: dict[str, float], when: float) -> None:
        (STORED if self.stores_on_send else self.buffer).append((self.id, step, values))

    def note(self, info: dict[str, Any]) -> None:
        pass

    def close(self, end: str) -> None:
        STORED.extend(self.buffer)


def attempt(run: Path, steps: range, *, clean: bool, restart: int) -> None:
    """One attempt of rank 0: a start event, a record per step (loss = 1/step: a replay logs the
    same), then a clean end or a SIGKILL (no close)."""
    cfg = jobfile.from_dict({"train": {"trackers": ["mlflow"]}})
    log = MetricLog(run, restart, trackers=trackers.Trackers(cfg, run, job_id="7", attempt=restart))
    record_event(run, "start", restart=restart)
    for s in steps:
        log.write(s, {"loss": 1 / s, "lr": 0.1})
        if s % 5 == 0:
            log.write(s, {"eval_acc": s / 100})
    if clean:
        log.close("stopped")


@pytest.mark.parametrize("stores_on_send", [True, False], ids=["stores-on-send", "buffers-elsewhere"])
def test_each_step_reaches_the_tracker_once_in_order_across_kills_and_replays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stores_on_send: bool) -> None:
    monkeypatch.setitem(trackers.KINDS_OF, "mlflow", type("T", (StandIn,), {"stores_on_send": stores_on_send}))
    STORED.clear()
    attempt(tmp_path, range(1, 9), clean=True, restart=0)  # stopped at 8 (checkpoint 8)
    attempt(tmp_path, range(9, 14), clean=False, restart=1)  # killed after 13, checkpoint at 10
    attempt(tmp_path, range(11, 17), clean=False, restart=2)  # replays 11-13, killed after 16
    attempt(tmp_path, range(16, 21), clean=True, restart=3)  # `ddpjob resume` from 15: replays 16, ends
    assert {i for i, _, _ in STORED} == {"run-0"}  # one tracker run
    train = [(s, v) for _, s, v in STORED if "loss" in v]
    assert train == [(s, {"loss": 1 / s, "lr": 0.1}) for s in range(1, 21)]
    assert [(s, v) for _, s, v in STORED if "eval_acc" in v] == [(s, {"eval_acc": s / 100}) for s in (5, 10, 15, 20)]


def test_a_missing_package_and_a_refused_run_stop_the_start_with_one_line(tmp_path: Path, monkeypatch) -> None:
    def line() -> str:
        with pytest.raises(DDPJobError) as err:
            trackers.Trackers(jobfile.from_dict({"train": {"trackers": ["wandb"]}}), tmp_path, job_id="7", attempt=0)
        return err.value.line()

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert line() == ("ddpjob: error: train.trackers has \"wandb\", but the wandb package is not installed in the "
                      "job's environment. Hint: pip install 'ddpjob[wandb]' (or remove \"wandb\" from train.trackers).")

    class Refusing(StandIn):
        def __init__(self, *args: Any) -> None:
            raise RuntimeError("the server said\nno")

    monkeypatch.setitem(trackers.KINDS_OF, "wandb", Refusing)
    assert line() == ("ddpjob: error: train.trackers: wandb did not open its run (RuntimeError: the server said no). "
                      "Hint: fix wandb's settings, or remove \"wandb\" from train.trackers.")


def test_trackers_are_known_names_once_each() -> None:
    assert jobfile.from_dict({"train": {"trackers": ["wandb", "mlflow"]}}).train.trackers == ("wandb", "mlflow")
    for bad in (["neptune"], ["wandb", "wandb"]):
        with pytest.raises(UsageError, match="expected each of wandb, mlflow at most once"):
            jobfile.from_dict({"train": {"trackers": bad}})
