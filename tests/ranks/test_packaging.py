"""A built wheel carries the sbatch template and the example jobs, and a non-editable install
(`pip install --target`, imported with no site-packages at all) renders a script from them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build from a copy of the sources, so build/ and *.egg-info never land in the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("ddpjob", "jobs", "templates"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    # --no-build-isolation: the venv's setuptools builds it, no download needed.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp / "dist")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("ddpjob-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_contains_template_and_jobs(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ddpjob/templates/sbatch.sh.tmpl", "ddpjob/jobs/smoke.toml",
            "ddpjob/jobs/cifar10_resnet18.toml", "ddpjob/jobs/cifar10_resnet50.toml",
            "ddpjob/launch/render.py", "ddpjob/launch/sbatch.py", "ddpjob/node/dist.py",
            "ddpjob/store/commit.py", "ddpjob/train/trainer.py"} <= names
    assert not any(n.startswith(("tests/", "templates/", "jobs/")) for n in names)
    # every module of every package (setup.cfg lists the packages: a new one must be added there)
    sources = {str(p.relative_to(REPO)) for p in (REPO / "ddpjob").rglob("*.py") if "__pycache__" not in p.parts}
    assert sources - names == set()


@pytest.mark.slow
def test_installed_wheel_renders_from_its_own_files(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    work = tmp_path / "elsewhere"  # no jobs/ here: `smoke` must come from the installed wheel
    work.mkdir()
    # -S: no site-packages, so neither the editable install nor the checkout can be imported.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(site)}
    py = [sys.executable, "-S"]
    where = subprocess.run(py + ["-c", "import ddpjob; print(ddpjob.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(site / "ddpjob" / "__init__.py"), where.stderr
    r = subprocess.run(py + ["-m", "ddpjob", "sbatch", "smoke", "--run-dir", str(work / "run"),
                             "-o", "x.sbatch"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    script = (work / "x.sbatch").read_text()
    script = re.sub(r"sha256:[0-9a-f]{16}", "sha256:<config.json digest>", script)
    script = re.sub(r"resume hash [0-9a-f]{16}", "resume hash <hash>", script)
    script = re.sub(r"^# ddpjob [^:]+:", "# ddpjob <version>:", script, flags=re.M)
    golden = (REPO / "tests/golden/smoke.sbatch").read_text()
    assert script == golden.replace("/scratch/runs/example", str(work / "run")).replace(
        "/opt/venv/bin/python", os.path.abspath(sys.executable))
    assert (work / "run" / "config.json").is_file()


def test_setup_says_in_one_line_when_the_disk_cannot_hold_torch(tmp_path: Path) -> None:
    """tools/setup.sh on a filesystem too small for torch's wheels (a real 64 MiB tmpfs): one
    error line naming the free space and the need, exit 1, before pip starts (which would fail
    half-way with "No space left on device", as CI once did on a full disk)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(disk)], check=True)
    try:
        (disk / "tools").mkdir()
        shutil.copy2(REPO / "tools" / "setup.sh", disk / "tools" / "setup.sh")
        for name in ("setup.cfg", "pyproject.toml"):
            shutil.copy2(REPO / name, disk / name)
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        r = subprocess.run(["bash", str(disk / "tools" / "setup.sh")], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        errors = r.stderr.strip().splitlines()
        assert len(errors) == 1, r.stderr
        assert re.fullmatch(r"\[setup\] error: \d+ MiB free for .*/\.venv, torch 2\.14\.1 \+ torchvision "
                            r"0\.29\.1 need about 6 GiB\. Hint: .*", errors[0]), errors[0]
        assert "installing torch" not in r.stdout
        assert not list((disk / ".venv").glob("lib/python*/site-packages/torch"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
