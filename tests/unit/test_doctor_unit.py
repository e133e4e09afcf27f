"""`ddpjob doctor`: a good job passes against the real test cluster; broken setups (unknown
partition, a B: signal, tasks > GPUs, GPUs on a GPU-less partition, a missing dataset, ...) are
failed checks with hints, and the command exits 1. Pure parsing is tested without the cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpjob.errors import DDPJobError
from ddpjob.launch import checks as checks_mod, doctor, restartchecks, signalchecks, slurmchecks
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
    assert slurmchecks.gres_gpus("(null)") == 0
    assert slurmchecks.gres_gpus("gpu:4") == 4
    assert slurmchecks.gres_gpus("gpu:a100:4(S:0-1)") == 4
    assert slurmchecks.gres_gpus("gpu:a100:2,gpu:v100:2(S:0),mps:100") == 4
    recs = checks_mod.records("NodeName=n1 Gres=gpu:2 OS=Linux 6.1 #1 SMP Partitions=low,high\n\n"
                           "NodeName=n2 Gres=(null)\n")
    assert [r["NodeName"] for r in recs] == ["n1", "n2"] and recs[0]["Partitions"] == "low,high"
    assert slurmchecks.limit_s("UNLIMITED") is None and slurmchecks.limit_s("1-00:00:00") == 86400


def test_signal_routing_on_raw_values() -> None:
    assert signalchecks.signal_routing("USR2", [], 120).status == doctor.PASS
    assert signalchecks.signal_routing("USR1", ["--exclusive"], 90).detail.startswith("SIGUSR1 reaches")
    assert signalchecks.signal_routing("b:usr2", []).status == doctor.FAIL
    # sbatch expands abbreviations: --sig=B:... is --signal=B:...
    for extra in ("--sig=B:USR2@60", "--sign=b:USR2@60", "--signal=B:USR2@60"):
        assert signalchecks.signal_routing("USR2", [extra]).status == doctor.FAIL, extra
    assert signalchecks.signal_routing("USR2", ["--comment=B:x"]).status == doctor.PASS
    c = signalchecks.signal_routing("USR2", ["--exclusive", "--signal=B:TERM@30"])
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


# ------------------------------------------------------------------ restart in place (pure parts)
def _cfg(*sets: str):  # noqa: ANN202 - a JobConfig
    from ddpjob.jobfile import from_dict, apply_overrides

    return from_dict(apply_overrides({"slurm": {"tasks_per_node": 2, "max_failures": 2}}, list(sets)))


def test_snapshot_size_is_measured_from_an_earlier_run_else_estimated_from_the_model(tmp_path: Path) -> None:
    cfg = _cfg()
    size, how = restartchecks.state_estimate(cfg, tmp_path)
    params = 11_689_512  # resnet18 (modelnames.PARAMS), SGD with momentum: weights + 1 slot
    assert size == params * 4 * 2 + restartchecks.RNG_BYTES and how.startswith("estimated: resnet18 has 11.69 M")
    assert restartchecks.state_estimate(_cfg("train.optimizer=adamw"), tmp_path)[0] == params * 4 * 3 + restartchecks.RNG_BYTES
    assert restartchecks.state_estimate(_cfg("train.momentum=0"), tmp_path)[0] == params * 4 + restartchecks.RNG_BYTES
    assert restartchecks.state_estimate(_cfg("train.entry=train.py"), tmp_path)[0] is None
    step = tmp_path / "ddpjob-20260101-000000-abcd" / "checkpoints" / "step-000000010"
    step.mkdir(parents=True)
    files = {"model.pt": 1000, "optimizer.pt": 900, "rank-0.pt": 50, "rank-1.pt": 60}
    (step / "manifest.json").write_text(json.dumps({"files": {n: {"size": v, "sha256": "x"} for n, v in files.items()}}))
    size, how = restartchecks.state_estimate(_cfg("train.entry=train.py"), tmp_path)
    assert size == 1000 + 900 + 2 * 60 and how == f"measured from {step}"  # a peer's RNG file too


def test_snapshot_room_passes_warns_at_one_and_fails_at_none() -> None:
    cfg = _cfg()
    state = (100 << 20, "given")
    c = restartchecks.snapshot_room_check(cfg, state, 600 << 20, "on n1")
    assert c.status == doctor.PASS and "2 rank(s) x 3 x 100 MiB = 600 MiB (given) fits: 600 MiB free in /dev/shm on n1" in c.detail
    c = restartchecks.snapshot_room_check(cfg, state, 500 << 20, "on n1")
    assert c.status == doctor.WARN and "keep 1 snapshot instead of 2" in c.detail
    c = restartchecks.snapshot_room_check(cfg, state, 300 << 20, "on n1")
    assert c.status == doctor.FAIL and "take no snapshots" in c.detail and "snapshot_dir" in c.hint
    off = restartchecks.snapshot_room_check(_cfg("slurm.max_failures=0"), state, 0, "on n1")
    assert off.status == doctor.PASS and "max_failures = 0" in off.detail
    fsdp = restartchecks.snapshot_room_check(_cfg("train.strategy=fsdp"), state, 0, "on n1")
    assert fsdp.status == doctor.PASS and 'no in-memory snapshots (strategy = "fsdp")' in fsdp.detail


def test_private_shm_from_the_job_container_plugin() -> None:
    c = restartchecks.shm_privacy_check("JobContainerType       = job_container/tmpfs\n", "/dev/shm")
    assert c.status == doctor.PASS and "private to each job" in c.detail and "never a requeue" in c.detail
    c = restartchecks.shm_privacy_check("JobContainerType = job_container/none\n", "/dev/shm")
    assert c.status == doctor.PASS and "shared by the node's jobs" in c.detail
    assert restartchecks.shm_privacy_check("", "/dev/shm").status == doctor.WARN


def test_the_memory_limit_comes_from_mem_else_the_partition_else_the_nodes() -> None:
    nodes = [{"RealMemory": "2000", "FreeMem": "900"}, {"RealMemory": "4000", "FreeMem": "3000"}]
    assert restartchecks._slurm_mem("32G") == 32 << 30 and restartchecks._slurm_mem("4000") == 4000 << 20
    assert restartchecks._slurm_mem("UNLIMITED") is None and restartchecks._slurm_mem("0") is None
    limit = restartchecks.memory_limit(_cfg("slurm.mem=3G"), {"DefMemPerNode": "1000"}, {}, nodes)
    assert limit == restartchecks.MemoryLimit(3 << 30, "slurm.mem = 3G", enforced=True)
    assert restartchecks.memory_limit(_cfg(), {"DefMemPerCPU": "500"}, {"DefMemPerNode": "9000"}, nodes).size == 1000 << 20
    assert restartchecks.memory_limit(_cfg(), {}, {"DefMemPerNode": "9000", "MaxMemPerNode": "8000"}, nodes).size == 8000 << 20
    tracked = restartchecks.memory_limit(_cfg(), {}, {"SelectTypeParameters": "CR_Core_Memory"}, nodes)
    assert tracked.size == 2000 << 20 and tracked.enforced
    # SLURM tracks no memory: the nodes' RealMemory, never FreeMem (which leaves out the page cache)
    untracked = restartchecks.memory_limit(_cfg(), {}, {"SelectTypeParameters": "CR_CORE"}, nodes)
    assert untracked.size == 2000 << 20 and not untracked.enforced
    assert "RealMemory" in untracked.source and "tracks no memory" in untracked.source and "FreeMem" not in untracked.source
    assert restartchecks.memory_limit(_cfg(), {}, {}, [{"FreeMem": "900"}]) == \
        restartchecks.MemoryLimit(None, "no memory limit found")


def test_a_node_whose_page_cache_fills_its_memory_passes_where_slurm_tracks_no_memory() -> None:
    """The issue's setup: `ddpjob doctor jobs/smoke.toml` on nodes of 8000 MB RealMemory, SLURM
    tracking no memory, the nodes' FreeMem 437 MiB (the rest page cache): it FAILed with "2
    rank(s) ~ 1317 MiB ... above the limit 437 MiB". Now the ranks fit the nodes' memory."""
    from ddpjob.jobfile import resolve

    root = Path(__file__).resolve().parents[2]
    cfg = resolve(str(root / "jobs" / "smoke.toml"), [], {})
    busy = [{"RealMemory": "8000", "AllocMem": "0", "FreeMem": "437"}] * 2
    limit = restartchecks.memory_limit(cfg, {}, {"SelectTypeParameters": "CR_Core"}, busy)
    state, _ = restartchecks.state_estimate(cfg, Path("/nonexistent"))
    c = restartchecks.memory_check(cfg, state, limit)
    assert c.status == doctor.PASS and "within 8000 MiB (the nodes' RealMemory" in c.detail, c


