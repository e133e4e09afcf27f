"""bench/: the --tiny smoke run prints every benchmark id with measured numbers (CI keeps the
harness working; the real figures are never asserted), plus the pieces it is made of."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench import IDS  # the default set of benchmark ids

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a top-level folder of the repository, not installed
    sys.path.insert(0, str(REPO))


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
    assert "losses equal" in p1["measured"], p1["details"]  # same seed, same batches: the same bits
    p9 = next(r for r in rows if r["id"] == "P9")
    assert "losses equal" in p9["measured"], p9  # the API changes no computation
    p10 = next(r for r in rows if r["id"] == "P10")
    assert "losses equal" in p10["measured"], p10  # nor does when the vote is read
    p7 = [r for r in rows if r["id"] == "P7"]
    assert p7[0]["measured"] == "0", p7  # a signalled stop loses no step
    p13 = next(r for r in rows if r["id"] == "P13")
    assert p13["details"]["interval_for_1pct"] >= 1 and len(p13["details"]["trial_ratios"]) == 1, p13


def test_one_benchmark_runs_alone(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "bench/run.py", "p8", "--tiny", "--work", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    table = [ln for ln in out.stdout.splitlines() if ln.startswith("| P")]
    assert len(table) == 1 and table[0].startswith("| P8 "), out.stdout
