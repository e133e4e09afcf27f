"""bench/: the --tiny smoke run prints every benchmark id with measured numbers (CI keeps the
harness working; the real figures are never asserted), plus the pieces it is made of."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is a top-level folder of the repository, not installed
    sys.path.insert(0, str(REPO))

from bench import harness, run  # noqa: E402
from bench.suite import BENCHMARKS, Row  # noqa: E402
IDS = [f"P{i}" for i in range(1, 11)]


@pytest.mark.slow
def test_tiny_run_prints_every_id_with_measured_numbers(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--tiny", "--work", str(tmp_path),
                          "--json", str(tmp_path / "rows.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ddpjob benchmarks (--tiny"), lines[0]
    assert [c.strip() for c in lines[1].split("|")[1:-1]] == ["id", "measure", "goal", "measured", "result"]
    table = [ln for ln in lines if ln.startswith("| P")]
    assert sorted({ln.split("|")[1].strip() for ln in table}) == sorted(IDS), out.stdout
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    for r in rows:
        if r["id"] == "P8":
            assert r["measured"].startswith("not measured"), r
            assert r["passed"] is None
            continue
        # a number was measured (not an error line), and the goal column is filled in
        assert re.match(r"^\d+(\.\d+)?(x| ms)?\b", r["measured"]), r
        assert r["goal"] and isinstance(r["passed"], bool), r
    p1 = next(r for r in rows if r["id"] == "P1")
    assert "losses equal" in p1["measured"], p1  # same seed, same batches: the same bits
    p9 = next(r for r in rows if r["id"] == "P9")
    assert "losses equal" in p9["measured"], p9  # the API changes no computation
    p10 = next(r for r in rows if r["id"] == "P10")
    assert "losses equal" in p10["measured"], p10  # nor does when the vote is read
    p7 = [r for r in rows if r["id"] == "P7"]
    assert p7[0]["measured"] == "0", p7  # a signalled stop loses no step


def test_one_benchmark_runs_alone(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "bench/run.py", "p8", "--tiny", "--work", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    table = [ln for ln in out.stdout.splitlines() if ln.startswith("| P")]
    assert len(table) == 1 and table[0].startswith("| P8 "), out.stdout


def test_unknown_id_is_a_usage_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "P11", "--work", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown benchmark id(s) P11" in out.stderr


def test_table_marks_pass_fail_and_unmeasured() -> None:
    rows = [Row("P1", "m1", ">= 1x", "1.20x", True), Row("P2", "m2", ">= 2x", "1.00x", False),
            Row("P8", "m8", "report", "not measured: no GPU lent", None)]
    lines = run.table(rows)
    assert [ln.split("|")[5].strip() for ln in lines[2:]] == ["pass", "FAIL", "-"]
    assert len({len(ln) for ln in lines}) == 1  # aligned columns


def test_step_times_skip_gate_waits_and_take_the_slowest_rank() -> None:
    # marks: [wall end, CPU end, wall go-on, CPU go-on]; rank 0 waited 0.5 s at gate 1
    r0 = {"marks": {"0": [100.0, 10.0, 100.0, 10.0], "1": [101.0, 10.9, 101.5, 10.9],
                    "2": [103.0, 12.0, 103.0, 12.0]}}
    r1 = {"marks": {"0": [100.0, 20.0, 100.0, 20.0], "1": [101.2, 21.0, 101.5, 21.0],
                    "2": [103.0, 22.5, 103.0, 22.5]}}
    assert harness.step_costs([r0, r1], 0, 2) == pytest.approx([1.2, 1.5])
    assert harness.step_costs([r0, r1], 0, 2, "cpu") == pytest.approx([1.0, 1.5])
    assert harness.rate([r0, r1], 0, 2) == pytest.approx(1 / 1.35)
    assert harness.median([3.0, 1.0, 2.0]) == 2.0


def test_every_id_has_a_benchmark_and_the_job_file_exists() -> None:
    assert list(BENCHMARKS) == IDS
    assert harness.JOB.is_file()
    # the benchmark's config is the user's job file plus overrides, and it validates
    from ddpjob import config

    cfg = config.from_json(harness.job_config(Path("/data"), harness.FULL, 2))
    assert (cfg.train.model, cfg.train.batch_size, cfg.train.threads) == ("resnet18", 128, 1)
    assert cfg.train.amp == "auto" and cfg.train.channels_last  # the job file's recipe, kept
