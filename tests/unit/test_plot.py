"""`ddpjob plot` and `plot.summary`: a real training run, interrupted twice and resumed, drawn as
a PNG whose restart markers sit at the resumed steps with the stop reasons; a sweep overlaid;
the one-line message when matplotlib is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ddpjob.cli import main
from ddpjob.launch import history, plot, summary

pytest.importorskip("matplotlib")  # the `plot` extra; in the `test` extra too


def _fake_run(root: Path, name: str, lr: float, steps: int, stop_at: int | None) -> Path:
    """A run dir written the way the ranks write it (used for the sweep overlay and states)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    lines = []
    ev = [{"event": "start", "restart": 0, "resumed_step": None}]
    for s in range(1, steps + 1):
        lines.append({"kind": "train", "step": s, "epoch": s // 10, "loss": 2.3 / s ** (lr * 3),
                      "lr": lr, "img_s": 1000.0 + 2000 * lr, "restart": 0})
        if s % 5 == 0:
            lines.append({"kind": "eval", "step": s, "epoch": s // 10, "eval_acc": s / steps * lr * 3,
                          "eval_loss": 1.0, "restart": 0})
    if stop_at is not None:
        ev += [{"event": "stop", "reason": "deadline", "step": stop_at, "requeued": True},
               {"event": "start", "restart": 1, "resumed_step": stop_at}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ev))
    return d


def test_sweep_overlay_and_states(tmp_path: Path) -> None:
    runs = [_fake_run(tmp_path / "sweep", f"lr-{lr}", lr, 30, 12 if lr == 0.1 else None)
            for lr in (0.05, 0.1, 0.2)]
    record = plot.plot_runs(runs, tmp_path / "sweep.png")
    assert record.series["loss"] == ["lr-0.05", "lr-0.1", "lr-0.2"]
    assert record.markers == {"lr-0.05": [], "lr-0.1": [(12, "restart 1: deadline")], "lr-0.2": []}
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert summary.summary(runs[1])[0] == "state       running (restart 1)"
    assert summary.summary(runs[0])[-1] == "restarts    0"


def test_a_custom_loops_own_metrics_are_plotted_and_summarized(tmp_path: Path) -> None:
    """A custom loop logs what it likes: status said `epoch ?` and `nan img/s`, plot ignored it."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text("{}")
    # a fractional epoch and a metric named like an event field ("source") are the loop's to log
    recs = [{"kind": "train", "step": s, "restart": 0, "time": 1.0 + s, "epoch": s / 10, "loss": 1 / s,
             "grad_norm": 0.5, "source": 2.0} for s in range(1, 9)] + [
        {"kind": "eval", "step": 8, "restart": 0, "eval_f1": 0.75}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "events.jsonl").write_text(json.dumps({"event": "start", "restart": 0}) + "\n")
    record = plot.plot_runs([d], tmp_path / "mine.png")
    assert record.series["loss"] == ["mine"] and record.series["grad_norm"] == ["mine"]
    assert record.series["eval_f1"] == ["mine"] and record.series["img_s"] == []
    assert "progress    step 8, epoch 0.8, loss 0.1250, grad_norm 0.5, source 2" in summary.summary(d)
    trainer_like = _fake_run(tmp_path, "built-in", 0.05, 30, None)  # the built-in trainer's line as before
    assert "progress    step 30, epoch 3, loss 1.3809, lr 0.05, 1100 img/s" in summary.summary(trainer_like)


def test_the_goodput_bars_under_the_curves_and_the_status_line(tmp_path: Path, capsys) -> None:
    """`ddpjob plot` draws each run's ledger as a bar (ledger/goodput.py) and `status` says it in
    one line; a run without one (the second) has no bar."""
    d = tmp_path / "runs" / "timed"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "job.json").write_text(json.dumps({"backend": "local", "job_id": "local-1", "submitted_at": 100.0}))
    evs = [{"event": "start", "job_id": "local-1", "restart": 0, "time": 110.0, "load_s": 1.0,
            "launched_time": 104.0},
           {"event": "stop", "reason": "finished", "job_id": "local-1", "restart": 0, "step": 20, "time": 130.0}]
    recs = [{"kind": "train", "step": s, "restart": 0, "time": 110.0 + s, "loss": 1 / s} for s in range(1, 21)]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    other = _fake_run(tmp_path / "runs", "untimed", 0.1, 10, None)
    assert main(["plot", str(d), str(other), "-o", str(tmp_path / "gp.png")]) == 0
    assert (tmp_path / "gp.png").read_bytes()[:4] == b"\x89PNG"
    from ddpjob.launch import goodput, runs

    ledgers = goodput.of_runs(runs.infos([(d, ""), (other, "")]))
    assert ledgers[other] is None
    record = plot.plot_runs([d, other], tmp_path / "gp2.png", ledgers)
    assert list(record.goodput) == ["timed"]
    assert record.goodput["timed"]["productive"] == pytest.approx(20)  # 110 -> 130
    # the local backend has no queue: from the submission to the loop is start-up
    assert record.goodput["timed"]["start-up"] == pytest.approx(109 - 100)
    capsys.readouterr()
    assert main(["status", str(d)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("goodput"))
    assert line == "goodput     66.7% of 30 s trained; start-up 30.0%, load 3.3%"


def test_restart_without_a_stop_record_is_a_kill() -> None:
    ev = [{"event": "start", "restart": 0}, {"event": "start", "restart": 1, "resumed_step": 40}]
    assert history.restart_markers(ev) == [history.Marker(40, "killed (no stop recorded)", 1)]


def test_empty_run_and_missing_matplotlib_are_one_line(tmp_path: Path, capsys,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddpjob: error: no metrics in") and len(err.splitlines()) == 1

    assert main(["plot", str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 1
    assert "not a ddpjob run directory" in capsys.readouterr().err

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "matplotlib is not installed" in err
    assert "pip install 'ddpjob[plot]'" in err
    assert not (tmp_path / "x.png").exists()
