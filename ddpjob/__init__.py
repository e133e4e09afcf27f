"""ddpjob: preemption-proof PyTorch DDP training on SLURM clusters.

Login node: `ddpjob submit|sbatch|status|logs|cancel|ls|doctor` (ddpjob.cli), never importing torch.
Compute nodes, from your own script (docs/api.md):

    import ddpjob
    job = ddpjob.init()
    sampler = ddpjob.StepSampler(len(dataset), global_batch=256, seed=0)

The public names load lazily, so `import ddpjob` on a login node stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpjob.version import __version__

__all__ = ["Job", "PerRank", "StepSampler", "init"]

if TYPE_CHECKING:
    from ddpjob.api import Job, init
    from ddpjob.node.sampler import StepSampler
    from ddpjob.store.perrank import PerRank


def __getattr__(name: str) -> Any:
    if name in ("init", "Job"):
        from ddpjob import api

        return getattr(api, name)
    if name == "StepSampler":
        from ddpjob.node.sampler import StepSampler

        return StepSampler
    if name == "PerRank":  # a value of `state` that each rank keeps its own of
        from ddpjob.store.perrank import PerRank

        return PerRank
    raise AttributeError(f"module 'ddpjob' has no attribute {name!r}")
