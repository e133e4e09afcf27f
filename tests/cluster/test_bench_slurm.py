"""bench/: the --tiny smoke run prints every benchmark id with measured numbers (CI keeps the
harness working; the real figures are never asserted), plus the pieces it is made of."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a top-level folder of the repository, not installed
    sys.path.insert(0, str(REPO))



@pytest.mark.cluster
@pytest.mark.slow
def test_tiny_storm_on_the_cluster_is_bit_identical_and_loses_nothing(slurm_cluster: object,
                                                                      tmp_path: Path) -> None:
    """`bench P11 --tiny`: 2 preemptions, 60 steps into each attempt, of a 700-step job, and its
    uninterrupted reference (~1 min)."""
    out = subprocess.run([sys.executable, "-m", "bench", "P11", "--tiny", "--work", str(tmp_path),
                          "--json", str(tmp_path / "rows.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["id"] for r in rows] == ["P11"] * 4, rows
    assert rows[0]["passed"] is True and rows[0]["measured"].startswith("bit-identical"), rows[0]
    assert rows[1]["passed"] is True and rows[1]["measured"].startswith("0 "), rows[1]
    assert len(rows[3]["details"]["recoveries"]) == 2
