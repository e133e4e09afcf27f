"""train.trackers with the real packages, offline (WANDB_MODE=offline; MLflow's file store in the
run dir): one tracker run across a preemption, a restart in place after a killed rank and a
`ddpjob resume`, every step once and in order, with the values metrics.jsonl has, ending with
the whole run's goodput summary. The
interruptions happen at chosen training steps (tests/trainer_plugins.py's DDPJOB_TEST_SIGNAL),
never by a timer. Local backend, 2 ranks."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import pytest

from clirun import ddpjob, job_env, without_job_env
from ranks import metrics, write_job
from runlogs import decisions, events

mlflow = pytest.importorskip("mlflow")
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

STEPS = 30


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of an offline run's .wandb file: a 7-byte header (":W&B", magic,
    version), then LevelDB's log format: 32 KiB blocks of chunks (crc32 4, length 2, type 1:
    full 1, first 2, middle 3, last 4; a block's tail under 7 bytes is padding)."""
    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(run_dir: Path, run_id: str) -> list[tuple[int, float]]:
    """(step, loss) of every history row of the W&B run, attempt after attempt (each attempt's
    offline folder, in the order its rows were written), as `wandb sync` would upload them. An
    attempt whose rank 0 was SIGKILLed left a file with nothing in it: the next caught up."""
    attempts = []
    for path in run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"):
        rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]
        assert {r.run.run_id for r in wandb_records(path) if r.WhichOneof("record_type") == "run"} <= {run_id}
        attempts.append(rows)
    attempts.sort(key=lambda rows: rows[0]["_timestamp"] if rows else 0)
    return [(r["_step"], r["loss"]) for rows in attempts for r in rows if "loss" in r]


def wandb_summary(run_dir: Path, run_id: str, attempts: int) -> dict[str, Any]:
    """The W&B run's summary as the last attempt (the one that noted `attempts`) left it."""
    for path in run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"):
        summary: dict[str, Any] = {}
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
        if summary.get("ddpjob/attempts") == attempts:
            return summary
    raise AssertionError(f"no attempt of {run_id} noted ddpjob/attempts = {attempts}")


def test_one_tracker_run_across_a_preemption_a_restart_in_place_and_a_resume(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for those who ask
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2, max_requeues=5, max_failures=1),
                    train=dict(model="trainer_plugins:signalling_cnn", batch_size=8, max_steps=STEPS, log_every=1,
                               eval_every=0, amp="off", channels_last=False, threads=1, seed=3,
                               trackers=["wandb", "mlflow"], tracker_project="trk",
                               mlflow_uri=f"file:{run}/mlruns"),
                    data=dict(dataset="synthetic", synthetic_train=256, synthetic_test=32),
                    checkpoint=dict(every_steps=5, snapshot_every=0))
    # attempt 0: rank 1 gets SIGTERM (a preemption) in step 8; attempt 1 (resumed from
    # that stop's checkpoint): rank 1 is SIGKILLed in its 9th step, the ranks restart in place
    # (max_failures = 1) from the last periodic checkpoint and replay the steps after it; attempt
    # 2: rank 1 raises in its 4th step, the run fails; `ddpjob resume` replays again and finishes
    env = without_job_env(job_env(DDPJOB_TEST_SIGNAL="1:8:0:term,1:9:1:kill,1:4:2:crash", WANDB_MODE="offline",
                                  WANDB_SILENT="true", MLFLOW_ALLOW_FILE_STORE="true"))
    out = ddpjob("submit", str(job), "--backend", "local", "--run-dir", str(run), "--wait", cwd=tmp_path, env=env)
    assert out.returncode == 1 and ": FAILED (not retried: rank 1's RuntimeError" in out.stdout, out.stdout + out.stderr
    out = ddpjob("resume", str(run), "--wait", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr

    stops = [(e["reason"], e["step"]) for e in decisions(events(run))]
    starts = [(e.get("restart"), e.get("resumed_step")) for e in events(run) if e["event"] == "start"]
    assert [r for r, _ in stops][:3] == ["preemption", "crash", "crash"] and stops[-1][0] == "finished", stops
    logged = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) > len(set(logged)) == STEPS, (stops, starts)  # steps were replayed
    loss = {s: r["loss"] for s, r in metrics(run).items()}

    # MLflow: one run, each step once, in order, the values metrics.jsonl has
    client = mlflow.tracking.MlflowClient(f"file:{run}/mlruns")
    (exp,) = [e for e in client.search_experiments() if e.name == "trk"]
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.run_id == json.loads((run / "trackers" / "mlflow.json").read_text())["run_id"]
    history = client.get_metric_history(found.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, STEPS + 1))
    assert [m.value for m in history] == [loss[s] for s in range(1, STEPS + 1)]
    assert found.info.status == "FINISHED"
    assert found.data.tags["ddpjob.attempts"] == str(len(starts)) and found.data.params["train.tracker_project"] == "trk"
    assert found.data.tags["ddpjob.job_id"] == json.loads((run / "job.json").read_text())["job_id"]

    # W&B: one run id, one offline folder per attempt; together each step once, in order (an
    # attempt killed with SIGKILL wrote nothing there: the next start sent its steps from metrics.jsonl)
    run_id = json.loads((run / "trackers" / "wandb.json").read_text())["id"]
    assert len(list(run.glob("wandb/offline-run-*"))) == len(starts)
    assert wandb_history(run, run_id) == [(s, loss[s]) for s in range(1, STEPS + 1)]

    # the goodput summary of the whole run, the same in both, from the last attempt's close
    summary = wandb_summary(run, run_id, len(starts))
    goodput = {k.removeprefix("ddpjob/"): v for k, v in summary.items() if k.startswith("ddpjob/goodput")}
    assert {k.removeprefix("ddpjob."): m for k, m in found.data.metrics.items() if k.startswith("ddpjob.")} == {
        k.replace("/", "."): v for k, v in goodput.items()}
    seconds = {k: v for k, v in goodput.items() if k.endswith("_seconds") and k != "goodput/wall_seconds"}
    assert len(seconds) == 9 and "goodput/queue_seconds" not in seconds, goodput  # the queue: status only
    assert goodput["goodput/wall_seconds"] == pytest.approx(sum(seconds.values()), abs=0.01), goodput
    assert goodput["goodput/productive_seconds"] > 0 and goodput["goodput/replayed_seconds"] > 0, goodput
    assert 0 < goodput["goodput_ratio"] < 1, goodput
    status = json.loads(ddpjob("status", str(run), "--json", cwd=tmp_path, env=env).stdout)["goodput"]
    assert goodput["goodput/replayed_steps"] == status["replayed_steps"] > 0, (goodput, status)
    assert len(status["attempts"]) == len(starts) == summary["ddpjob/attempts"]
    logs = "".join(p.read_text(errors="replace") for p in run.glob("logs/*"))
    assert "ddpjob: warning: train.trackers" not in logs and "current step" not in logs
