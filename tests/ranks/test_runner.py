"""`ddpjob run`: the same job under every launcher, the shared run dir, exit codes, the
requeue policy, and (marker `cluster`) 2 nodes x 2 tasks under a real srun.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from ddpjob import jobfile
from ddpjob.ledger.events import read as read_events
from ranks import PYTHON, assert_bit_equal, base_env, free_port, final_state, metrics, run, write_job

NOBN = dict(model="trainer_plugins:conv_nobn", max_steps=12, batch_size=32, global_batch_size=64,
            lr=0.05, warmup_steps=2, log_every=1, amp="off", channels_last=False, seed=5, threads=1)
DATA = dict(dataset="synthetic", synthetic_train=768, synthetic_test=256, augment=True)


def _cmd(args: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env or base_env(), capture_output=True, text=True,
                          timeout=timeout)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_same_job_under_torchrun_legacy_launch_and_alone(tmp_path: Path) -> None:
    """torchrun and torch.distributed.launch (--local-rank in argv) give bit-identical runs;
    one plain process with the same global batch (accumulation 2 instead of 2 ranks) gives
    the same weights up to float32 summation order (model without BN; see test_equivalence)."""
    job = write_job(tmp_path / "job.toml", train=NOBN, data=DATA)
    torchrun = str(Path(PYTHON).parent / "torchrun")
    launches = {
        "torchrun": [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
                     "-m", "ddpjob", "run", str(job), "--run-dir", str(tmp_path / "torchrun")],
        "legacy": [PYTHON, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
                   "--master-port", str(free_port()), "-m", "ddpjob", "run", str(job),
                   "--run-dir", str(tmp_path / "legacy")],
        "alone": [PYTHON, "-m", "ddpjob", "run", str(job), "--run-dir", str(tmp_path / "alone")],
    }
    for name, args in launches.items():
        out = _cmd(args, tmp_path)
        assert out.returncode == 0, f"{name}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert (tmp_path / name / "COMPLETED").is_file()
    starts = {n: [e for e in read_events(tmp_path / n) if e["event"] == "start"][0] for n in launches}
    assert {n: (s["world_size"], s["accumulation"]) for n, s in starts.items()} == {
        "torchrun": (2, 1), "legacy": (2, 1), "alone": (1, 2)}
    a, opt_a = final_state(tmp_path / "torchrun")
    b, opt_b = final_state(tmp_path / "legacy")
    assert_bit_equal(a, b, "model")
    assert_bit_equal(opt_a["state"], opt_b["state"], "optimizer")
    c, _ = final_state(tmp_path / "alone")
    assert _diff(a, c) < 2e-5
    la = [r["loss"] for _, r in sorted(metrics(tmp_path / "torchrun").items())]
    lc = [r["loss"] for _, r in sorted(metrics(tmp_path / "alone").items())]
    assert la == pytest.approx(lc, abs=1e-5)


def test_toml_target_without_run_dir_gives_every_rank_the_same_new_dir(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml", train={**NOBN, "max_steps": 2}, data=DATA)
    codes, r = run([str(job)], 2, tmp_path / "logs", job_id=None, cwd=tmp_path)  # plain torchrun
    assert codes == [0, 0], r.output()
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("t-"), dirs
    assert (dirs[0] / "COMPLETED").is_file()
    assert jobfile.read_run_config(dirs[0]).train.max_steps == 2


def test_toml_target_with_a_job_id_reuses_its_run_dir(tmp_path: Path) -> None:
    """Under SLURM (or the local backend) the dir is runs/<name>-<job id>: a requeued
    `srun ddpjob run job.toml` finds its checkpoints, and one that already finished is a no-op."""
    job = write_job(tmp_path / "job.toml", train={**NOBN, "max_steps": 2}, data=DATA)
    env = base_env({"DDPJOB_JOB_ID": "4242"})
    first = _cmd([PYTHON, "-m", "ddpjob", "run", str(job)], tmp_path, env)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "runs" / "t-4242" / "COMPLETED").is_file()
    again = _cmd([PYTHON, "-m", "ddpjob", "run", str(job)], tmp_path, env)
    assert again.returncode == 0 and "already completed" in again.stdout


def test_run_dir_of_another_job_is_refused(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml", train={**NOBN, "max_steps": 1}, data=DATA)
    other = write_job(tmp_path / "other.toml", train={**NOBN, "max_steps": 1, "lr": 0.5}, data=DATA)
    assert _cmd([PYTHON, "-m", "ddpjob", "run", str(job), "--run-dir", "r"], tmp_path).returncode == 0
    (tmp_path / "r" / "COMPLETED").unlink()
    out = _cmd([PYTHON, "-m", "ddpjob", "run", str(other), "--run-dir", "r"], tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpjob: error: run directory") and "Hint:" in lines[0]


@pytest.mark.parametrize("left_standing", [False, True])
def test_a_failed_rank_with_its_group_standing_ends_without_the_teardown(tmp_path: Path,
                                                                          left_standing: bool) -> None:
    """cli.console, the `ddpjob` command: once a failed rank left its process group standing
    (dist.left_standing), the process ends with its status and without the interpreter's
    teardown, which could abort in torch's destructors (SIGABRT instead of exit 1: about one
    2-rank failure in six, tests/ranks/test_fsdp.py's init_from refusal); otherwise it exits normally."""
    code = ("import atexit, sys; from ddpjob import cli; from ddpjob.node import dist; "
            "atexit.register(lambda: print('teardown ran', flush=True)); "
            f"dist.left_standing = {left_standing}; "
            f"sys.argv = ['ddpjob', 'logs', {str(tmp_path / 'nope')!r}]; cli.console()")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=base_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.startswith("ddpjob: error:") and len(out.stderr.strip().splitlines()) == 1
    assert ("teardown ran" in out.stdout) is not left_standing


