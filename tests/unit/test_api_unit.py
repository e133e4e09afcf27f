"""The public API (ddpjob.init, Job, StepSampler) driven by a user script (tests/api_script.py)
in real processes: alone, and as 2 ranks under `ddpjob run` with a stop caused at a chosen step,
a resume, and a result bit-identical to an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys

from ranks import REPO, base_env


def test_ddpjob_package_import_stays_light() -> None:
    """`import ddpjob` on a login node must not import torch; ddpjob.init loads it on demand."""
    code = "import sys, ddpjob; assert 'torch' not in sys.modules; ddpjob.StepSampler; " \
           "assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=base_env(), cwd=REPO, timeout=60)
