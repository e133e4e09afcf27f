"""The rank layer: what runs around the user's code on each rank, built from the node runtime
(node/) and the checkpoint store (store/). decide.py: the per-step stop/save decision."""