def test_past_the_nodes_memory_where_slurm_tracks_none_is_a_warning_that_says_why() -> None:
    """Nothing is reserved or enforced there and the ranks' use is a guess: a WARN, never a FAIL;
    two GPU ranks (3 GiB each, estimated) on 2000 MiB nodes."""
    cfg = _cfg("slurm.gpus_per_node=2", "slurm.max_failures=0")
    limit = restartchecks.MemoryLimit(2000 << 20, "the nodes' RealMemory; SLURM tracks no memory here", enforced=False)
    c = restartchecks.memory_check(cfg, None, limit)
    assert c.status == doctor.WARN and "2 rank(s) ~ 6144 MiB per node, more than 2000 MiB" in c.detail, c
    assert "nothing reserves memory" in c.detail and "only a warning" in c.hint and "snapshot_every" not in c.hint
    enforced = restartchecks.memory_check(cfg, None, restartchecks.MemoryLimit(2000 << 20, "slurm.mem = 2000M"))
    assert enforced.status == doctor.FAIL and "killed for memory" in enforced.detail
    fits = restartchecks.memory_check(cfg, None, restartchecks.MemoryLimit(8000 << 20, "RealMemory", enforced=False))
    assert fits.status == doctor.PASS


def test_the_memory_check_fails_when_the_ranks_alone_do_not_fit_and_warns_for_the_snapshots() -> None:
    cfg = _cfg("data.dataset=synthetic")
    state = 10 << 20
    use = 2 * restartchecks.rank_use(cfg, state)
    snaps = 2 * state + 6 * state  # each rank's pooled copy + 2 ranks x (2 kept + 1 written)
    assert restartchecks.memory_check(cfg, state, restartchecks.MemoryLimit(use + snaps, "x")).status == doctor.PASS
    c = restartchecks.memory_check(cfg, state, restartchecks.MemoryLimit(use + snaps - 1, "x"))
    assert c.status == doctor.WARN and "keep 1 snapshot instead of 2" in c.detail
    c = restartchecks.memory_check(cfg, state, restartchecks.MemoryLimit(use - 1, "slurm.mem = 1G"))
    assert c.status == doctor.FAIL and "killed for memory" in c.detail and "slurm.mem" in c.hint
