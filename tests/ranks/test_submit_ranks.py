"""`ddpjob submit`: parameter mapping to submitit, NodeTask's exit-code contract, dry runs,
one-line errors that leave nothing behind, and (on the test cluster) real submitit jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ranks import LAG

from clirun import ddpjob as run_cli
from ddpjob import fileio, jobfile, rundir
from ddpjob.launch.backends import submitit_slurm
from ddpjob.ledger.events import read as read_events
from runlogs import decisions

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


@pytest.mark.parametrize("left_standing", [False, True])
def test_a_failed_nodetask_with_its_group_standing_ends_after_submitit_without_the_teardown(
        tmp_path, left_standing):
    """Under submitit a failed rank's exception must still reach submitit (its result pickle,
    its log line) and the process exit 1; once the rank left its process group standing, the
    interpreter's teardown (which could abort in torch's destructors: SIGABRT instead of 1) is
    skipped after all of that. An atexit hook registered first stands for that teardown."""
    code = ("import atexit; atexit.register(lambda: print('teardown ran', flush=True))\n"
            "from ddpjob.rank.task import NodeTask; from ddpjob.node import dist; from ddpjob.rank import runner\n"
            f"dist.left_standing = {left_standing}\n"
            "def failed(run_dir, argv=None):\n    return 1\n"
            "runner.run_node = failed\n"
            "try:\n"
            f"    NodeTask({str(tmp_path)!r})()\n"
            "except RuntimeError:\n"
            "    print('submitit saw the failure', flush=True)\n"
            "    raise\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "submitit saw the failure" in out.stdout
    assert "RuntimeError: ddpjob run" in out.stderr and "exited with 1" in out.stderr
    assert ("teardown ran" in out.stdout) is not left_standing


@pytest.mark.slow
def test_a_stopped_run_dir_is_resumed_at_other_resources_never_while_it_runs(tmp_path):
    # The run dir policy of `ddpjob sbatch` and `ddpjob run`, through submit and resume: refused
    # while its job runs; once stopped, the same training comes back at other resources (2 ranks
    # -> 1) from its checkpoint, and the run keeps its chain of job ids.
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    keys = ["--backend", "local", "--run-dir", str(run), "--set", "train.max_steps=12",
            "--set", "train.eval_every=0", "--set", 'train.model="trainer_plugins:signalling_cnn"']
    # rank 0 waits in its 6th forward call (the 6th step) until the stop signal has reached it
    first = run_cli("submit", SMOKE, *keys, cwd=tmp_path, env={**env, "DDPJOB_TEST_SIGNAL": "0:6:0:pause"})
    assert first.returncode == 0, first.stderr
    job1 = fileio.read_json(run / "job.json")["job_id"]
    deadline = time.monotonic() + 180
    while "paused at call 6" not in (run / "logs" / "rank-0.log").read_text(errors="replace") \
            if (run / "logs" / "rank-0.log").exists() else True:
        assert time.monotonic() < deadline, "rank 0 never reached its 6th forward call"
        time.sleep(0.2)
    again = run_cli("submit", SMOKE, *keys, cwd=tmp_path, env=env)
    assert again.returncode == 1 and f"has job {job1} still RUNNING" in again.stderr, again.stderr
    assert run_cli("cancel", str(run), cwd=tmp_path).returncode == 0
    while fileio.read_record(run / "local.json").get("state") != "CANCELLED":
        assert time.monotonic() < deadline, fileio.read_record(run / "local.json")
        time.sleep(0.2)
    stop = decisions(read_events(run))[-1]
    assert stop["step"] == 6 + LAG, stop  # the step in flight finishes, the vote's, then the checkpoint
    # `ddpjob resume` takes the run's own config (the job file may have changed since)
    second = run_cli("resume", str(run), "--tasks-per-node", "1", "--wait", cwd=tmp_path, env=env,
                     timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "config.json updated" in second.stdout + second.stderr
    done = run_cli("resume", str(run), cwd=tmp_path, env=env)
    assert done.returncode == 1 and "has completed" in done.stderr and done.stderr.count("\n") == 1
    job = fileio.read_json(run / "job.json")
    assert job["job_ids"] == [job1, job["job_id"]] and job["job_id"] != job1
    starts = [e for e in read_events(run) if e.get("event") == "start"]
    assert [(s["world_size"], s.get("resumed_step")) for s in starts] == [(2, None), (1, 6 + LAG)], starts
    assert rundir.completed(run)["step"] == 12


@pytest.mark.parametrize("runtime, expected", [
    ("pyxis", "--container-image=/images/t.sqsh"),
    ("apptainer", "apptainer exec --bind "),
])
def test_the_submitit_script_runs_the_ranks_in_the_container(tmp_path, runtime, expected):
    cfg = jobfile.resolve(SMOKE, ['slurm.container="/images/t.sqsh"', f'slurm.container_runtime="{runtime}"'])
    folder = tmp_path / "run" / "logs"
    folder.mkdir(parents=True)
    script = submitit_slurm.sbatch_text(cfg, folder)
    [srun] = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert expected in srun and "--kill-on-bad-exit=1" in srun, srun
    assert f"{tmp_path / 'run'}" in srun  # the run dir is mounted
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
