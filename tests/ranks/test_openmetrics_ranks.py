"""train.metrics_textfile with real ranks (local processes): rank 0 keeps node_exporter's textfile
up to date while the run trains. The reads happen at chosen steps (a hook in
tests/trainer_plugins.py copies the file when `job.steps()` hands out the step), never by a timer.
The writer's rules on made-up calls are tests/unit/test_openmetrics.py's."""

from __future__ import annotations

import stat
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ranks import run, write_job


def _values(path: Path) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def test_the_textfile_follows_the_training_step_by_step(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml",
                    train=dict(model="trainer_plugins:signalling_cnn", batch_size=8, max_steps=12, log_every=1,
                               eval_every=0, amp="off", channels_last=False, threads=1,
                               metrics_textfile="metrics.prom"),
                    data=dict(dataset="synthetic", synthetic_train=256, synthetic_test=32),
                    checkpoint=dict(every_steps=5))
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_COPY_TEXTFILE": "6,11"})
    assert codes == [0, 0], r.output()
    at6, at11, end = (_values(out / name) for name in ("metrics.prom.at-6", "metrics.prom.at-11", "metrics.prom"))
    # written at each checkpoint (steps 5 and 10) and at the end: the step goes up with the run
    assert at6["ddpjob_run_checkpoint_step"] == 5 and at6["ddpjob_run_step"] >= 5
    assert at11["ddpjob_run_checkpoint_step"] == 10 and at11["ddpjob_run_step"] >= 10
    assert end["ddpjob_run_step"] == end["ddpjob_run_checkpoint_step"] == 12
    assert at6["ddpjob_run_step"] < at11["ddpjob_run_step"] < end["ddpjob_run_step"]
    assert end["ddpjob_run_restarts_total"] == 0 and end["ddpjob_run_steps_per_second"] > 0
    assert stat.S_IMODE((out / "metrics.prom").stat().st_mode) == 0o644
    assert sorted(p.name for p in out.glob("*.prom*")) == ["metrics.prom", "metrics.prom.at-11",
                                                           "metrics.prom.at-6"]  # no temp file left
