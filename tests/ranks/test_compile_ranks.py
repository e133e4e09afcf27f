"""`train.compile` across a stop (issue 13, item 3): torch.compile's caches live in the run dir
(ddpjob/node/compilecache.py), so the resumed attempt takes its compiled training step from
there instead of compiling again, and the compiled run resumes bit-exactly.

One real local run of 2 ranks, stopped at a step it causes (example_hooks' DDPJOB_TEST_STOP_AT)
and restarted by the local supervisor, then an uninterrupted reference run that is pointed at
the first run's cache by TORCHINDUCTOR_CACHE_DIR (a user's own setting wins), so that only the
first attempt pays for a cold compile (about half a minute of CPU per rank on this 2-core machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ranks import LAG, REPO, TESTS, assert_bit_equal, base_env, events, final_state, metrics, write_job
from runlogs import decisions


STOP_AT = 6  # job.steps() hands out index 6: the stop lands at 6 + 1 + LAG


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), **extra}


def _submit(job: Path, run_dir: Path, env: dict[str, str]) -> None:
    full = {k: v for k, v in base_env(env).items()  # only the caches this test names
            if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") or k in env}
    out = subprocess.run([sys.executable, "-m", "ddpjob", "submit", str(job), "--backend", "local",
                          "--wait", "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=900, cwd=REPO, env=full)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _graphs(run_dir: Path) -> list[dict[str, int] | None]:
    return [e.get("graphs") for e in events(run_dir) if e["event"] == "first_step"]


@pytest.mark.slow
def test_a_compiled_run_resumes_from_its_cached_graphs_bit_exactly(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("from ddpjob.train.trainer import main\n\nmain()\n")
    # conv_nobn, not cnn_tiny: a cold compile of its training step costs a rank about 30 s of
    # CPU instead of 45 (fewer kernels for inductor to generate and g++ to build)
    train = dict(entry="example_hooks:main", args=[str(script)], model="trainer_plugins:conv_nobn",
                 compile=True, batch_size=16, max_steps=14, lr=0.05, warmup_steps=2, log_every=1,
                 eval_every=0, amp="off", channels_last=False, threads=1, seed=4)
    job = write_job(tmp_path / "job.toml", train=train,
                    data=dict(dataset="synthetic", synthetic_train=512, synthetic_test=64),
                    checkpoint=dict(every_steps=50, keep_last=2),
                    slurm=dict(tasks_per_node=2, max_requeues=2))
    run = tmp_path / "run"
    _submit(job, run, _env(DDPJOB_TEST_STOP_AT=str(STOP_AT)))
    stops = decisions(events(run))
    assert [(s["reason"], s["step"]) for s in stops] == [("time_limit", STOP_AT + 1 + LAG),
                                                         ("finished", 14)], stops
    first, resumed = _graphs(run)
    # the first attempt compiled the training step (forward and backward graphs), the resumed
    # one found every one of them in RUN_DIR/cache and compiled nothing
    assert first is not None and first["compiled"] >= 2 and first["cached"] == 0, first
    assert resumed == {"cached": first["compiled"], "compiled": 0}, resumed
    assert any((run / "cache" / "inductor").rglob("*")), "nothing cached in the run dir"

    ref = tmp_path / "reference"
    _submit(job, ref, _env(TORCHINDUCTOR_CACHE_DIR=str(run / "cache" / "inductor")))
    assert _graphs(ref) == [resumed]
    assert not (ref / "cache" / "inductor").exists()  # the user's place was used
    model_a, opt_a = final_state(run)
    model_b, opt_b = final_state(ref)
    assert_bit_equal(model_a, model_b, "model")
    assert_bit_equal(opt_a["state"], opt_b["state"], "optimizer")
    assert {s: r["loss"] for s, r in metrics(run).items()} == {s: r["loss"] for s, r in metrics(ref).items()}
