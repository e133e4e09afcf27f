"""`ddpjob verify` as a user meets its edges: a [train] command job is refused in one line before
anything runs (nothing of the user's is touched), and verify ended by SIGTERM ends its run too
(its supervisor is detached: it would train on in a folder verify removes)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from clirun import REPO, ddpjob, wait_for
from ranks import base_env, write_job

from ddpjob import fileio
from ddpjob.launch.backends.local_procs import pid_alive


def test_verify_refuses_a_command_in_one_line_before_running_anything(tmp_path: Path) -> None:
    (tmp_path / "snapshot.pt").write_bytes(b"the user's own")
    job = write_job(tmp_path / "job.toml", train=dict(command=["python", "train.py"]))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = ddpjob("verify", str(job), cwd=tmp_path, env=base_env({"TMPDIR": str(tmp)}))
    assert out.returncode == 2 and out.stdout == "", out
    [line] = out.stderr.splitlines()
    assert line.startswith("ddpjob: error: ") and "runs the command 'python train.py'" in line and "Hint:" in line
    assert list(tmp.iterdir()) == [] and (tmp_path / "snapshot.pt").read_bytes() == b"the user's own"


def test_verify_ended_by_sigterm_ends_its_run(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "ddpjob", "verify", str(REPO / "examples" / "charlm" / "job.toml")],
                            cwd=REPO, env=base_env({"TMPDIR": str(tmp)}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        ref = wait_for(lambda: next(iter(tmp.glob("ddpjob-verify-*/reference/job.json")), None), 240,
                       "verify's reference run")
        pid = wait_for(lambda: (fileio.read_json(ref) or {}).get("pid"), 60, "its supervisor's pid")
        assert pid_alive(pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    wait_for(lambda: not pid_alive(pid), 90, "the reference run's supervisor to end")
    assert list(tmp.iterdir()) == [], "verify left its run dirs behind"
