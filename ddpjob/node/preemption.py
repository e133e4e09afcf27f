"""Preemption mechanics on the nodes: flag-only signal handlers, stop codes and the deadline
watch (SLURM's commands are in ddpjob/slurm.py).

rank/runner.py (or ddpjob.init()) installs the StopFlag; Job.steps() (rank/job.py) votes on its code once per
optimizer step (dist.Control.agree) so that every rank stops at the same step; requeue.py decides.
Nothing here saves or exits inside a signal handler (that is how Lightning hangs, #21406).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

from ddpjob import earlysignals

# Stop codes, ordered by precedence: the ranks all-reduce MAX, so the strongest reason wins. A
# straggler's exclusion ([slurm] on_straggler, rank/stragglerstop.py) is the weakest: a time limit,
# a requeue or a preemption at the same step decides instead. Never persisted: only the vote holds them.
NONE, STRAGGLER, DEADLINE, REQUEUE, PREEMPTED = 0, 1, 2, 3, 4
REASONS = {NONE: "", STRAGGLER: "straggler", DEADLINE: "deadline", REQUEUE: "requeue", PREEMPTED: "preempted"}


def signal_number(name: str | int) -> int:
    """'USR2' / 'SIGUSR2' / 12 -> 12."""
    if isinstance(name, int):
        return name
    return int(getattr(signal, "SIG" + name.upper().removeprefix("SIG")))


def stop_code_for(signum: int) -> int:
    """SIGTERM = preemption or scancel (requeue.py asks SLURM which); any other
    handled signal (USR2: the time-limit warning or `scancel --signal=USR2`) asks us to
    checkpoint and requeue ourselves."""
    return PREEMPTED if signum == signal.SIGTERM else REQUEUE


_child_ignores: tuple[int, ...] = ()


def _ignore_in_child() -> None:
    # Runs in forked children (DataLoader workers): they must not react to SLURM's signals; the
    # main process stops them itself. A Python handler inherited through fork would only set a
    # flag nobody reads, but SIG_IGN also covers signals that arrive before the child's code runs.
    for signum in _child_ignores:
        signal.signal(signum, signal.SIG_IGN)
    # A forked torch DataLoader worker then installs torch's own SIGTERM handler, which kills the
    # worker on any SIGTERM not sent by its parent: SLURM's preemption signals every process of
    # the step, so the rank would die of "DataLoader worker ... killed by signal: Terminated"
    # instead of stopping. Ignore the stop signals again right after torch set its handlers.
    handling = sys.modules.get("torch.utils.data._utils.signal_handling")
    torch_set = getattr(handling, "_set_worker_signal_handlers", None)
    if torch_set is not None and not getattr(torch_set, "_ddpjob", False):
        def set_then_ignore(*args: Any, **kwargs: Any) -> Any:
            out = torch_set(*args, **kwargs)
            for signum in _child_ignores:
                signal.signal(signum, signal.SIG_IGN)
            return out

        set_then_ignore._ddpjob = True  # type: ignore[attr-defined]
        handling._set_worker_signal_handlers = set_then_ignore  # type: ignore[union-attr]


def _kill_daemon_children() -> None:
    import multiprocessing

    children = [c for c in multiprocessing.active_children() if c.daemon]
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report the kills
    for child in children:
        child.kill()


# The stop signals a rank's launcher holds back until the rank's flag-only handlers are in place
# (StopFlag.install lets them through): a signal that came while Python was starting is then
# delivered to the flag, not lost to the default action (USR2's and TERM's end the process)
HELD = (signal.SIGUSR2, signal.SIGTERM)


def block_stop_signals() -> None:
    """In a launcher's child before exec (the local supervisor's ranks): the blocked mask survives
    exec, and what arrives meanwhile stays pending."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)


