"""The trainer callbacks' own parts (ddpjob/integrations/), in process: the job's settings from
the run dir, the flag-only handlers, the metrics lines, which HF checkpoint resumes, the
Lightning layout check, and what each module imports. Real runs: tests/ranks/test_integrations_local.py,
tests/cluster/test_integrations_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpjob import jobfile
from ddpjob.integrations._common import Metrics, Settings, StopSignals, agree


def test_settings_come_from_the_run_dir_and_the_variables(tmp_path: Path) -> None:
    cfg = jobfile.from_dict({"name": "t", "slurm": {"signal": "USR1"},
                             "train": {"command": ["python", "x.py"], "command_signal": "INT", "command_requeue_exit": 7}})
    (tmp_path / "config.json").write_text(cfg.to_json())
    s = Settings.from_environ({"DDPJOB_RUN_DIR": str(tmp_path), "DDPJOB_ATTEMPT": "2", "RANK": "1", "WORLD_SIZE": "4",
                               "LOCAL_WORLD_SIZE": "2", "DDPJOB_METRICS": str(tmp_path / "metrics.jsonl")})
    assert (s.signals, s.requeue_exit, s.attempt, s.rank, s.world_size, s.local_world_size) == (
        ("TERM", "INT", "USR1"), 7, 2, 1, 4, 2)
    assert s.metrics == tmp_path / "metrics.jsonl"
    # outside ddpjob (plain torchrun): the defaults, no metrics
    bare = Settings.from_environ({})
    assert (bare.signals, bare.requeue_exit, bare.metrics, bare.world_size) == (("TERM", "USR2"), 3, None, 1)


def test_the_handler_only_sets_a_flag_and_the_previous_one_comes_back() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        stops = StopSignals(("USR1",))
        stops.install()
        assert stops.ours() and not stops.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stops.requested() and seen == []  # the flag, nothing else ran
        assert agree(stops.requested()) is True  # no process group: the flag itself
        stops.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not stops.ours()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_metrics_lines_one_per_step_with_the_loss_reported_later_and_the_save(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    m = Metrics(Settings(metrics=path, attempt=1))
    m.step(10, lr=0.1)
    m.add(10, loss=2.5, grad_norm=None)
    m.checkpoint(10, tmp_path / "checkpoint-10")
    m.step(11, lr=0.09)
    m.flush()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["kind"], r["step"], r["restart"]) for r in lines] == [("train", 10, 1), ("checkpoint", 10, 1),
                                                                      ("train", 11, 1)]
    assert lines[0]["loss"] == 2.5 and lines[0]["lr"] == 0.1 and "grad_norm" not in lines[0]
    assert lines[1]["path"].endswith("checkpoint-10") and all(isinstance(r["time"], float) for r in lines)
    # other ranks write nothing
    Metrics(Settings(metrics=tmp_path / "r1.jsonl", rank=1)).checkpoint(3, "x")
    assert not (tmp_path / "r1.jsonl").exists()


try:  # the extra ddpjob[hf]; the tests of the HF parts skip without it
    from ddpjob.integrations import hf
except ImportError:
    hf = None  # type: ignore[assignment]


def _checkpoint(out: Path, step: int, *, state: bool = True, manifest: bool = False) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * 64)
    (path / "optimizer.pt").write_bytes(b"o" * 32)
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if manifest:
        assert hf is not None
        hf.write_manifest(path)
    return path


@pytest.mark.skipif(hf is None, reason="transformers is not installed (extra ddpjob[hf])")
def test_last_checkpoint_passes_over_a_half_written_one(tmp_path: Path) -> None:
    assert hf is not None
    out = tmp_path / "out"
    assert hf.last_checkpoint(out) is None  # the first start: nothing to resume
    _checkpoint(out, 50)
    good = _checkpoint(out, 100, manifest=True)
    _checkpoint(out, 150, state=False)  # killed mid-save: no trainer_state.json
    truncated = _checkpoint(out, 200, manifest=True)
    (truncated / "optimizer.pt").write_bytes(b"o" * 5)  # a file shorter than its manifest says
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)).endswith("checkpoint-200")  # what transformers would take
    assert hf.last_checkpoint(out) == str(good)
    assert hf.checkpoint_problem(out / "checkpoint-150") == "it has no trainer_state.json (the save did not finish)"
    assert hf.checkpoint_problem(truncated) == "optimizer.pt has 5 bytes, the manifest says 32"
    lines = hf.set_aside(out)
    assert len(lines) == 2 and "checkpoint-200 cannot be resumed: optimizer.pt has 5 bytes" in lines[0], lines
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-100", "checkpoint-50", "incomplete-checkpoint-150",
                                                     "incomplete-checkpoint-200"]
    assert get_last_checkpoint(str(out)).endswith("checkpoint-100")  # resume_from_checkpoint=True now agrees


@pytest.mark.skipif(hf is None, reason="transformers is not installed (extra ddpjob[hf])")
def test_the_hf_callback_asks_the_trainer_to_save_and_stop_once_the_flag_is_set(tmp_path: Path) -> None:
    assert hf is not None
    from transformers import TrainerControl, TrainerState

    cb = hf.DdpjobCallback(Settings(signals=("USR1",), metrics=tmp_path / "m.jsonl"))
    control, state = TrainerControl(), TrainerState(global_step=7)
    cb.on_train_begin(None, state, control)
    try:
        cb.on_step_end(None, state, control)
        assert not (control.should_save or control.should_training_stop)
        os.kill(os.getpid(), signal.SIGUSR1)
        state.global_step = 8
        cb.on_step_end(None, state, control)
        assert control.should_save and control.should_training_stop and cb.stopping
    finally:
        cb.on_train_end(None, state, control)
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("train", 7), ("train", 8), ("end", 8)], lines


def test_lightning_layout_check_names_both_layouts() -> None:
    if __import__("importlib").util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (extra ddpjob[lightning])")
    from ddpjob.integrations import lightning as integ

    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
    assert integ.layout_problem(2, 2, env) is None
    err = integ.layout_problem(1, 1, env)
    assert err is not None and err.line() == (
        "ddpjob: error: Trainer(devices=1, num_nodes=1) is 1 rank(s) per node on 1 node(s), the job runs 4: 2 per node "
        "on 2 node(s). "
        "Hint: Trainer(devices=2, num_nodes=2), or devices=int(os.environ['LOCAL_WORLD_SIZE']), "
        "num_nodes=int(os.environ['GROUP_WORLD_SIZE']).")
    environ = {"DDPJOB_RUN_DIR": "/runs/r1", "RANK": "0", "SLURM_JOB_ID": "42"}
    integ.elastic_environ(environ)
    assert environ["TORCHELASTIC_RUN_ID"] == "42"  # Lightning then takes TorchElasticEnvironment
    plain = {"RANK": "0"}
    integ.elastic_environ(plain)
    assert "TORCHELASTIC_RUN_ID" not in plain  # not under ddpjob: left alone


def test_the_integrations_package_and_the_cli_import_no_trainer_package() -> None:
    code = ("import sys, ddpjob.integrations, ddpjob.integrations._common, ddpjob.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_lightning_callback_keeps_lightnings_handler_out_for_the_fit_only(tmp_path: Path) -> None:
    if __import__("importlib").util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed (extra ddpjob[lightning])")
    from types import SimpleNamespace

    from ddpjob.integrations import lightning as integ

    class Connector:
        registered = 0

        def register_signal_handlers(self) -> None:
            Connector.registered += 1

    trainer = SimpleNamespace(num_devices=1, num_nodes=1, _signal_connector=Connector(), checkpoint_callbacks=[],
                              is_global_zero=True, default_root_dir=str(tmp_path))
    cb = integ.DdpjobCallback(Settings(signals=("USR1",)))
    previous = signal.getsignal(signal.SIGUSR1)
    cb.setup(trainer, None, "fit")
    try:
        trainer._signal_connector.register_signal_handlers()  # what Lightning's fit calls next
        assert Connector.registered == 0 and cb.signals.ours()
        assert integ.last_path(trainer) == tmp_path / "checkpoints" / "last.ckpt"
    finally:
        cb.teardown(trainer, None, "fit")
    trainer._signal_connector.register_signal_handlers()  # a later trainer.test(): Lightning's again
    assert Connector.registered == 1 and signal.getsignal(signal.SIGUSR1) == previous


def test_the_lightning_callback_says_the_fit_ended_by_itself(tmp_path: Path) -> None:
    """A fit that ended by itself gets rank 0's "end" line: a teardown abort after it is read as
    done (rank/command_end.py), not as a crash to restart from the last save."""
    pytest.importorskip("lightning")
    import types

    from ddpjob.integrations.lightning import DdpjobCallback

    cb = DdpjobCallback(Settings(signals=("USR1",), metrics=tmp_path / "m.jsonl", attempt=2))
    cb.on_train_end(types.SimpleNamespace(checkpoint_callbacks=[], global_step=5), None)
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["restart"]) for r in lines] == [("end", 5, 2)], lines
