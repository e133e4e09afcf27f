"""`ddpjob submit`: parameter mapping to submitit, NodeTask's exit-code contract, dry runs,
one-line errors that leave nothing behind, and (on the test cluster) real submitit jobs."""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import ddpjob as run_cli
from ddpjob import cli, config, jobfile
from ddpjob.errors import DDPJobError
from ddpjob.launch import submit
from ddpjob.launch.backends import choose, submitit_slurm
from ddpjob.rank.task import NodeTask

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


def cfg_with(**slurm) -> config.JobConfig:
    return jobfile.from_dict({"name": "t", "slurm": slurm})


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
        lines = "\n".join([*submitit_slurm.guard_lines(cfg, None), 'echo "$SLURM_NTASKS $SLURM_NPROCS"'])
        out = subprocess.run(["bash", "-c", lines], env={**env, "SLURM_NTASKS": "8"}, capture_output=True,
                             text=True, timeout=30)
        assert out.stdout.strip() == expected, (nodes, out)
    assert p["srun_args"] == ["--kill-on-bad-exit=1"]  # as in the template
    assert p["time"] == 1 * 1440 + 2 * 60 + 4  # whole minutes, rounded up, for submitit
    assert p["additional_parameters"] == {
        "nodes": 2, "mem": "64G", "partition": "gpu", "account": "proj1", "qos": "high", "time": "1-02:03:04",
        "constraint": "a100", "requeue": True, "open-mode": "append", "signal": "USR2@300",
        "exclusive": True, "mail-type": "END"}


def _srun_loop(tmp_path: Path, srun_body: str, decide_body: str) -> tuple[int, list[str], str]:
    """Run submitit's srun line through the guard's shell function, with a fake `srun` on PATH
    and a fake decision in place of `python -m ddpjob.rank.requeue`. Returns (status, srun's
    argument lines, what the decision was asked)."""
    from ddpjob.rank.requeue import ATTEMPT_MARK

    cfg = cfg_with(nodes=2, tasks_per_node=2)
    lines = submitit_slurm.guard_lines(cfg, tmp_path / "run" / "logs", [tmp_path / "run"])
    lines = [ln for ln in lines if "PYTHONPATH" not in ln and "find " not in ln]  # no folder checks here
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "srun").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/srun-args\n{srun_body}\n")
    (bin_ / "decide").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path}/asked\n{decide_body}\n")
    for f in ("srun", "decide"):
        (bin_ / f).chmod(0o755)
    script = "\n".join([*lines, "srun --unbuffered --kill-on-bad-exit=1 python -u -m submitit.core._submit F",
                        'echo "exit $?"']).replace(shlex.quote(sys.executable), str(bin_ / "decide"))
    out = subprocess.run(["bash", "-c", script], env={"PATH": f"{bin_}:/usr/bin:/bin", "SLURM_JOB_NUM_NODES": "2"},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.stderr.startswith(ATTEMPT_MARK + "0: ranks on 2 node(s)"), out.stderr  # the decision's mark
    args = (tmp_path / "srun-args").read_text().splitlines()
    asked = (tmp_path / "asked").read_text() if (tmp_path / "asked").exists() else ""
    return int(out.stdout.split()[-1]), args, asked


def test_the_submitit_script_runs_a_crashed_job_again_inside_its_allocation(tmp_path):
    """Submitit's one srun line goes through the guard's `srun` function: a crash asks ddpjob's
    decision, and on RESTART (4) the ranks run again on the nodes it names, excluded host left
    out; a stop for a requeue (3), a finish, a "no" from the decision or a signal to the batch
    shell end the loop with srun's status."""
    crash_once = f'[ -e {tmp_path}/crashed ] && exit 0; touch {tmp_path}/crashed; exit 137'
    status, args, asked = _srun_loop(tmp_path, crash_once, 'echo "ddpjob: excluding n2" >&2; echo "1 n2"; exit 4')
    assert status == 0 and len(args) == 2, args
    assert args[0] == "--nodes=2 --ntasks=4 --unbuffered --kill-on-bad-exit=1 python -u -m submitit.core._submit F"
    assert args[1] == ("--nodes=1 --ntasks=2 --exclude=n2 --unbuffered --kill-on-bad-exit=1 python -u -m "
                       "submitit.core._submit F")
    assert asked.split() == ["-m", "ddpjob.rank.requeue", str(tmp_path / "run"), "137"]
    for srun_body, decide_body, expected in (("exit 3", "exit 4", 3), ("exit 0", "exit 4", 0),
                                             ("exit 1", "exit 1", 1),
                                             ("kill -TERM $PPID; sleep 0.2; exit 143", "exit 4", 143)):
        for f in ("srun-args", "asked", "crashed"):
            (tmp_path / f).unlink(missing_ok=True)
        status, args, asked = _srun_loop(tmp_path, srun_body, decide_body)
        assert (status, len(args)) == (expected, 1), (srun_body, status, args)
        assert bool(asked) == (expected == 1), (srun_body, asked)  # asked only after a crash with no signal


def test_template_and_submitit_scripts_carry_the_same_sbatch_options(tmp_path):
    """One mapping from [slurm] (launch/slurmopts.py) feeds both scripts: every #SBATCH option of
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
    # 2 tasks a node: submitit's command runs through the node's warm-start server
    assert words[-4:-1] == ["-u", "-m", "submitit.core._submit"], words
    assert words[words.index("-m") + 1:words.index("-m") + 3] == ["ddpjob.node.warm", "run"], words


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


def test_submit_runs_doctors_cheap_checks_first(tmp_path):
    """A job that would fail on the nodes (CIFAR-10 never prepared) is refused on the login
    node, in one line with doctor's hint, and nothing is written."""
    out = run_cli("submit", SMOKE, "--backend", "local", "--set", "data.dataset=cifar10",
                  "--set", f"data.root={tmp_path / 'nodata'}", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("ddpjob: error: preflight check 'dataset' failed")
    assert out.stderr.count("\n") == 1 and "Hint:" in out.stderr and "ddpjob data cifar10" in out.stderr
    assert not (tmp_path / "runs").exists()
