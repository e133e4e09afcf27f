"""`ddpjob submit`: parameter mapping to submitit, NodeTask's exit-code contract, dry runs,
one-line errors that leave nothing behind, and (on the test cluster) real submitit jobs."""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ranks import LAG

from ddpjob import cli, config, rundir
from ddpjob.errors import DDPJobError
from ddpjob.launch import submit
from ddpjob.launch.backends import choose, submitit_slurm
from ddpjob.rank.task import NodeTask

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


def cfg_with(**slurm) -> config.JobConfig:
    return config.from_dict({"name": "t", "slurm": slurm})


def run_cli(*argv: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpjob", *argv], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


# ------------------------------------------------------------------ parameter mapping
def test_slurm_parameters_map_every_field():
    cfg = cfg_with(nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8, mem="64G",
                   partition="gpu", account="proj1", qos="high", time="1-02:03:04", constraint="a100",
                   signal_lead_s=300, setup=["module load cuda"],
                   sbatch_extra=["--exclusive", "--mail-type=END"])
    p = submitit_slurm.slurm_parameters(cfg)
    # submitit's own parameter names where it would write a default of its own (job_name:
    # "submitit"), the rest as sbatch options, which submitit writes over its defaults
    keys = ("job_name", "ntasks_per_node", "gpus_per_node", "cpus_per_task", "signal_delay_s", "setup")
    assert {k: p[k] for k in keys} == {
        "job_name": "t", "ntasks_per_node": 4, "gpus_per_node": 4, "cpus_per_task": 8,
        "signal_delay_s": 300, "setup": [*submitit_slurm.guard_lines(cfg, None), "module load cuda"]}
    # submitit's bare srun takes SLURM_NTASKS: after a shrink to 1 node it must be 1 x 4, not 8
    for nodes, expected in (("1", "4 4"), ("2", "8 8"), (None, "8 8")):
        env = {"PATH": "/usr/bin:/bin", **({"SLURM_JOB_NUM_NODES": nodes} if nodes else {})}
        lines = "\n".join([*submitit_slurm.guard_lines(cfg, None)[1:], 'echo "$SLURM_NTASKS $SLURM_NPROCS"'])
        out = subprocess.run(["bash", "-c", lines], env={**env, "SLURM_NTASKS": "8"}, capture_output=True,
                             text=True, timeout=30)
        assert out.stdout.strip() == expected, (nodes, out)
    assert p["srun_args"] == ["--kill-on-bad-exit=1"]  # as in the template
    assert p["time"] == 1 * 1440 + 2 * 60 + 4  # whole minutes, rounded up, for submitit
    assert p["additional_parameters"] == {
        "nodes": 2, "mem": "64G", "partition": "gpu", "account": "proj1", "qos": "high", "time": "1-02:03:04",
        "constraint": "a100", "requeue": True, "open-mode": "append", "signal": "USR2@300",
        "exclusive": True, "mail-type": "END"}


def test_template_and_submitit_scripts_carry_the_same_sbatch_options(tmp_path):
    """One mapping from [slurm] (backends/options.py) feeds both scripts: every #SBATCH option of
    the rendered template but its batch log is in submitit's script, with the same value."""
    from ddpjob.launch import render

    cfg = cfg_with(nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8, mem="64G",
                   partition="gpu", account="proj1", qos="high", time="1-02:03:04", constraint="a100",
                   signal="TERM", signal_lead_s=300, requeue=False,
                   sbatch_extra=["--exclusive", "--mail-type=END"])
    template = render.render_sbatch(cfg, run_dir=tmp_path / "run", python=sys.executable)
    submitit = submitit_slurm.sbatch_text(cfg, tmp_path / "run" / "logs")

    def options(text: str) -> set[str]:
        return {shlex.split(ln)[1] for ln in text.splitlines() if ln.startswith("#SBATCH ")}

    mine = {o for o in options(template) if not o.startswith(("--output=", "--error="))}
    assert len(mine) == 16 and mine <= options(submitit), mine - options(submitit)


def test_the_backend_of_a_run_is_read_from_its_job_record():
    assert choose.of_record({"backend": "local", "job_id": "local-1"}) is choose.LOCAL
    assert choose.of_record({"backend": "slurm", "job_id": "7"}) is choose.SUBMITIT
    assert choose.of_record({"backend": "slurm", "job_id": "7", "via": "sbatch"}) is choose.SBATCH
    assert choose.of_record({}) is None and choose.of_record({"backend": "?"}) is None


def test_cpu_job_has_no_gpu_line_and_empty_fields_are_left_out():
    p = submitit_slurm.slurm_parameters(cfg_with(time="00:00:30", signal_lead_s=10))
    for key in ("gpus_per_node", "mem", "partition", "account", "qos", "constraint"):
        assert key not in p and key.replace("_", "-") not in p["additional_parameters"]
    assert p["setup"] == submitit_slurm.guard_lines(cfg_with(), None)  # only ddpjob's own trap
    assert p["time"] == 1  # 30 s rounds up to one minute; sbatch still gets the exact limit
    assert p["additional_parameters"]["time"] == "00:00:30"


def test_other_signal_and_no_requeue_reach_the_script():
    text = submitit_slurm.sbatch_text(cfg_with(signal="TERM", signal_lead_s=45, requeue=False), Path("/tmp/x/logs"))
    lines = text.splitlines()
    assert "#SBATCH --signal=TERM@45" in lines and "#SBATCH --no-requeue" in lines
    assert not any(ln.startswith("#SBATCH --signal=USR2") for ln in lines)
    assert "#SBATCH --requeue" not in lines


def test_sbatch_text_is_valid_bash_and_quotes_hostile_paths(tmp_path):
    folder = tmp_path / "it's a $(touch pwned) `x`; run" / "logs"
    cfg = cfg_with(nodes=2, tasks_per_node=2, setup=["echo 'setup ran'"])
    points = [folder.parent / str(i) for i in range(3)]
    text = submitit_slurm.sbatch_text(cfg, folder, points)
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lines = text.splitlines()
    # each array task puts its own point's frozen code first (SWEEP/<index>/code/python)
    export = next(ln for ln in lines if ln.startswith("export PYTHONPATH="))
    seen = subprocess.run(["bash", "-c", f'SLURM_ARRAY_TASK_ID=2; PYTHONPATH=/site; {export}; printf %s "$PYTHONPATH"'],
                          capture_output=True, text=True, cwd=tmp_path)
    assert seen.stdout == f"{points[2]}/code/python:/site", seen
    assert not (tmp_path / "pwned").exists()
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue",
                     "#SBATCH --open-mode=append", "#SBATCH --signal=USR2@120", "#SBATCH --array=0-2%3",
                     "echo 'setup ran'"):
        assert expected in lines
    srun = next(ln for ln in lines if ln.startswith("srun "))
    words = shlex.split(srun)
    assert words[-1] == str(folder)  # the folder reaches submitit byte for byte
    assert words[words.index("-m") + 1] == "submitit.core._submit"


