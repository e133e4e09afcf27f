"""Checkpoints: the atomic on-disk store (commit.py), host snapshots and background writes
(snapshot.py), RNG state (rng.py), the save schedule (schedule.py) and what a training
checkpoint holds and how a resume restores it (state.py)."""
