"""The runtime primitives of a rank: the cluster environment (cluster.py, hostlist.py), the
process group (group.py) and every collective (dist.py; the gradients' in gradsync.py, a model's
whole state's in modelsync.py), the hang watch, preemption signals,
the sampler, metrics, determinism, FSDP, the compile cache and selftest. What runs them around
the user's code is the rank layer (ddpjob/rank/)."""
