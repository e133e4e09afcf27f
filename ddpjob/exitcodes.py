"""Every exit status a ddpjob process ends with, defined once.

The login side (cli.py), the ranks (`ddpjob run`: rank/runner), the local supervisor, submitit's
NodeTask and the sbatch template (render.py passes them in as placeholders) all read these: a
change here changes all of them together. No torch: the login side imports it.
"""

from __future__ import annotations

OK = 0
ERROR = 1  # at run time: a failure the user can act on, an exception in their code, an internal error
USAGE = 2  # a bad command line, job file or override (errors.UsageError)
# `ddpjob run` only: every rank stopped at the same step, the checkpoint is written and the
# requeue decided (rank/requeue.py); whoever runs the ranks restarts them, or SLURM requeues
REQUEUE = 3
# `python -m ddpjob.rank.requeue` only (the batch script after a crash): the retry is decided,
# inside this allocation - run the ranks again, no requeue, no queue wait
RESTART = 4
INTERRUPTED = 130  # Ctrl-C in the terminal: 128 + SIGINT, as shells report it
