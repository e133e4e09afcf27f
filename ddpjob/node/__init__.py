"""Node side: the cluster environment (SLURM / torchrun), the process group and every collective
(dist.py), preemption signals, the per-node runner, selftest and metrics."""
