"""The public API (ddpjob.init, Job, StepSampler) driven by a user script (tests/api_script.py)
in real processes: alone, and as 2 ranks under `ddpjob run` with a stop caused at a chosen step,
a resume, and a result bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clirun import ddpjob as ddpjob_cli
from ranks import LAG, TESTS, Ranks, assert_bit_equal, base_env, events, final_state, free_port, metrics, write_job
from runlogs import decisions, stops

SCRIPT = TESTS / "api_script.py"


def _job(path: Path, stop_vote: str = "overlap", **user: object) -> Path:
    return write_job(path, train={"entry": str(SCRIPT), "threads": 1, "stop_vote": stop_vote},
                     checkpoint={"every_steps": 5, "keep_last": 2}, user={"steps": 20, **user})


def _two_ranks(job: Path, run_dir: Path, restart: int) -> tuple[list[int], Ranks]:
    ranks = Ranks([str(job), "--run-dir", str(run_dir)], 2, run_dir.parent / "logs",
                  job_id="api", restart=restart)
    return ranks.wait(180), ranks


def test_script_started_alone_makes_its_own_run_dir(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=base_env(),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = (tmp_path / "runs").iterdir()
    done = json.loads((run / "COMPLETED").read_text())
    assert done["step"] == 20 and done["seen"] == 20 * 16 and done["note"] == "at 20"
    weights = torch.load(run / "final" / "model.pt", weights_only=True)
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias"}  # no DDP prefix
    assert sorted(metrics(run)) == list(range(1, 21))
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    assert {p.name for p in ckpt.iterdir()} >= {"model.pt", "optimizer.pt", "scheduler.pt",
                                                "sampler.pt", "counter.pt", "values.pt", "rank-0.pt"}


@pytest.mark.parametrize("vote", ["overlap", "sync"])
def test_a_checkpoint_on_every_due_step_with_either_vote(tmp_path: Path, vote: str) -> None:
    """checkpoint.every_steps = 1: steps 1..6 each get a checkpoint, the first one too (no
    overlapped vote is in flight yet after the first step: the step schedule decides alone)."""
    job = write_job(tmp_path / "job.toml", train={"entry": str(SCRIPT), "threads": 1, "stop_vote": vote},
                    checkpoint={"every_steps": 1, "keep_last": 10}, user={"steps": 6})
    codes, ranks = _two_ranks(job, tmp_path / "run", 0)
    assert codes == [0, 0], ranks.output()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved == [f"step-{s:09d}" for s in range(1, 7)], saved


@pytest.mark.parametrize("workers, vote", [(0, "overlap"), (2, "overlap"), (0, "sync")])
def test_stop_at_a_step_then_resume_is_bit_identical(tmp_path: Path, workers: int, vote: str) -> None:
    """Rank 1 alone gets SIGUSR2 during step 7; both ranks stop after step 8 + lag (the vote
    started at that boundary is read one step later; train.stop_vote = "sync": at once), write
    the checkpoint and exit 3; the second start resumes there and ends exactly like an
    uninterrupted run: weights, every logged loss, the user's counter."""
    lag = LAG if vote == "overlap" else 0
    ref_job = _job(tmp_path / "ref.toml", workers=workers)
    codes, ranks = _two_ranks(ref_job, tmp_path / "ref", 0)
    assert codes == [0, 0], ranks.output()

    job = _job(tmp_path / "job.toml", vote, workers=workers, signal_at="1:7")
    codes, ranks = _two_ranks(job, tmp_path / "run", 0)
    assert codes == [3, 3], ranks.output()
    stop = decisions(events(tmp_path / "run"))[-1]
    assert stop["reason"] == "time_limit" and stop["step"] == 8 + lag
    (signal,) = [e for e in events(tmp_path / "run") if e["event"] == "signal"]
    assert signal["rank"] == 1 and signal["signal"] == "SIGUSR2" and signal["at_step"] == 7
    assert (tmp_path / "run" / "checkpoints" / f"step-{8 + lag:09d}" / "manifest.json").is_file()
    assert not (tmp_path / "run" / "COMPLETED").exists()

    codes, ranks = _two_ranks(job, tmp_path / "run", 1)
    assert codes == [0, 0], ranks.output()
    assert f"resumed from step-{8 + lag:09d}" in ranks.output(0)
    a = torch.load(tmp_path / "ref" / "final" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final" / "model.pt", weights_only=True)
    assert_bit_equal(a, b, "final model")
    ref_losses = {s: r["loss"] for s, r in metrics(tmp_path / "ref").items()}
    run_losses = {s: r["loss"] for s, r in metrics(tmp_path / "run").items()}
    assert run_losses == ref_losses and len(run_losses) == 20
    done = json.loads((tmp_path / "run" / "COMPLETED").read_text())
    assert done["seen"] == 20 * 8 and done["note"] == "at 20"  # per rank: 8 samples a step


def test_samples_are_each_seen_once_per_epoch_across_the_stop(tmp_path: Path) -> None:
    job = _job(tmp_path / "job.toml", signal_at="0:3", steps=32)  # 256 / 16 = 16 steps an epoch
    assert _two_ranks(job, tmp_path / "run", 0)[0] == [3, 3]
    assert _two_ranks(job, tmp_path / "run", 1)[0] == [0, 0]
    newest: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for path in (tmp_path / "run" / "samples").glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            key = (r["step"], r["rank"])
            if key not in newest or r["restart"] >= newest[key][0]:
                newest[key] = (r["restart"], r["ids"])
    for epoch in range(2):
        ids = [i for (step, _), (_, got) in newest.items() if epoch * 16 < step <= (epoch + 1) * 16
               for i in got]
        assert sorted(ids) == list(range(256)), f"epoch {epoch}: repeats or gaps"


def _torchrun(script: Path, job: Path) -> list[str]:
    """A real torchrun of `script` on 2 local ranks (no `ddpjob run` around it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), str(script), str(job)]


def test_a_rank_that_raises_under_torchrun_ends_the_job_at_once(tmp_path: Path) -> None:
    """The script on the API under a real torchrun (no `ddpjob run` around it); rank 1 raises in
    step 3 while rank 0 goes on into DDP's gradient all-reduce. Rank 1 exits 1 at once (no exit
    barrier: that held it for the whole dist_timeout_s while rank 0 waited in the all-reduce),
    so torchrun ends rank 0 and the job fails with rank 1 as its root cause. dist_timeout_s is an
    hour: nothing but that early exit ends the job within the test's timeout."""
    job = write_job(tmp_path / "job.toml", train={"threads": 1, "dist_timeout_s": 3600},
                    user={"steps": 20, "raise_at": "1:3"})
    out = subprocess.run(_torchrun(SCRIPT, job), cwd=tmp_path, env=base_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ValueError: a bug in the user's code at step 3" in out.stderr
    cause = out.stderr[out.stderr.index("Root Cause"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: 1 ", cause), cause
    assert "terminate called" not in out.stderr and "SIGABRT" not in out.stderr, out.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "COMPLETED").exists()


def test_torchrun_max_restarts_resumes_a_killed_rank_bit_identical(tmp_path: Path) -> None:
    """`torchrun --max-restarts 2` around the script, rank 1 SIGKILLed in step 7 (before its
    backward): torchrun's agent ends rank 0 and starts both again. The new round finds the run
    dir (runs/<name>-torchrun-<agent pid>), builds its group on keys of its own in the agent's
    store (before, it read the last round's gloo addresses and hung), resumes from the
    checkpoint at step 5 and ends bit-identical to an uninterrupted torchrun."""
    runs = {}
    for name, user in (("plain", {}), ("killed", {"die_at": "1:7"})):
        folder = tmp_path / name
        folder.mkdir()
        job = write_job(folder / "job.toml", train={"threads": 1, "dist_timeout_s": 60},
                        checkpoint={"every_steps": 5}, user={"steps": 20, **user})
        cmd = _torchrun(SCRIPT, job)
        cmd[3:3] = ["--max-restarts", "2"]
        out = subprocess.run(cmd, cwd=folder, env=base_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        (runs[name],) = (folder / "runs").iterdir()
    starts = [e for e in events(runs["killed"]) if e["event"] == "start"]
    assert [(s["restart"], s["resumed_step"]) for s in starts] == [(0, None), (1, 5)], starts
    # the round torchrun ended got its verdict from the next round's rank 0 (rank/rounds.py),
    # counted against max_failures like a SLURM restart in place
    (crash,) = stops(events(runs["killed"]))
    assert (crash["reason"], crash["verdict"], crash["action"], crash["requeued_by"], crash["restart"]) == \
        ("crash", "infrastructure", "restart", "torchrun", 0), crash
    assert crash["line"].startswith("restarting in place from the checkpoint of step 5") and \
        crash["line"].endswith("failure 1 of max_failures = 20"), crash
    # the killed rank is the culprit, not rank 0 whose all-reduce saw it go
    assert crash["failed_rank"] == 1 and "ended without a word" in crash["failed_how"], crash
    assert "ddpjob: crash verdict: infrastructure (rank 1 on " in out.stderr and "restarting in place" in out.stderr
    assert "attempt     crash at step 5" in ddpjob_cli("status", str(runs["killed"]), check=True).stdout
    assert runs["killed"].name.startswith("t-torchrun-")
    assert_bit_equal(final_state(runs["plain"]), final_state(runs["killed"]), "final")  # model, optimizer
    done = [json.loads((runs[n] / "COMPLETED").read_text()) for n in ("plain", "killed")]
    assert done[0]["note"] == done[1]["note"] == "at 20" and done[1]["step"] == 20


def test_a_users_bug_under_torchrun_max_restarts_is_named_and_not_run_again(tmp_path: Path) -> None:
    """`torchrun --max-restarts 2`, rank 1 raises in step 3 in every round: torchrun starts the
    ranks again twice, and without a verdict the bug ran three times. The second round's rank 0
    decides the first round (rank/rounds.py): the user's ValueError at its line, not retried; that
    round and the third refuse to train, and the torchrun fails in the verdict's words."""
    job = write_job(tmp_path / "job.toml", train={"threads": 1, "dist_timeout_s": 3600},
                    checkpoint={"every_steps": 5}, user={"steps": 20, "raise_at": "1:3"})
    cmd = _torchrun(SCRIPT, job)
    cmd[3:3] = ["--max-restarts", "2"]
    out = subprocess.run(cmd, cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    (run,) = (tmp_path / "runs").iterdir()
    evs = events(run)
    assert [e["restart"] for e in evs if e["event"] == "start"] == [0], evs  # trained once
    decided = stops(evs)
    crash = decided[0]
    assert (crash["reason"], crash["verdict"], crash["action"], crash["restart"]) == ("crash", "user", "end", 0), crash
    assert crash["line"].startswith("not retried: rank 1's ValueError at api_script.py:"), crash
    # the later rounds: refused at their start, each with the first round's verdict
    assert [d["reason"] for d in decided[1:]] == ["budget", "budget"], decided
    assert all("round 0 of this torchrun was decided: not retried: rank 1's ValueError" in d["note"]
               for d in decided[1:]), decided
    assert "not retried: rank 1's ValueError at api_script.py:" in out.stderr
    assert not (run / "COMPLETED").exists()


SLOW_HOOK_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
import ddpjob

job = ddpjob.init(sys.argv[1] if len(sys.argv) > 1 else None)  # under ddpjob run: its job file
model = job.wrap(torch.nn.Linear(8, 4))
calls = 0


class Flush:  # what a user's hook may hold: a write that still runs when the script ends
    def __del__(self) -> None:
        time.sleep(2)
        print(f"rank {job.rank}: hook flushed", flush=True)


def hook(state, bucket):  # DDP runs `then` callbacks (and frees them) in gloo's worker threads
    global calls
    calls += 1
    keep = Flush() if calls == 3 else None
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: (keep, f.value()[0])[1])


model.register_comm_hook(None, hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optimizer": opt}
job.resume(state)
for step in job.steps(state, 3):
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
job.finish(model)
print(f"rank {job.rank}: script done", flush=True)
"""


@pytest.mark.parametrize("launcher", ["torchrun", "ddpjob"])
def test_the_groups_threads_end_before_the_interpreter(tmp_path: Path, launcher: str) -> None:
    """A Python comm hook's last callback is freed by a gloo worker thread that is still busy
    (2 s) when the script ends. The run's end (close) frees the process groups, which waits for
    that thread: every rank prints its hook's line and exits 0. Before, the groups (held by
    DDP) outlived close and the thread met the interpreter's finalization: the rank ended
    without the line (the process was gone) or with SIGABRT ("terminate called without an
    active exception") when the finalization was slow."""
    script = tmp_path / "slow_hook.py"
    script.write_text(SLOW_HOOK_SCRIPT)
    job = write_job(tmp_path / "job.toml", slurm={"tasks_per_node": 2},
                    train={"threads": 1, "entry": str(script)})
    if launcher == "torchrun":
        cmd = _torchrun(script, job)
    else:
        cmd = [sys.executable, "-m", "ddpjob", "submit", str(job), "--backend", "local", "--wait"]
    out = subprocess.run(cmd, cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    if launcher == "ddpjob":
        (run,) = (tmp_path / "runs").iterdir()
        text += "".join(p.read_text() for p in sorted(run.glob("**/*.log")))
    assert out.returncode == 0, text
    for rank in (0, 1):
        assert f"rank {rank}: script done" in text and f"rank {rank}: hook flushed" in text, text
    assert "terminate called" not in text, text


def test_bad_state_keys_are_refused_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import ddpjob, torch\njob = ddpjob.init()\n"
                      "job.resume({'my model': torch.nn.Linear(2, 2)})\n")
    out = subprocess.run([sys.executable, "-m", "ddpjob", "run", str(write_job(
        tmp_path / "job.toml", train={"entry": str(script)}))], cwd=tmp_path, env=base_env(),
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("ddpjob: error:")]
    assert len(errors) == 1 and "'my model'" in errors[0] and "Hint:" in errors[0]
    assert "Traceback" not in out.stderr
