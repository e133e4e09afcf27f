"""ddpjob: preemption-proof PyTorch DDP training on SLURM clusters.

Login node: `ddpjob submit|sbatch|status|logs|cancel|ls|doctor` (ddpjob.cli).
Compute nodes: `ddpjob run` -> ClusterEnv -> process group -> trainer <-> checkpoint store.
"""

__version__ = "0.1.0"
