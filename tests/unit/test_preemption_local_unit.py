"""The preemption protocol with local processes (the SLURM versions come in the cluster tests).

A signal reaches one rank (or all) mid-run -> every rank stops at the same optimizer step,
writes the checkpoint, exits 3; a restart resumes, and the end result is bit-identical to a
run that was never interrupted: final model, optimizer state, every per-step loss.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddpjob.node import preemption



# ------------------------------------------------------------------ the mechanics, in-process
def test_stop_flag_handlers_only_record(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    flag = preemption.StopFlag.install(["USR2", "TERM"])
    try:
        flag.current_step = 7
        os.kill(os.getpid(), signal.SIGUSR2)
        assert (flag.code, flag.signum, flag.signal_step) == (preemption.REQUEUE, signal.SIGUSR2, 7)
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption outranks the requeue request
        assert flag.code == preemption.PREEMPTED
        os.kill(os.getpid(), signal.SIGUSR2)  # ...and is not downgraded again
        assert flag.code == preemption.PREEMPTED and flag.signum == signal.SIGTERM
        pid = os.fork()
        if pid == 0:  # a forked worker ignores the stop signals
            os._exit(0 if signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN else 1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == previous


def test_end_time_from_squeue_and_deadline_arithmetic(fake_slurm) -> None:
    from ddpjob import slurm

    fake_slurm.answer("squeue -h -j 77 -o %e", "2030-01-02T03:04:05\n")
    assert slurm.end_time("77") == time.mktime((2030, 1, 2, 3, 4, 5, 0, 0, -1))
    assert slurm.parse_time("N/A") is None and isinstance(slurm.end_time(""), slurm.Failed)
    now = [1000.0]
    watch = preemption.DeadlineWatch(end_time=1100.0, safety=2.0, margin_s=10.0, clock=lambda: now[0])
    watch.observe_step(1.0)
    watch.observe_checkpoint(4.0)
    assert watch.needed_s() == (1.0 + 0.0 + 4.0) * 2.0 + 10.0  # 20 s
    assert not watch.expired()
    now[0] = 1081.0  # 19 s left
    assert watch.expired()
    assert not preemption.DeadlineWatch(end_time=None).expired()


def test_a_stop_noted_before_the_flag_existed_is_handed_to_it() -> None:
    """`python -m ddpjob run` notes a stop signal from its first line (ddpjob/earlysignals.py);
    the StopFlag installed after the imports takes it over, with the time it came; a signal the
    job does not use as a stop gets its default action back."""
    import os
    import signal

    from ddpjob import earlysignals
    from ddpjob.node import preemption

    earlysignals.hold()
    os.kill(os.getpid(), signal.SIGUSR2)
    flag = preemption.StopFlag.install(["USR2", "TERM"])
    try:
        assert flag.code == preemption.REQUEUE and flag.signum == signal.SIGUSR2 and flag.time is not None
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        flag.uninstall()
