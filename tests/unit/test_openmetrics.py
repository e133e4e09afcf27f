"""Runs as Prometheus series (ddpjob/openmetrics.py, docs/openmetrics.md): `status` and `ls --format
openmetrics` on a run dir with made-up records, parsed back by prometheus_client's own parsers,
and rank 0's textfile writer in-process. The textfile updated by real ranks while they train is
tests/ranks/test_trainer_ranks.py's."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import fake_checkpoint
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from ddpjob import fileio, jobfile, openmetrics
from ddpjob.cli import main
from ddpjob.errors import UsageError


def samples(families: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of parsed families."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def _run(root: Path, name: str, job: str, *, crashed: bool) -> Path:
    """A local run submitted at 100 that trained 20 steps; `crashed`: its first attempt crashed at
    step 10 and the second resumed from step 5 (5 steps replayed)."""
    run = root / "runs" / name
    run.mkdir(parents=True)
    fileio.write_json_atomic(run / "config.json", {})
    fileio.write_json_atomic(run / "job.json", {"backend": "local", "job_id": job, "submitted_at": 100.0})
    starts = [(0, 110.0, None)] + ([(1, 130.0, 5)] if crashed else [])
    for restart, t, resumed in starts:
        fileio.append_jsonl(run / "events.jsonl", {"event": "start", "job_id": job, "restart": restart, "time": t,
                                                   "launched_time": t - 5, "load_s": 1.0, "resumed_step": resumed})
        first = (resumed or 0) + 1
        last = 10 if crashed and restart == 0 else 20
        for s in range(first, last + 1):
            fileio.append_jsonl(run / "metrics.jsonl", {"kind": "train", "step": s, "restart": restart,
                                                        "time": t + s - first + 1, "loss": 1.0 / s})
        fileio.append_jsonl(run / "events.jsonl", {
            "event": "stop", "reason": "crash" if last == 10 else "finished", "step": last, "job_id": job,
            "restart": restart, "time": t + last - first + 1})
    fake_checkpoint.committed(run, 20)
    return run


def test_status_and_ls_say_the_json_s_values_as_openmetrics(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = _run(tmp_path, "crashed", "77", crashed=True)
    _run(tmp_path, "clean", "78", crashed=False)
    assert main(["status", "runs/crashed", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert main(["status", "runs/crashed", "--format", "openmetrics"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("# EOF\n")
    got = samples(parse_openmetrics(out))
    r = (("run", str(run)),)
    g = rec["goodput"]
    assert got[("ddpjob_run_info", (("backend", "local"), ("job_id", "77"), ("point", ""), ("run", str(run)),
                                     ("state", rec["state"])))] == 1
    assert got[("ddpjob_run_step", r)] == rec["step"] == 20
    assert got[("ddpjob_run_loss", r)] == rec["loss"] == 1 / 20
    assert got[("ddpjob_run_checkpoint_step", r)] == 20
    assert got[("ddpjob_run_restarts_total", r)] == rec["restarts"]
    assert got[("ddpjob_run_completed", r)] == 0
    assert got[("ddpjob_run_wall_seconds", r)] == g["wall_s"] == 45  # submitted at 100, finished at 145
    for category, seconds in g["seconds"].items():
        assert got[("ddpjob_run_seconds", (("category", category), *r))] == seconds
    assert got[("ddpjob_run_seconds", (("category", "replayed"), *r))] == 5  # steps 6-10 again, 1 s each
    assert got[("ddpjob_run_goodput_ratio", r)] == g["goodput"]
    assert got[("ddpjob_run_attempts_total", r)] == 2
    assert got[("ddpjob_run_replayed_steps_total", r)] == 5
    assert got[("ddpjob_run_start_time_seconds", r)] == 100
    # ls: every run, one series each
    assert main(["ls", "--format", "openmetrics"]) == 0
    steps = {dict(s.labels)["run"]: s.value for f in parse_openmetrics(capsys.readouterr().out)
             if f.name == "ddpjob_run_step" for s in f.samples}
    assert steps == {str(tmp_path / "runs" / "clean"): 20, str(run): 20}
    replayed = {dict(s.labels)["run"]: s.value for f in parse_openmetrics(_status(capsys)) if
                f.name == "ddpjob_run_replayed_steps" for s in f.samples}
    assert replayed == {str(tmp_path / "runs" / "clean"): 0, str(run): 5}


def _status(capsys: Any) -> str:
    assert main(["status", "--format", "openmetrics"]) == 0  # every run under ./runs
    return str(capsys.readouterr().out)


def test_without_prometheus_client_the_format_is_one_line_with_the_pip_hint(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, "clean", "78", crashed=False)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # an import of it fails
    assert main(["ls", "--format", "openmetrics"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == [
        "ddpjob: error: --format openmetrics needs the prometheus-client package, which is not installed. "
        "Hint: pip install 'ddpjob[openmetrics]' (or pip install prometheus-client)."]


def test_the_textfile_is_written_at_a_checkpoint_and_at_most_every_few_seconds_with_a_log(
        tmp_path, monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(openmetrics.time, "monotonic", lambda: clock[0])
    path = tmp_path / "run.prom"
    tf = openmetrics.Textfile(str(path), tmp_path, job_id="7", restart=2)
    tf.write()
    first = samples(parse_text(path.read_text()))
    assert first[("ddpjob_run_info", (("job_id", "7"), ("run", str(tmp_path))))] == 1
    assert first[("ddpjob_run_restarts_total", (("run", str(tmp_path)),))] == 2
    assert ("ddpjob_run_step", (("run", str(tmp_path)),)) not in first  # nothing logged yet: no sample
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # the collector's user reads, nobody else writes
    r = (("run", str(tmp_path)),)
    clock[0] += openmetrics.TEXTFILE_EVERY_S
    tf.logged(10, {"loss": 0.5})  # the interval since the last write passed: written
    clock[0] += 1
    tf.logged(20, {"loss": 0.25})  # 1 s later: not yet
    assert samples(parse_text(path.read_text()))[("ddpjob_run_step", r)] == 10
    tf.checkpointed(20)  # a checkpoint: always
    got = samples(parse_text(path.read_text()))
    assert got[("ddpjob_run_step", r)] == 20 and got[("ddpjob_run_checkpoint_step", r)] == 20
    assert got[("ddpjob_run_loss", r)] == 0.25 and got[("ddpjob_run_steps_per_second", r)] == 10
    clock[0] += openmetrics.TEXTFILE_EVERY_S
    tf.logged(30, {"loss": float("nan")})  # the interval passed: written; an unknown loss says nothing
    got = samples(parse_text(path.read_text()))
    assert got[("ddpjob_run_step", r)] == 30 and ("ddpjob_run_loss", r) not in got
    assert [p.name for p in tmp_path.iterdir()] == ["run.prom"]  # no temp file left beside it


def test_metrics_textfile_must_name_a_prom_file(tmp_path) -> None:
    assert jobfile.from_dict({"train": {"metrics_textfile": "/var/lib/ne/run.prom"}}).train.metrics_textfile
    for bad in ("run.txt", "dir/.prom", "x.prom\n"):
        with pytest.raises(UsageError, match=r"train.metrics_textfile .* is not a .prom file"):
            jobfile.from_dict({"train": {"metrics_textfile": bad}})
    missing = tmp_path / "no" / "x.prom"
    with pytest.raises(Exception, match="folder .* does not exist"):
        openmetrics.Textfile(str(missing), tmp_path, job_id="1", restart=0).write()
    assert not os.path.exists(missing)
