"""The public API: ddpjob's preemption-proof core for any training loop (docs/api.md).

    job = ddpjob.init()                      # environment, process group, device, run dir, stop handlers
    model = job.wrap(model)                  # to the device, DDP
    sampler = ddpjob.StepSampler(len(ds), global_batch=256, seed=0)
    state = {"model": model, "optimizer": opt, "sampler": sampler}
    job.resume(state)                        # newest valid checkpoint + every RNG
    batches = iter(DataLoader(ds, batch_sampler=sampler))
    for step in job.steps(state, total):     # stop vote, checkpoints, deadline, requeue
        ...one optimizer step on next(batches)...
        job.log(step + 1, loss=loss)
    job.finish(model)

`ddpjob run` (and so submit, sbatch and the local backend) prepares the config and the run dir
and then runs the job file's `train.entry`, whose `ddpjob.init()` picks them up; a script started
alone or under torchrun gets a new run dir under ./runs/. The built-in trainer uses only this.

This module is only the face: the rank layer (ddpjob/rank/) does the work. start.py: init()
and the hand-over from `ddpjob run`; job.py: the Job. (ddpjob.StepSampler is node/sampler.py's,
loaded by ddpjob/__init__.py: importing this face does not import torch.)
"""

from __future__ import annotations

from ddpjob.rank.job import Job
from ddpjob.rank.loopevents import StopForRequeue
from ddpjob.rank.start import AlreadyCompleted, current, init

__all__ = ["AlreadyCompleted", "Job", "StopForRequeue", "current", "init"]