@pytest.mark.parametrize("body, found", [
    ("job = ddpjob.init()\nlr = job.user['learning_rate']\n",
     "rank 0: your code raised KeyError: 'learning_rate' is not in the job file's [user] table, which has: "
     "lr, width at train.py:3"),
    ("job = ddpjob.init()\nimport torch\ntorch.zeros(2) @ torch.zeros(3)\n", "rank 0: your code raised RuntimeError: "),
    ("job = ddpjob.init(\n", "rank 0: your code raised SyntaxError: '(' was never closed at train.py:2"),
])
def test_an_error_in_the_users_own_script_is_theirs_not_an_internal_error(tmp_path: Path, body: str,
                                                                          found: str) -> None:
    """One line naming the rank, the exception and their line; the traceback stays in the log."""
    script = tmp_path / "train.py"
    script.write_text("import ddpjob\n" + body)
    job = write_job(tmp_path / "job.toml", train={"entry": str(script)}, user={"lr": 0.1, "width": 2})
    out = _cmd([PYTHON, "-m", "ddpjob", "run", str(job), "--run-dir", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("ddpjob: error:")]
    assert len(lines) == 1 and found in lines[0], out.stderr[-3000:]
    assert "internal error" not in out.stderr and f"Hint: fix it in {script}" in lines[0]
    assert "Traceback (most recent call last)" in out.stderr  # for the log


def test_an_entry_script_with_nul_bytes_is_one_line_naming_it(tmp_path: Path) -> None:
    """Python refuses it with a SyntaxError that names no file: it was an "internal error"."""
    script = tmp_path / "train.py"
    script.write_bytes(b"import ddpjob\x00\n")
    job = write_job(tmp_path / "job.toml", train={"entry": str(script)})
    out = _cmd([PYTHON, "-m", "ddpjob", "run", str(job), "--run-dir", str(tmp_path / "run")], tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith(f"ddpjob: error: train.entry {script} contains NUL bytes"), out.stderr[-3000:]
    assert "internal error" not in out.stderr
