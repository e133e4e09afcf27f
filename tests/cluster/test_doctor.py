"""`ddpjob doctor`: a good job passes against the real test cluster; broken setups (unknown
partition, a B: signal, tasks > GPUs, GPUs on a GPU-less partition, a missing dataset, ...) are
failed checks with hints, and the command exits 1. Pure parsing is tested without the cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob.cli import build_parser, main
from ddpjob.launch import doctor
from ddpjob.train.fixtures import write_cifar10_folder

GOOD = """name = "doc"
[slurm]
partition = "low"
nodes = 1
tasks_per_node = 2
time = "00:10:00"
[data]
dataset = "cifar10"
root = "data"
"""


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A good job file in a fresh cwd with its (tiny) CIFAR-10 set under ./data."""
    monkeypatch.chdir(tmp_path)
    write_cifar10_folder(tmp_path / "data", n_train=20, n_test=10, learnable=False)
    path = tmp_path / "job.toml"
    path.write_text(GOOD)
    return path


def checks(*argv: str) -> dict[str, doctor.Check]:
    args = build_parser().parse_args(["doctor", *argv])
    out = doctor.run_checks(args)
    by_name: dict[str, doctor.Check] = {}
    for c in out:  # a name may repeat (two sbatch_extra problems): keep the worst
        if c.name not in by_name or c.status == doctor.FAIL:
            by_name[c.name] = c
    return by_name


def failed(result: dict[str, doctor.Check]) -> dict[str, doctor.Check]:
    return {n: c for n, c in result.items() if c.status == doctor.FAIL}


# ------------------------------------------------------------------ against the real cluster
# The test cluster's nodes say RealMemory=2000 (tests/cluster/start.sh) and SLURM tracks no memory:
# a good job there is one whose ranks fit that, so not two ResNet-18 ranks and their snapshots (~2.6
# GB; test_restart_in_place_checks_on_the_test_cluster), whatever the host's page cache holds.
SMALL = ("--set", "train.model=cnn_tiny")


