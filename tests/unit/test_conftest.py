"""The CI rule for tests marked `cluster` (tests/conftest.py): never a silent skip on CI.

Each case runs a small pytest session in a scratch directory holding copies of conftest.py and
slurmtools.py, so the real suite's outcome is what is checked. A SLURM_CONF naming a controller
that is not there stands in for a cluster that is down, without touching the real one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/: conftest.py and the helpers it imports

# A stand-in cluster, so the skip below comes from the test body, not from the fixture.
FAKE_CLUSTER = """
import pytest


@pytest.fixture(scope="session")
def slurm_cluster():
    return "fake"
"""

SKIPPING = """
import pytest


@pytest.mark.cluster
def test_skips(slurm_cluster):
    pytest.skip("no GPU here")

@pytest.mark.cluster
@pytest.mark.skipif(True, reason="skipped by a mark")
def test_skipif(slurm_cluster):
    pass

@pytest.mark.cluster
@pytest.mark.xfail(reason="known bug", strict=True)
def test_xfail(slurm_cluster):
    assert False

def test_plain_skip():
    pytest.skip("not a cluster test")
"""

NEEDS_CLUSTER = """
import pytest


@pytest.mark.cluster
def test_uses_cluster():
    pass
"""


def _run(tmp_path: Path, test_text: str, ci: bool,
         sub_conftest: str = "") -> subprocess.CompletedProcess[str]:
    for name in ("conftest.py", "slurmtools.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "conftest.py").write_text(sub_conftest)
    (tmp_path / "sub" / "test_case.py").write_text(test_text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cluster: needs SLURM\n")
    # the outer run's own pytest options (e.g. PYTEST_ADDOPTS=--basetemp=...) are not this one's
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    # A controller that is not there: every SLURM command fails (after ~9 s of retries).
    (tmp_path / "slurm.conf").write_text("ClusterName=down\nSlurmctldHost=localhost\n"
                                         "SlurmctldPort=1\n")
    env["SLURM_CONF"] = str(tmp_path / "slurm.conf")
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                           str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


@pytest.mark.parametrize("ci", [False, True])
def test_cluster_down_skips_locally_and_fails_on_ci(tmp_path: Path, ci: bool) -> None:
    proc = _run(tmp_path, NEEDS_CLUSTER, ci)
    assert "SLURM test cluster unavailable" in proc.stdout, proc.stdout
    if ci:
        assert proc.returncode == 1, proc.stdout
        assert "1 failed" in proc.stdout or "1 error" in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout
        assert "1 skipped" in proc.stdout, proc.stdout


def test_skipped_cluster_test_counts_as_failure_on_ci(tmp_path: Path) -> None:
    proc = _run(tmp_path, SKIPPING, ci=True, sub_conftest=FAKE_CLUSTER)
    assert proc.returncode == 1, proc.stdout
    # Both skipped cluster tests fail (a skip at setup shows as an error); the plain skip stays a
    # skip and xfail stays xfail.
    assert "1 failed, 1 skipped, 1 xfailed, 1 error" in proc.stdout, proc.stdout
    assert "skipped under CI=true (a skip counts as a failure): no GPU here" in proc.stdout
    assert "skipped by a mark" in proc.stdout, proc.stdout


def test_skipped_cluster_test_is_a_skip_locally(tmp_path: Path) -> None:
    proc = _run(tmp_path, SKIPPING, ci=False, sub_conftest=FAKE_CLUSTER)
    assert proc.returncode == 0, proc.stdout
    assert "3 skipped, 1 xfailed" in proc.stdout, proc.stdout