# ------------------------------------------------------------------ NodeTask
def test_nodetask_pickles_and_translates_exit_codes(monkeypatch, tmp_path):
    import ddpjob.rank.runner as runner

    task = pickle.loads(pickle.dumps(NodeTask(tmp_path)))
    assert task.run_dir == str(tmp_path)
    calls = []
    codes = iter([0, 3, 1])
    monkeypatch.setattr(runner, "run_node", lambda d, argv=None: calls.append(d) or next(codes))
    assert task() == 0
    with pytest.raises(SystemExit) as stop:  # requeued: no result pickle, like submitit's handler
        task()
    assert stop.value.code == 3
    with pytest.raises(RuntimeError, match="exited with 1"):
        task()
    assert calls == [str(tmp_path)] * 3


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


def test_nodetask_checkpoint_resubmits_the_same_stateless_task(tmp_path):
    task = NodeTask(tmp_path)
    delayed = task.checkpoint()
    assert delayed.function is task and delayed.args == () and delayed.kwargs == {}


def test_pickles_of_jobs_queued_before_nodetask_moved_still_load_without_torch(tmp_path):
    """Jobs queued before ddpjob/rank/task.py pickled ddpjob.launch.submit.NodeTask; the nodes
    unpickle it by that name. launch/submit.py resolves the name lazily: importing it (login
    side) imports neither the rank layer nor torch."""
    old = pickle.dumps(NodeTask(tmp_path), protocol=0).replace(b"cddpjob.rank.task\n", b"cddpjob.launch.submit\n")
    assert b"ddpjob.launch.submit" in old and b"ddpjob.rank" not in old
    code = ("import pickle, sys\n"
            "import ddpjob.launch.submit\n"
            "assert 'ddpjob.rank.task' not in sys.modules and 'torch' not in sys.modules\n"
            f"task = pickle.loads({old!r})\n"
            "from ddpjob.rank.task import NodeTask\n"
            f"assert type(task) is NodeTask and task.run_dir == {str(tmp_path)!r}, task\n"
            "assert 'torch' not in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert submit.NodeTask is NodeTask
    with pytest.raises(AttributeError, match="no attribute 'NotThere'"):
        submit.NotThere  # noqa: B018 (only NodeTask is resolved lazily)


# ------------------------------------------------------------------ backend choice, dry run, errors
def _path_without(tool: str, tmp_path: Path) -> str:
    """PATH with a bin dir holding python only: no sbatch/srun/sinfo."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    return str(bin_dir)


def test_backend_auto_follows_sbatch_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", _path_without("sbatch", tmp_path))
    assert choose.for_request("auto").name == "local"
    fake = tmp_path / "bin" / "sbatch"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert choose.for_request("auto") is choose.SUBMITIT


def test_backend_slurm_without_sbatch_is_one_line_and_writes_nothing(tmp_path):
    env = {**os.environ, "PATH": _path_without("sbatch", tmp_path)}
    out = run_cli("submit", SMOKE, "--backend", "slurm", cwd=tmp_path, env=env)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("ddpjob: error: --backend slurm needs `sbatch`")
    assert "Hint: " in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_dry_run_prints_script_and_rank_view_and_creates_nothing(tmp_path):
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--dry-run", "--nodes", "2",
                  "--set", "train.global_batch_size=256", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=2" in out.stdout and "submitit.core._submit" in out.stdout
    rows = [ln.split() for ln in out.stdout.splitlines() if ln[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[3][1:5] == ["node", "1", "1", "cpu"]
    assert rows[0][-3:] == ["32", "2", "256"]  # batch/rank, accumulation, global batch
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv, code, start", [
    (["--sweep", "train.lr=0.1,-1"], 2, "ddpjob: error: train.lr is -1"),
    (["--sweep", "train.lr"], 2, "ddpjob: error: --sweep 'train.lr' has no '='"),
    (["--sweep", "train.lr=0.1,"], 2, "ddpjob: error: --sweep 'train.lr=0.1,' has an empty value"),
    (["--sweep", "train.nope=1,2"], 2, "ddpjob: error: unknown key 'train.nope'"),
    (["--sweep", "slurm.nodes=1,2"], 2, "ddpjob: error: the sweep varies [slurm] settings"),
    (["--set", "train.lr=abc"], 2, "ddpjob: error: train.lr is 'abc'"),
    (["--nodes", "0"], 2, "ddpjob: error: slurm.nodes is 0"),
])
def test_bad_input_is_one_line_and_leaves_no_run_dir(tmp_path, argv, code, start):
    out = run_cli("submit", SMOKE, "--backend", "local", *argv, cwd=tmp_path)
    assert out.returncode == code, out.stderr
    assert out.stderr.startswith(start) and out.stderr.count("\n") == 1 and "Hint:" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_existing_or_unwritable_run_dir_is_refused(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "config.json").write_text("{}")
    out = run_cli("submit", SMOKE, "--backend", "local", "--run-dir", str(busy), cwd=tmp_path)
    assert out.returncode == 2 and "holds another job" in out.stderr, out.stderr
    (busy / "config.json").unlink()
    (busy / "notes.txt").write_text("mine")
    out = run_cli("submit", SMOKE, "--backend", "local", "--run-dir", str(busy), cwd=tmp_path)
    assert out.returncode == 2 and "is not empty and has no config.json" in out.stderr, out.stderr
    (busy / "config.json").write_text("{}")
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run_cli("submit", SMOKE, "--backend", "local", "--run-dir", str(blocker / "run"), cwd=tmp_path)
    assert out.returncode == 1 and "cannot create run directory" in out.stderr and "Hint:" in out.stderr
    assert (busy / "config.json").read_text() == "{}"


def test_a_failed_submission_removes_the_run_dir_it_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def refuse(*a, **k):
        raise DDPJobError("the scheduler said no", "try later")

    monkeypatch.setattr(choose.LOCAL, "submit", refuse)
    assert cli.main(["submit", SMOKE, "--backend", "local"]) == 1
    assert not (tmp_path / "runs").exists()  # it made runs/ too, and removed it again


# ------------------------------------------------------------------ the real test cluster
def _submit_slurm(tmp_path: Path, *extra: str, timeout: float = 120) -> tuple[Path, dict]:
    import slurmtools

    run = tmp_path / "run"
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--run-dir", str(run), *extra, cwd=tmp_path,
                  timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    job = rundir.read_json(run / "job.json")
    slurmtools.submitted.append(job["job_id"])  # conftest cancels what a failed test leaves
    return run, job


def _wait_step(run: Path, step: int, timeout: float) -> None:
    from ddpjob.launch import runs

    deadline = time.monotonic() + timeout
    while (runs.last_metric(run)[0] or 0) < step:
        assert time.monotonic() < deadline, f"no step {step} in {run}/metrics.jsonl after {timeout}s"
        time.sleep(0.5)


@pytest.mark.cluster
def test_submitit_runs_a_2x2_job_to_completion(slurm_cluster, tmp_path):
    from slurmtools import cluster_free, wait_done, wait_state

    cluster_free()
    t0 = time.monotonic()
    run, job = _submit_slurm(tmp_path, "--nodes", "2", "--set", "train.max_steps=4",
                             "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=2")
    submitted = time.monotonic()
    assert job["backend"] == "slurm" and job["job_id"].isdigit()
    script = (run / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "#SBATCH --signal=USR2@60", "#SBATCH --time=00:15:00"):
        assert line in script.splitlines()
    wait_state(job["job_id"], ("RUNNING", "COMPLETING", "COMPLETED"), timeout=120)
    running = time.monotonic()
    assert wait_done(job["job_id"], timeout=300) == "COMPLETED"
    done = time.monotonic()
    assert rundir.completed(run) is not None and (run / "final" / "model.pt").is_file()
    out = run_cli("status", str(run))
    assert "state       COMPLETED" in out.stdout and "completed   yes" in out.stdout
    for rank in range(4):  # submitit's per-task logs, found through job.json
        assert (run / "logs" / f"{job['job_id']}_{rank}_log.out").is_file()
    log1 = run_cli("logs", str(run), "--rank", "1")
    assert log1.returncode == 0 and "JobEnvironment(" in log1.stdout and "global_rank=1(4)" in log1.stdout
    print(f"\nsubmit command {submitted - t0:.1f}s, submit->RUNNING {running - submitted:.1f}s, "
          f"submit->COMPLETED {done - submitted:.1f}s (2 nodes x 2 tasks, 4 steps)")


@pytest.mark.cluster
def test_usr2_requeues_the_submitit_job_which_resumes_and_completes(slurm_cluster, tmp_path):
    """The requeue contract: USR2 -> checkpoint, scontrol requeue, NodeTask exits 3 without a
    result; the same pickled NodeTask runs again, resumes from the checkpoint and completes."""
    from slurmtools import release_now, wait_done, wait_state

    run, job = _submit_slurm(tmp_path, "--set", "train.max_steps=400", "--set", "train.eval_every=0",
                             "--set", "train.log_every=5", "--set", "checkpoint.every_steps=0")
    jid = job["job_id"]
    wait_state(jid, ("RUNNING",), timeout=120)
    follower = subprocess.Popen([sys.executable, "-m", "ddpjob", "logs", str(run), "--follow"],
                                stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    _wait_step(run, 10, timeout=120)
    subprocess.run(["scancel", "--signal=USR2", jid], check=True, timeout=30)
    wait_state(jid, ("PENDING", "REQUEUED"), timeout=120)
    release_now(jid)
    assert wait_done(jid, timeout=400) == "COMPLETED"
    followed, _ = follower.communicate(timeout=120)  # --follow ends by itself with the job
    assert follower.returncode == 0 and followed.count("ddpjob run ") == 2
    stops = [e for e in rundir.events(run) if e["event"] == "stop"]
    assert stops[0]["reason"] == "time_limit" and stops[0]["requeued"] is True
    assert stops[-1]["reason"] == "finished" and stops[-1]["restart"] == 1
    out = run_cli("status", str(run))
    assert "state       COMPLETED" in out.stdout and "restarts    1" in out.stdout
    log0 = (run / "logs" / f"{jid}_0_log.out").read_text()  # appended across the requeue
    assert log0.count("ddpjob run ") == 2 and "resum" in log0.lower()


@pytest.mark.cluster
def test_unknown_partition_and_sbatch_refusals_are_one_line_and_leave_nothing(slurm_cluster, tmp_path):
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--partition", "nope", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "partition 'nope' does not exist on this cluster (sinfo lists: high, low)" in out.stderr
    assert "Hint: set slurm.partition" in out.stderr
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--set", "slurm.constraint=nosuchfeature",
                  cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ddpjob: error: sbatch refused the job: ") and "Hint:" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_submit_runs_doctors_cheap_checks_first(tmp_path):
    """A job that would fail on the nodes (CIFAR-10 never prepared) is refused on the login
    node, in one line with doctor's hint, and nothing is written."""
    out = run_cli("submit", SMOKE, "--backend", "local", "--set", "data.dataset=cifar10",
                  "--set", f"data.root={tmp_path / 'nodata'}", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("ddpjob: error: preflight check 'dataset' failed")
    assert out.stderr.count("\n") == 1 and "Hint:" in out.stderr and "ddpjob data cifar10" in out.stderr
    assert not (tmp_path / "runs").exists()


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
    job1 = rundir.read_json(run / "job.json")["job_id"]
    deadline = time.monotonic() + 180
    while "paused at call 6" not in (run / "logs" / "rank-0.log").read_text(errors="replace") \
            if (run / "logs" / "rank-0.log").exists() else True:
        assert time.monotonic() < deadline, "rank 0 never reached its 6th forward call"
        time.sleep(0.2)
    again = run_cli("submit", SMOKE, *keys, cwd=tmp_path, env=env)
    assert again.returncode == 1 and f"has job {job1} still RUNNING" in again.stderr, again.stderr
    assert run_cli("cancel", str(run), cwd=tmp_path).returncode == 0
    while rundir.read_record(run / "local.json").get("state") != "CANCELLED":
        assert time.monotonic() < deadline, rundir.read_record(run / "local.json")
        time.sleep(0.2)
    stop = [e for e in rundir.events(run) if e.get("event") == "stop" and "rank" not in e][-1]
    assert stop["step"] == 6 + LAG, stop  # the step in flight finishes, the vote's, then the checkpoint
    # `ddpjob resume` takes the run's own config (the job file may have changed since)
    second = run_cli("resume", str(run), "--tasks-per-node", "1", "--wait", cwd=tmp_path, env=env,
                     timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "config.json updated" in second.stdout + second.stderr
    done = run_cli("resume", str(run), cwd=tmp_path, env=env)
    assert done.returncode == 1 and "has completed" in done.stderr and done.stderr.count("\n") == 1
    job = rundir.read_json(run / "job.json")
    assert job["job_ids"] == [job1, job["job_id"]] and job["job_id"] != job1
    starts = [e for e in rundir.events(run) if e.get("event") == "start"]
    assert [(s["world_size"], s.get("resumed_step")) for s in starts] == [(2, None), (1, 6 + LAG)], starts
    assert rundir.completed(run)["step"] == 12


@pytest.mark.parametrize("runtime, expected", [
    ("pyxis", "--container-image=/images/t.sqsh"),
    ("apptainer", "apptainer exec --bind "),
])
def test_the_submitit_script_runs_the_ranks_in_the_container(tmp_path, runtime, expected):
    cfg = config.resolve(SMOKE, [f'slurm.container="/images/t.sqsh"', f'slurm.container_runtime="{runtime}"'])
    folder = tmp_path / "run" / "logs"
    folder.mkdir(parents=True)
    script = submitit_slurm.sbatch_text(cfg, folder)
    [srun] = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert expected in srun and "--kill-on-bad-exit=1" in srun, srun
    assert f"{tmp_path / 'run'}" in srun  # the run dir is mounted
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
