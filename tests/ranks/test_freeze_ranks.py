"""freeze.py with real runs: a local run whose plugin is edited after submission (`ddpjob run` by
hand refuses its checkpoint with one line, `--allow-code-change` resumes, `ddpjob resume` runs the
frozen code to the same result as an uninterrupted run), and a script that reads data next to it
outside git. What is collected is checked in-process in tests/unit/test_freeze.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from clirun import ddpjob as _cli
from ranks import LAG

from ddpjob import fileio, rundir
from ddpjob import freeze
from ddpjob.ledger.events import read as read_events

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "jobs" / "smoke.toml"


@pytest.mark.slow
def test_a_plugin_edited_after_submission(tmp_path: Path) -> None:
    plug = tmp_path / "plug"
    plug.mkdir()
    shutil.copy(REPO / "tests" / "trainer_plugins.py", plug / "my_plugins.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(plug), str(REPO)])
    keys = ["--backend", "local", "--set", "train.max_steps=12", "--set", "train.eval_every=0",
            "--set", 'train.model="my_plugins:signalling_cnn"']
    ref = _cli("submit", str(SMOKE), *keys, "--run-dir", str(tmp_path / "ref"), "--wait", cwd=tmp_path, env=env)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    run = tmp_path / "run"
    # rank 0 waits in its 6th forward call until the cancel's signal has reached it: stop at 6 + LAG
    first = _cli("submit", str(SMOKE), *keys, "--run-dir", str(run), cwd=tmp_path,
                 env={**env, "DDPJOB_TEST_SIGNAL": "0:6:0:pause"})
    assert first.returncode == 0, first.stderr
    assert (run / "code" / "python" / "my_plugins.py").read_bytes() == (plug / "my_plugins.py").read_bytes()
    deadline = time.monotonic() + 180
    log = run / "logs" / "rank-0.log"
    while not (log.exists() and "paused at call 6" in log.read_text(errors="replace")):
        assert time.monotonic() < deadline, "rank 0 never reached its 6th forward call"
        time.sleep(0.2)
    assert _cli("cancel", str(run), cwd=tmp_path, env=env).returncode == 0
    while fileio.read_record(run / "local.json").get("state") != "CANCELLED":
        assert time.monotonic() < deadline, fileio.read_record(run / "local.json")
        time.sleep(0.2)
    shutil.copytree(run, tmp_path / "copy", symlinks=True)

    # 1. the plugin is edited harmlessly: `ddpjob run` by hand runs the code on disk, whose hash
    #    is not the checkpoint's: one line, exit 1; --allow-code-change resumes (on a copy)
    with open(plug / "my_plugins.py", "a") as f:
        f.write("# edited after submission\n")
    refused = _cli("run", str(run), cwd=tmp_path, env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("ddpjob: error:")]
    assert len(errors) == 1 and f"checkpoint step-{6 + LAG:09d}" not in errors[0], errors
    assert f"step-{6 + LAG} was written by other code" in errors[0] and "--allow-code-change" in errors[0], errors
    allowed = _cli("run", str(tmp_path / "copy"), "--allow-code-change", cwd=tmp_path, env=env)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "resuming anyway (--allow-code-change)" in allowed.stdout
    assert rundir.completed(tmp_path / "copy") is not None

    # 2. now the plugin is broken: `ddpjob resume` runs the frozen copy and finishes, and the
    #    result is the uninterrupted run's
    text = (plug / "my_plugins.py").read_text()
    (plug / "my_plugins.py").write_text('raise RuntimeError("edited after submission")\n' + text)
    status = _cli("status", str(run), cwd=tmp_path, env=env).stdout
    assert "the code on disk has changed since" in status, status
    done = _cli("resume", str(run), "--wait", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # said by plain `resume` too, not only by `status`: one line, before it runs
    (said,) = [ln for ln in done.stdout.splitlines() if "the code on disk has changed" in ln]
    assert "this resume runs the frozen code" in said and f"ddpjob resume {run} --allow-code-change" in said, said
    starts = [e for e in read_events(run) if e.get("event") == "start"]
    assert [s.get("resumed_step") for s in starts] == [None, 6 + LAG], starts
    import torch

    final, ref_final = (torch.load(d / "final" / "model.pt", weights_only=True) for d in (run, tmp_path / "ref"))
    assert final.keys() == ref_final.keys() and all(torch.equal(final[k], ref_final[k]) for k in final)


@pytest.mark.slow
def test_a_script_reads_the_data_next_to_it_outside_git(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "scale.txt").write_text("2.0\n")
    with open(job / "big.bin", "wb") as f:
        f.truncate(freeze.FOLDER_BYTES + 1)
    (job / "train.py").write_text(
        "import os\nimport torch\nimport ddpjob\n\njob = ddpjob.init()\n"
        "scale = float(open(os.path.join(os.path.dirname(__file__), 'scale.txt')).read())\n"
        "model = job.wrap(torch.nn.Linear(2, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "state = {'model': model, 'opt': opt}\njob.resume(state)\n"
        "for step in job.steps(state, 2):\n"
        "    loss = model(torch.ones(4, 2)).pow(2).mean() * scale\n"
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n    job.log(step + 1, loss=loss)\n"
        "job.finish(model)\n")
    (tmp_path / "job.toml").write_text(f'name = "plain"\n[train]\nentry = "{job / "train.py"}"\nthreads = 1\n'
                                       '[slurm]\ntasks_per_node = 1\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    r = _cli("submit", str(tmp_path / "job.toml"), "--backend", "local", "--wait", "--run-dir",
             str(tmp_path / "run"), cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("ddpjob: warning: the entry's folder")]
    assert "left out big.bin (64 MB)" in line and " Hint: " in line, line
    assert (tmp_path / "run" / "COMPLETED").exists()
    assert (tmp_path / "run" / "code" / "entry" / "scale.txt").read_text() == "2.0\n"
    assert not (tmp_path / "run" / "code" / "entry" / "big.bin").exists()
