"""`ddpjob plot` and `plot.summary`: a real training run, interrupted twice and resumed, drawn as
a PNG whose restart markers sit at the resumed steps with the stop reasons; a sweep overlaid;
the one-line message when matplotlib is missing."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ddpjob.cli import main
from ddpjob.launch import history, plot, summary
from ddpjob.ledger import phases
from ranks import LAG, Ranks, events, run, signal_when_paused, write_job
from runlogs import decisions

pytest.importorskip("matplotlib")  # the `plot` extra; in the `test` extra too

TRAIN = dict(model="trainer_plugins:signalling_cnn", batch_size=32, lr=0.05, warmup_steps=2, max_steps=24, log_every=1,
             eval_every=6, amp="off", channels_last=False, threads=1, seed=3)
DATA = dict(dataset="synthetic", synthetic_train=256, synthetic_test=64, augment=False)


@pytest.fixture(scope="module")
def requeued_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank trains 24 steps; SIGUSR2 in step 8 (requeue), SIGTERM in step 16 (preemption:
    what SLURM sends), each followed by a restart that resumes from the checkpoint written at
    the stop. The rank pauses in the 8th training forward call of each incarnation until the
    test's signal has reached it."""
    tmp = tmp_path_factory.mktemp("plotrun")
    job = write_job(tmp / "job.toml", train=TRAIN, data=DATA,
                    checkpoint=dict(every_steps=0, keep_last=2), slurm=dict(max_requeues=3))
    out = tmp / "run"
    for restart, sig in enumerate([signal.SIGUSR2, signal.SIGTERM]):
        args = [str(job), "--run-dir", str(out)] if restart == 0 else [str(out)]
        ranks = Ranks(args, 1, tmp / "logs", restart=restart,
                      extra_env={"DDPJOB_TEST_SIGNAL": f"0:8:{restart}:pause"})
        signal_when_paused(ranks, 0, sig)
        assert ranks.wait(120) == [3], ranks.output()
    codes, r = run([str(out)], 1, tmp / "logs", restart=2)
    assert codes == [0], r.output()
    return out


def _stops_and_starts(run_dir: Path) -> tuple[list[dict], list[dict]]:
    ev = events(run_dir)
    return decisions(ev), [e for e in ev if e["event"] == "start"]


@pytest.mark.slow
def test_plot_of_a_requeued_run_has_markers_at_the_resumed_steps(requeued_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    stops, starts = _stops_and_starts(requeued_run)
    assert [s["reason"] for s in stops] == ["time_limit", "preemption", "finished"]
    # rank 0 alone marks the end of each attempt's first step, once
    firsts = [e for e in events(requeued_run) if e["event"] == "first_step"]
    assert [(e["restart"], e["step"]) for e in firsts] == [(r, (s.get("resumed_step") or 0) + 1)
                                                          for r, s in enumerate(starts)], firsts
    resumed = [s["resumed_step"] for s in starts[1:]]
    assert resumed == [stops[0]["step"], stops[1]["step"]] == [8 + LAG, 16 + 2 * LAG]

    png = tmp_path / "curves.png"
    record = plot.plot_runs([requeued_run], png)
    assert record.markers == {"run": [(resumed[0], "restart 1: time_limit"),
                                      (resumed[1], "restart 2: preemption")]}
    assert all(record.series[key] == ["run"] for key, _ in history.PANELS)

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    from PIL import Image

    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.size[0] > 1000 and im.size[1] > 700
        # not a blank canvas: many distinct colours (curves, text, markers)
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 50

    # The CLI: same markers, listed in its message.
    code = main(["plot", str(requeued_run), "-o", str(tmp_path / "cli.png")])
    out = capsys.readouterr().out
    assert code == 0 and (tmp_path / "cli.png").stat().st_size > 20_000
    assert f"step {resumed[0]}  restart 1: time_limit" in out and "2 restart marker(s)" in out
    assert out.count("; recovery: stop vote ") == 2, out  # the phases, as status shows them
    assert main(["status", str(requeued_run)]) == 0
    status = capsys.readouterr().out
    assert status.count("\n  recovery  stop vote ") == 2 and "first step" in status, status


@pytest.mark.slow
def test_summary_of_a_requeued_run(requeued_run: Path) -> None:
    stops, _ = _stops_and_starts(requeued_run)
    lines = summary.summary(requeued_run)
    text = "\n".join(lines)
    assert lines[0].startswith("state       completed at step 24")
    assert "progress    step 24," in text
    assert f"restarts    2: resumed at step {stops[0]['step']} after time_limit; resumed at step " \
           f"{stops[1]['step']} after preemption" in text
    assert "best acc    " in text
    attempts = [line for line in lines if line.startswith("attempt     ")]  # the ledger, one per stop
    assert [a.split()[1] for a in attempts] == ["time_limit", "preemption"], attempts
    # each followed by its recovery, every phase recorded by the real ranks
    recoveries = [lines[lines.index(a) + 1] for a in attempts]
    for r in recoveries:
        assert r.startswith("  recovery  stop vote "), r
        took = dict((p.rsplit(" ", 2)[0].strip(), float(p.rsplit(" ", 2)[1])) for p in r[12:].split(", "))
        assert list(took) == list(phases.PHASES) and all(v >= 0 for v in took.values()), r
        assert took["start-up"] > 0 and took["save"] > 0, r
    assert len(lines) <= 5 + 2 * len(attempts) and all(len(line) < 200 for line in lines)


def test_plot_onto_a_device_writes_in_place_or_fails_in_one_line_and_never_replaces_it(
        requeued_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plot -o /dev/full` (run as root, it used to rename a PNG over the device node): one line,
    exit 1, the device untouched; `-o /dev/null` is written in place."""
    import os

    before = os.lstat("/dev/full")
    assert main(["plot", str(requeued_run), "-o", "/dev/full"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ddpjob: error: cannot write '/dev/full' (No space left on device). Hint: choose another -o."]
    after = os.lstat("/dev/full")
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    assert main(["plot", str(requeued_run), "-o", "/dev/null"]) == 0
    assert Path("/dev/null").is_char_device()
    assert main(["plot", str(requeued_run), "-o", str(tmp_path)]) == 1  # a folder: refused in one line
