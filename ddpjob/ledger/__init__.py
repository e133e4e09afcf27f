"""The run's history and what follows from it (torch-free; login side and nodes alike).

events     every record kind of RUN_DIR/events.jsonl as a type, the schema version, the one
           writer and reader (docs/events.md)
attempts   the run's attempts, numbered once across submit, requeue, restart in place,
           `ddpjob resume`, `ddpjob run` by hand and torchrun rounds
budget     requeues and failures spent, over a submission's job chain
crashes    who failed, where and how; the crash's verdict class; the host ledger; crash loops
requests   `ddpjob stop`'s request and whether it was answered
policy     pure: the facts of a stop or crash in, one verdict out (requeue / restart here / end)
phases     a recovery's phases, from the stop signal to the next attempt's first step
goodput    pure: the goodput ledger, the run's wall time by category over every attempt (status
           and plot with sacct's starts of each job, rank 0's trackers without)

The rank layer (rank/requeue.py) and the local supervisor (launch/local.py) gather the facts and
carry the verdict out; neither decides.
"""
