"""[slurm] container on the real test cluster, through the stand-in runtimes of tests/standin/
(no container runtime installs here): a job in each runtime mode, pyxis on the template path and
apptainer on the submitit path, is preempted by partition priority at a chosen step, requeued,
and ends bit-identical to an uninterrupted run; the runtime was given the image and the mounts
at every start, and doctor finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from test_preemption_slurm import (Reference, assert_same_as_reference, ddpjob, job_env, job_file,
                                   preempt_and_finish, wait_step)

STANDIN = Path(__file__).resolve().parents[1] / "standin"
IMAGES = {"pyxis": "nvcr.io#nvidia/pytorch:24.01-py3", "apptainer": "/images/torch.sif"}


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_a_job_in_a_container_is_preempted_and_resumes_bit_exactly(
        slurm_cluster: Any, tmp_path: Path, reference: Reference, runtime: str) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    run, log, image = tmp_path / "run", tmp_path / "standin.log", IMAGES[runtime]
    env = job_env(DDPJOB_TEST_SLOW="0.05:0", DDPJOB_STANDIN_LOG=str(log),
                  PATH=f"{STANDIN}{os.pathsep}{os.environ['PATH']}")
    sets = ["--set", f"slurm.container={json.dumps(image)}",
            "--set", f"slurm.container_runtime={json.dumps(runtime)}"]
    job = job_file(tmp_path)
    doctor = subprocess.run([sys.executable, "-m", "ddpjob", "doctor", str(job), *sets], cwd=tmp_path,
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert any(ln.split()[:2] == ["container", "pass"] for ln in doctor.stdout.splitlines()), doctor.stdout
    if runtime == "pyxis":  # the template path
        ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), *sets,
               cwd=tmp_path)
        assert f"--container-image={image}" in (tmp_path / "job.sbatch").read_text()
        jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=env)
    else:  # the submitit path
        ddpjob("submit", str(job), "--backend", "slurm", "--run-dir", str(run), *sets, cwd=tmp_path, env=env)
        jid = json.loads((run / "job.json").read_text())["job_id"]
        slurmtools.submitted.append(jid)
    wait_step(run, 30, 0, jid)
    preempt_and_finish(run, jid, tmp_path, f"high-{runtime}")
    assert_same_as_reference(run, reference.run_dir())
    lines = log.read_text().splitlines()
    if runtime == "pyxis":  # one srun per start, every task started inside the image
        assert len(lines) == 2 and all(f"image={image} " in ln for ln in lines), lines
        assert all(f"{run}:{run}" in ln and f"workdir={run} " in ln for ln in lines), lines
    else:  # one `apptainer exec` per rank and start
        assert sorted(ln.split()[2] for ln in lines) == sorted([f"task={t}" for t in range(4)] * 2), lines
        assert all(f"image={image} " in ln and str(run) in ln.split("binds=")[1] for ln in lines), lines