@pytest.mark.cluster
def test_good_job_passes_every_check(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = checks(str(job), *SMALL)
    assert not failed(result), failed(result)
    assert {"job file", "slurm commands", "controller", "accounting", "requeue policy", "run dir",
            "dataset", "tasks per gpu", "partition", "nodes", "time limit", "cpus", "preemption",
            "signal routing", "signal lead", "port window", "entry", "snapshot room",
            "private /dev/shm", "memory limit"} <= set(result)
    assert all(c.status == doctor.PASS for c in result.values()), result
    assert "GraceTime 20" in result["preemption"].detail
    assert "--signal=USR2@120" in result["signal routing"].detail
    assert "within 2000 MiB (the nodes' RealMemory; SLURM tracks no memory here" in result["memory limit"].detail

    code = main(["doctor", str(job), *SMALL])
    out = capsys.readouterr().out
    assert code == 0 and "20 passed, 0 warning(s), 0 failed" in out


def assert_memory_warns_on_the_test_cluster(mem: doctor.Check) -> None:
    assert mem.status == doctor.WARN, mem
    assert "+ snapshots" in mem.detail and "per node, more than 2000 MiB (the nodes' RealMemory" in mem.detail, mem
    assert "SLURM tracks no memory here, SelectTypeParameters=" in mem.detail and "FreeMem" not in mem.detail, mem
    assert "only a warning" in mem.hint, mem


@pytest.mark.cluster
def test_without_a_job_file_only_cluster_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = checks()
    assert set(result) == {"slurm commands", "controller", "accounting", "requeue policy",
                           "run dir", "port window"}
    assert not failed(result)


@pytest.mark.cluster
def test_unknown_partition(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = checks(str(job), "--partition", "gpu-a100")
    assert set(failed(result)) == {"partition"}
    assert "'gpu-a100' does not exist" in result["partition"].detail
    assert "low" in result["partition"].detail and "high" in result["partition"].detail
    assert "slurm.partition" in result["partition"].hint

    code = main(["doctor", str(job), "--partition", "gpu-a100"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("partition"))
    assert "fail" in line and "set slurm.partition" in line  # the hint is in the table
    assert out.rstrip().endswith("1 failed")


@pytest.mark.cluster
@pytest.mark.parametrize("override", ['slurm.sbatch_extra=["--signal=B:USR2@60"]',
                                      "slurm.signal=B:USR2"])
def test_b_signal_fails_with_the_routing_explained(job: Path, override: str) -> None:
    """Validation already rejects it at load time (a failed "job file" check, not a crash);
    doctor adds why: srun never passes the batch shell's signal on. The cluster is still checked."""
    result = checks(str(job), "--set", override)
    assert set(failed(result)) == {"job file", "signal routing"}
    assert "B:USR2" in result["job file"].detail
    c = result["signal routing"]
    assert "B:USR2" in c.detail and "only the batch shell" in c.detail
    assert "srun does not pass signals on" in c.detail and "drop the B:" in c.hint
    assert result["controller"].status == doctor.PASS


@pytest.mark.cluster
def test_tasks_above_gpus_and_gpus_on_a_cpu_partition(job: Path) -> None:
    result = checks(str(job), "--gpus-per-node", "1", "--tasks-per-node", "2")
    assert set(failed(result)) == {"tasks per gpu", "gpus"}
    assert "tasks_per_node = 2 > gpus_per_node = 1" in result["tasks per gpu"].detail
    assert "one rank per GPU" in result["tasks per gpu"].hint
    assert "have no GPUs" in result["gpus"].detail and "n1" in result["gpus"].detail
    assert "gpus_per_node = 0" in result["gpus"].hint


@pytest.mark.cluster
def test_fewer_tasks_than_gpus_is_a_warning(job: Path) -> None:
    result = checks(str(job), "--gpus-per-node", "2", "--tasks-per-node", "1")
    assert result["tasks per gpu"].status == doctor.WARN and "idle" in result["tasks per gpu"].detail


@pytest.mark.cluster
def test_missing_and_truncated_dataset(job: Path, tmp_path: Path) -> None:
    result = checks(str(job), "--set", "data.root=elsewhere")
    assert set(failed(result)) == {"dataset"}
    assert "does not exist" in result["dataset"].detail
    assert "ddpjob data cifar10 --root elsewhere" in result["dataset"].hint

    batch = tmp_path / "data" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:-50])
    result = checks(str(job))
    assert set(failed(result)) == {"dataset"} and "data_batch_2" in result["dataset"].detail


@pytest.mark.cluster
def test_resources_beyond_the_partition(job: Path) -> None:
    result = checks(str(job), "--nodes", "3", "--time", "02:00:00", "--set", "slurm.cpus_per_task=2")
    assert set(failed(result)) == {"nodes", "time limit", "cpus"}
    assert "at most 2" in result["nodes"].detail
    assert "MaxTime 01:00:00" in result["time limit"].detail
    assert "4 per node" in result["cpus"].detail


@pytest.mark.cluster
def test_short_signal_lead_and_slow_past_checkpoints_warn(job: Path, tmp_path: Path) -> None:
    result = checks(str(job), "--set", "slurm.signal_lead_s=10")
    assert result["signal lead"].status == doctor.WARN and "under 30 s" in result["signal lead"].detail

    # An earlier run of this job whose checkpoint took 50 s to write (file times).
    ckpt = tmp_path / "runs" / "doc-20260101-000000-abcd" / "checkpoints" / "step-000000010"
    ckpt.mkdir(parents=True)
    for name, t in (("model.pt", 1000.0), ("rank-0.pt", 1020.0), ("manifest.json", 1050.0)):
        (ckpt / name).write_text("x")
        os.utime(ckpt / name, (t, t))
    result = checks(str(job))
    c = result["signal lead"]
    assert c.status == doctor.WARN and "took up to 50.0 s" in c.detail and "151" in c.hint


@pytest.mark.cluster
@pytest.mark.slow
def test_srun_sees_run_dir_and_data_from_a_compute_node(job: Path, tmp_path: Path) -> None:
    """A real job step; generous time, the test cluster is shared with other tests."""
    from ddpjob.jobfile import resolve

    c = doctor.srun_check(resolve(job), tmp_path / "runs", timeout_s=400)
    assert c.status == doctor.PASS, c
    assert c.detail.startswith(("on n1:", "on n2:")) and "writable" in c.detail
    assert "readable " + str(tmp_path / "data" / "cifar-10-batches-py" / "test_batch") in c.detail

    # A data root that does not exist anywhere: the node reports it missing.
    c = doctor.srun_check(resolve(job, ["data.root='/nonexistent/ddpjob-data'"]), tmp_path / "runs",
                          timeout_s=400)
    assert c.status == doctor.FAIL and "/nonexistent/ddpjob-data" in c.detail
    assert "shared" in c.hint


# ------------------------------------------------------------------ what a restart in place needs
RESTARTS = ("--set", "slurm.max_failures=2")  # snapshot_every = "auto" is then on


def row(out: str, name: str) -> str:
    """The one table line of check `name`."""
    rows = [x for x in out.splitlines() if x.startswith(name + " ")]
    assert len(rows) == 1, out
    return rows[0]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: this machine's nodes all see it (one machine), nobody else uses it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "tiny-shm"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(folder)], check=True)
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.cluster
def test_restart_in_place_checks_on_the_test_cluster(job: Path) -> None:
    """ResNet-18 (the default model) + SGD momentum, 2 ranks: 2 x 3 x 89 MiB in /dev/shm; no
    job container; SLURM tracks no memory here, so the nodes' RealMemory (2000 MB) is the most
    the ranks can have, and the ranks + snapshots are more: a warning, not a failure."""
    result = checks(str(job), *RESTARTS)
    assert not failed(result), failed(result)
    room = result["snapshot room"]
    assert room.status == doctor.PASS and "2 rank(s) x 3 x 89 MiB = 535 MiB (estimated: resnet18 has " \
        "11.69 M parameters" in room.detail and "free in /dev/shm here" in room.detail, room
    shm = result["private /dev/shm"]
    assert shm.status == doctor.PASS and "shared by the node's jobs (JobContainerType=job_container/none)" in shm.detail
    assert_memory_warns_on_the_test_cluster(result["memory limit"])


@pytest.mark.cluster
def test_a_tiny_snapshot_folder_fails_the_room_check(job: Path, tiny_tmpfs: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    result = checks(str(job), *RESTARTS, "--set", f"checkpoint.snapshot_dir={tiny_tmpfs}")
    assert set(failed(result)) == {"snapshot room"}
    c = result["snapshot room"]
    assert f"only 1.0 MiB free in {tiny_tmpfs} here" in c.detail and "take no snapshots" in c.detail
    assert "checkpoint.snapshot_dir" in c.hint

    assert main(["doctor", str(job), *RESTARTS, "--set", f"checkpoint.snapshot_dir={tiny_tmpfs}"]) == 1
    out = capsys.readouterr().out
    assert " fail " in row(out, "snapshot room") and out.rstrip().endswith("1 failed")


@pytest.mark.cluster
def test_a_small_mem_fails_the_memory_check(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = checks(str(job), *RESTARTS, "--set", "slurm.mem=300M")
    assert set(failed(result)) == {"memory limit"}
    c = result["memory limit"]
    assert "above the limit 300 MiB (slurm.mem = 300M)" in c.detail and "killed for memory" in c.detail
    assert main(["doctor", str(job), *RESTARTS, "--set", "slurm.mem=300M"]) == 1
    assert " fail " in row(capsys.readouterr().out, "memory limit")


@pytest.mark.cluster
def test_a_job_private_shm_is_said(job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster with job_container/tmpfs: an `scontrol` earlier on PATH answers `show config`
    as such a cluster would (everything else is the real one's answer)."""
    real = shutil.which("scontrol")
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/sh
if [ "$1 $2" = "show config" ]; then
  "{real}" "$@" | sed 's#^JobContainerType .*#JobContainerType        = job_container/tmpfs#'
else exec "{real}" "$@"; fi
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    c = checks(str(job), *RESTARTS)["private /dev/shm"]
    assert c.status == doctor.PASS and "/dev/shm is private to each job (job_container/tmpfs)" in c.detail
    assert "serves a restart inside the allocation, never a requeue" in c.detail


@pytest.mark.cluster
@pytest.mark.slow
def test_srun_measures_the_snapshot_room_on_a_node(job: Path, tiny_tmpfs: Path) -> None:
    """--srun: the room is what a compute node sees (here every node is this machine)."""
    result = checks(str(job), "--srun", *RESTARTS)
    assert result["compute node"].status == doctor.PASS, result["compute node"]
    c = result["snapshot room"]
    assert c.status == doctor.PASS and "free in /dev/shm on n" in c.detail, c
    result = checks(str(job), "--srun", *RESTARTS, "--set", f"checkpoint.snapshot_dir={tiny_tmpfs}")
    c = result["snapshot room"]
    assert c.status == doctor.FAIL and f"only 1.0 MiB free in {tiny_tmpfs} on n" in c.detail, c
