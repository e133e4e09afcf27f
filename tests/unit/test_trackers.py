"""rank/trackers.py in-process, with a stand-in tracker in place of W&B and MLflow: what reaches a
tracker across attempts that end cleanly, are killed, or replay steps; the lines for a missing
package and a tracker that refuses the run. The real packages, offline, with real ranks through a
preemption, a restart in place and `ddpjob resume`: tests/ranks/test_trackers_ranks.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpjob import fileio, jobfile, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.rank import trackers
from ddpjob.rank.records import MetricLog
from ddpjob.ledger.events import record as record_event

STORED: list[tuple[str, int, dict[str, float]]] = []  # what the stand-in's store holds: (id, step, values)
SUMMARIES: list[tuple[int, dict[str, float]]] = []  # the goodput summaries it was handed: (step, figures)


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

    def summarize(self, figures: dict[str, float], step: int) -> None:
        SUMMARIES.append((step, figures))

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


def history(run: Path, restart: int, *, at: float, launched: float, steps: range, resumed: int | None,
            end: dict[str, Any] | None) -> None:
    """One attempt's records with their times: its start (load 1 s), a train record per second of
    `steps`, then `end` (its decision, None: killed)."""
    record_event(run, "start", job_id="7", restart=restart, time=at, launched_time=launched, load_s=1.0,
                 resumed_step=resumed)
    for n, s in enumerate(steps, 1):
        fileio.append_jsonl(run / rundir.METRICS, {"kind": "train", "time": at + n, "step": s, "restart": restart,
                                                    "loss": 1 / s})
    if end is not None:
        record_event(run, "stop", job_id="7", restart=restart, **end)


def test_each_start_and_clean_close_hands_the_trackers_the_goodput_of_the_history_so_far(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0 stopped for a requeue, attempt 1 restarted in place after a kill, attempt 2
    replays 5 steps and finishes: the summary at attempt 2's start sums up the two before it
    (the killed one too), the one at its close the whole run; the queue wait (28 -> 105) is
    left out: the ranks have no sacct."""
    monkeypatch.setitem(trackers.KINDS_OF, "mlflow", StandIn)
    SUMMARIES.clear()
    cfg = jobfile.from_dict({"train": {"trackers": ["mlflow"]}})
    trackers.Trackers(cfg, tmp_path, job_id="7", attempt=0).close("finished")  # nothing before the first start
    assert SUMMARIES == []
    history(tmp_path, 0, at=17, launched=12, steps=range(1, 11), resumed=None,
            end=dict(reason="preemption", step=10, signal_time=27.0, decided_time=27.2, time=27.6, action="requeue"))
    record_event(tmp_path, "exit", job_id="7", restart=0, step=10, time=28.0)
    history(tmp_path, 1, at=110, launched=105, steps=range(11, 21), resumed=10,
            end=dict(reason="crash", step=15, time=121.0, action="restart"))  # the batch script's, after the kill
    # 12-16 start-up, 16-17 load, 17-27 steps, 27-28 stop and save; 105-109 start-up, 109-110
    # load, 110-120 steps, 120-121 other (the crash's end)
    before = {"goodput/productive_seconds": 20.0, "goodput/start_up_seconds": 8.0, "goodput/load_seconds": 2.0,
              "goodput/replayed_seconds": 0.0, "goodput/checkpoint_seconds": 0.0, "goodput/eval_seconds": 0.0,
              "goodput/data_stall_seconds": 0.0, "goodput/stop_and_save_seconds": 1.0, "goodput/other_seconds": 1.0,
              "goodput/wall_seconds": 32.0, "goodput_ratio": 0.625, "goodput/replayed_steps": 0.0}
    open_ = trackers.Trackers(cfg, tmp_path, job_id="7", attempt=2)
    assert SUMMARIES == [(20, before)]
    history(tmp_path, 2, at=130, launched=125, steps=range(16, 26), resumed=15,
            end=dict(reason="finished", step=25, time=140.0))
    open_.close("finished")
    # 121-129 start-up, 129-130 load, 130-135 steps 16-20 again, 135-140 new steps
    whole = {**before, "goodput/productive_seconds": 25.0, "goodput/replayed_seconds": 5.0,
             "goodput/start_up_seconds": 16.0,
             "goodput/load_seconds": 3.0, "goodput/wall_seconds": 51.0, "goodput_ratio": round(25 / 51, 4),
             "goodput/replayed_steps": 5.0}
    assert SUMMARIES[1:] == [(25, whole)]


def test_records_that_fail_the_ledger_are_said_once_and_the_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(trackers.KINDS_OF, "mlflow", StandIn)
    STORED.clear()
    SUMMARIES.clear()
    os.mkfifo(tmp_path / rundir.EVENTS)  # no record file: reading it refuses (fileio.RecordError)
    log = MetricLog(tmp_path, 0, trackers=trackers.Trackers(jobfile.from_dict({"train": {"trackers": ["mlflow"]}}),
                                                            tmp_path, job_id="7", attempt=0))
    log.write(1, {"loss": 0.5})
    log.close("finished")
    assert [s for _, s, _ in STORED] == [1] and SUMMARIES == []
    said = [ln for ln in capsys.readouterr().err.splitlines() if "goodput" in ln]
    assert len(said) == 1, said
    assert said[0].startswith("ddpjob: warning: train.trackers: no goodput summary in this attempt ("), said