class StopFlag:
    """Signal handlers that only record (signal, time). `code` is read at step boundaries."""

    def __init__(self) -> None:
        self.code = NONE
        self.first = NONE  # the first stop code that came (a [train] command's stop is decided by it)
        self.signum: int | None = None
        self.time: float | None = None
        self.current_step = 0  # kept up to date by the trainer: where the signal found us
        self.signal_step: int | None = None
        self.detail: dict[str, Any] = {}  # what an in-process request says about itself (a straggler's host)
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, signals: Sequence[str | int] = ("USR2", "TERM")) -> StopFlag:
        """Replace whatever handlers were there (submitit's included) with flag-only ones."""
        global _child_ignores
        flag = cls()
        numbers = tuple(dict.fromkeys(signal_number(s) for s in signals))
        for signum in numbers:
            flag._previous[signum] = signal.signal(signum, flag._handle)
        if not _child_ignores:
            os.register_at_fork(after_in_child=_ignore_in_child)
            # Daemonic children (DataLoader workers) now ignore SIGTERM, and multiprocessing's
            # exit handler ends them with terminate() (SIGTERM) and then joins them: the process
            # would hang at exit. Kill them first (atexit runs the handlers registered last first).
            import atexit
            import multiprocessing.util  # noqa: F401  (its exit handler is registered before ours)

            atexit.register(_kill_daemon_children)
        _child_ignores = numbers
        # what came before: a signal earlysignals.hold noted (one not among ours gets its default back),
        # and one the launcher held back (block_stop_signals), which arrives as the mask opens
        for signum in earlysignals.EARLY:
            if signum not in numbers and signal.getsignal(signum) is earlysignals.note:
                signal.signal(signum, signal.SIG_DFL)
        while earlysignals.noted:
            signum, when = earlysignals.noted.pop(0)
            if signum in numbers:
                flag._handle(signum, None)
                flag.time = min(flag.time or when, when)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
        return flag

    def _handle(self, signum: int, frame: Any) -> None:
        # Only assignments: safe at any bytecode boundary, never blocks, never re-enters torch.
        code = stop_code_for(signum)
        if self.first == NONE:
            self.first = code
        if code > self.code:
            self.code, self.signum, self.time = code, signum, time.time()
            self.signal_step = self.current_step

    def request(self, code: int, **detail: Any) -> None:
        """A stop from inside the process (the deadline watch; rank 0 for a straggler, with its
        `detail`: the host to leave out, the line)."""
        if code > self.code:
            self.code, self.time = code, time.time()
            self.detail = dict(detail)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def describe(self) -> str:
        if self.signum is not None:
            return f"{signal.Signals(self.signum).name} during step {(self.signal_step or 0) + 1}"
        return REASONS[self.code] or "no stop requested"


@dataclass
class DeadlineWatch:
    """Stop before the time limit even if no warning signal comes (no --signal, or it was lost).

    Stop when the remaining time falls below (step + checkpoint time) x safety + margin (an
    evaluation inside a step raises the step estimate):
    the step in flight (and, with an overlapped stop vote, one more) must finish, then the
    checkpoint must be written, before SLURM's SIGKILL.
    Times are measured as the job runs; the checkpoint time starts from a guess until a save
    has been timed.
    """

    end_time: float | None
    safety: float = 1.5
    margin_s: float = 30.0
    step_s: float = 0.0
    checkpoint_s: float = 10.0
    lag_steps: int = 0  # steps run after the decision to stop (train.stop_vote = "overlap": 1)
    clock: Callable[[], float] = time.time

    def observe_step(self, seconds: float) -> None:
        # Slow-moving max-biased average: one slow step (eval, GC) should raise the estimate.
        self.step_s = max(seconds, 0.9 * self.step_s + 0.1 * seconds)

    def observe_checkpoint(self, seconds: float) -> None:
        self.checkpoint_s = seconds

    def needed_s(self) -> float:
        return ((1 + self.lag_steps) * self.step_s + self.checkpoint_s) * self.safety + self.margin_s

    def remaining_s(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.clock()

    def expired(self) -> bool:
        left = self.remaining_s()
        return left is not None and left < self.needed_s()
