"""The rank layer: what runs around the user's code on each rank, built from the node runtime
(node/) and the checkpoint store (store/). runner.py (`ddpjob run`) -> entry.py (train.entry)
-> start.py (`ddpjob.init()`) -> job.py (the Job; decide.py: the per-step stop/save decision;
records.py: metrics and sample logs); requeue.py: SLURM's side of a stop's and a crash's
recovery (ledger/recovery.py decides)."""
