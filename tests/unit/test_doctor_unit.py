"""`ddpjob doctor`: a good job passes against the real test cluster; broken setups (unknown
partition, a B: signal, tasks > GPUs, GPUs on a GPU-less partition, a missing dataset, ...) are
failed checks with hints, and the command exits 1. Pure parsing is tested without the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpjob.errors import DDPJobError
from ddpjob.launch import doctor
from test_doctor import checks, job


# ------------------------------------------------------------------ without the cluster
def test_no_slurm_on_path_is_one_failed_check(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(job.parent / "empty-bin"))
    result = checks(str(job))
    assert result["slurm commands"].status == doctor.FAIL
    assert "sbatch, srun, scontrol, sacct not found" in result["slurm commands"].detail
    assert "--backend local" in result["slurm commands"].hint
    assert "partition" not in result  # no scontrol: the SLURM-side job checks are not attempted
    assert result["dataset"].status == doctor.PASS  # the local ones still are


def test_gres_and_record_parsing() -> None:
    assert doctor._gpus("(null)") == 0
    assert doctor._gpus("gpu:4") == 4
    assert doctor._gpus("gpu:a100:4(S:0-1)") == 4
    assert doctor._gpus("gpu:a100:2,gpu:v100:2(S:0),mps:100") == 4
    recs = doctor._records("NodeName=n1 Gres=gpu:2 OS=Linux 6.1 #1 SMP Partitions=low,high\n\n"
                           "NodeName=n2 Gres=(null)\n")
    assert [r["NodeName"] for r in recs] == ["n1", "n2"] and recs[0]["Partitions"] == "low,high"
    assert doctor._limit_s("UNLIMITED") is None and doctor._limit_s("1-00:00:00") == 86400


def test_signal_routing_on_raw_values() -> None:
    assert doctor.signal_routing("USR2", [], 120).status == doctor.PASS
    assert doctor.signal_routing("USR1", ["--exclusive"], 90).detail.startswith("SIGUSR1 reaches")
    assert doctor.signal_routing("b:usr2", []).status == doctor.FAIL
    # sbatch expands abbreviations: --sig=B:... is --signal=B:...
    for extra in ("--sig=B:USR2@60", "--sign=b:USR2@60", "--signal=B:USR2@60"):
        assert doctor.signal_routing("USR2", [extra]).status == doctor.FAIL, extra
    assert doctor.signal_routing("USR2", ["--comment=B:x"]).status == doctor.PASS
    c = doctor.signal_routing("USR2", ["--exclusive", "--signal=B:TERM@30"])
    assert c.status == doctor.FAIL and "'--signal=B:TERM@30'" in c.detail


def test_raise_on_failures_is_the_first_failure_as_one_line() -> None:
    ok = doctor.Check("a", doctor.PASS, "fine")
    bad = doctor.Check("dataset", doctor.FAIL, "CIFAR-10 not ready: x missing", "run ddpjob data")
    doctor.raise_on_failures([ok, doctor.Check("b", doctor.WARN, "meh", "h")])
    with pytest.raises(DDPJobError) as e:
        doctor.raise_on_failures([ok, bad, doctor.Check("c", doctor.FAIL, "other", "h")])
    assert e.value.line() == ("ddpjob: error: preflight check 'dataset' failed: CIFAR-10 not "
                              "ready: x missing. Hint: run ddpjob data.")


def test_cheap_checks_local_backend_and_unwritable_run_dir(job: Path, tmp_path: Path) -> None:
    from ddpjob.jobfile import resolve

    blocker = tmp_path / "afile"
    blocker.write_text("")
    result = doctor.cheap_checks(resolve(job), on_slurm=False, runs_root=blocker / "runs")
    assert [c.name for c in result] == ["run dir", "dataset", "entry"]
    assert result[0].status == doctor.FAIL and "is not a folder" in result[0].detail
