"""NodeTask: the callable a submitit job runs on the nodes, once per task (= rank) and per
incarnation. Node code: it runs `ddpjob run` (rank/runner.py) and turns its status into what
submitit expects. The login side builds it by module path only (launch/backends/submitit_slurm.py),
so this module must stay light to import: no torch, no node modules at import time.

Requeue contract on SLURM. `NodeTask` is stateless (a run dir path): every incarnation resumes
from the newest checkpoint in the run dir, so submitit may pickle it once and rerun it (a
successor job gets a copy of the pickle under its own id). On the node,
`ddpjob.rank.runner.run_node` replaces submitit's USR2/TERM handlers with flag-only ones; on a
stop rank 0's Job decides and does the requeue (rank/requeue.py, the one decision, preemption
within GraceTime included), and the task returns 3; `NodeTask` then ends with SystemExit(3) and
no result pickle, as submitit's own handler does after requeueing, so a submitit Job waits for
the next incarnation. 0 returns 0; a crash raises, so submitit records the failure, and the
batch shell's srun loop (DDPJOB_ATTEMPT set: launch/slurmopts.batch_shell_lines)
decides whether the ranks run again inside the allocation (max_failures); a job submitted before
that loop existed has rank 0 decide here instead (requeue.after_crash: a requeue). Should a signal reach
submitit's handler before ours is installed, `checkpoint()` hands submitit the same task.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from ddpjob import exitcodes, jobfile


class NodeTask:
    """The callable submitit pickles and runs once per task (= rank) and per incarnation."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = str(run_dir)

    def __call__(self) -> int:
        from ddpjob.rank.runner import run_node  # imported on the node: torch stays off the login node

        code = int(run_node(self.run_dir))
        if code == 0:
            return 0
        if code == exitcodes.REQUEUE:
            # rank 0's Job decided and did the requeue (rank/requeue.py): nothing to decide here
            raise SystemExit(exitcodes.REQUEUE)  # checkpoint written, requeue asked: no result pickle
        if code == exitcodes.RESTART:  # a straggler's exclusion: the batch shell runs the ranks again
            raise SystemExit(exitcodes.RESTART)
        retried = self._retried_after_crash(code)
        # A rank that failed alone may have left its process group standing, whose teardown can
        # abort (node/dist.py). submitit must still write its result pickle and re-raise first:
        # atexit runs after that, with the status the process ends with (1 for the exception).
        from ddpjob.node import dist

        atexit.register(dist.end_if_left_standing, code if retried else 1)
        if retried:
            raise SystemExit(code)  # brought back from the newest checkpoint: no result pickle
        raise RuntimeError(f"ddpjob run {self.run_dir} exited with {code}; see the rank logs "
                           f"(`ddpjob logs {self.run_dir} --rank R`)")

    def _retried_after_crash(self, code: int) -> bool:
        """Rank 0 hands a crash to requeue.py's one decision (max_failures); the batch script's
        equivalent for `ddpjob sbatch` jobs is in templates/sbatch.sh.tmpl."""
        from ddpjob.rank import requeue
        from ddpjob.node.cluster import ClusterEnv

        env = ClusterEnv.from_environ()
        if not env.is_rank0 or env.source != "slurm":
            return False
        if "DDPJOB_ATTEMPT" in env.ddpjob_vars:
            # the batch shell's srun loop decides once every task has ended (submitit_slurm's
            # ddpjob_srun): run again inside the allocation, or not at all. Deciding here
            # too would requeue the job under the loop's feet.
            return False
        return bool(requeue.after_crash(jobfile.read_run_config(self.run_dir), env,
                                        Path(self.run_dir), code))

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"NodeTask({self.run_dir!r})"
