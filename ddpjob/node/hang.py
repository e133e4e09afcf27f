"""Nothing hangs: when a collective fails on a rank (timed out after train.dist_timeout_s, or a
peer is gone), name the ranks that did not arrive and where they were, write every thread's
stack to every rank's log, and make every rank end.

Every collective ddpjob runs goes through dist.py's `guard` (and a failure in DDP's own
gradient all-reduce reaches runner.py / the excepthook of a script run alone), so the process
group timeout bounds each of them; this module turns the bare "Timed out waiting 300000ms for
recv" into the one line a user needs. How: each rank keeps a second connection to rank 0's
TCPStore (the one the process group was built on) and a daemon thread that polls it every
couple of seconds. The rank whose collective failed sets an alarm key; every rank's thread then
reports where its main thread is (which collective, which step, the innermost frame), dumps
all stacks with faulthandler into the rank log and, if its main thread has not ended on its own
within EXIT_AFTER_S (a rank stuck in its own code never will), ends the process. So the whole
job ends within dist_timeout_s + REPORT_S + EXIT_AFTER_S + one poll, well under +60 s.

A collective one rank issues and another does not (an averaged `job.log` inside `if rank == 0`)
is told sooner, and by name: a rank inside one of ddpjob's collectives for MISMATCH_S asks the
others where they are (a "peek" key they answer only while they wait themselves); one already
at a later step passed that step without the call, which is a certain deadlock, not a slow peer.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ddpjob.errors import ClusterFailure, DDPJobError

POLL_S = 2.0  # how often each rank looks for the alarm: one tiny store request
REPORT_S = 10.0  # how long the failing rank waits for the others' reports
EXIT_AFTER_S = 20.0  # then a rank whose main thread is still running is ended
# a rank inside one collective this long asks where the others are (_peek): none is ever this
# long in a collective a peer went past; a healthy one ends within milliseconds of the last arrival
MISMATCH_S = 10.0
BACKWARD = "DDP's gradient all-reduce (in the backward pass)"

# What gloo, NCCL and the TCPStore say when a peer is late or gone (torch.distributed.DistError
# and its subclasses are matched by type).
_COMM_FAILURE = re.compile(r"timed out|timeout|connection (closed|reset|refused)|broken pipe|"
                           r"peer|socket|nccl (error|watchdog)|gloo", re.IGNORECASE)


# The standard library and installed packages (torch): where a stuck rank waits, not why.
_LIBRARY_DIRS = tuple(sorted({os.path.join(sysconfig.get_paths()[k], "") for k in
                              ("stdlib", "platstdlib", "purelib", "platlib")} | {"<frozen"}))


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that failed because of the other ranks, not a bug in the call."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc)))


@dataclass
class Report:
    """Where one rank's main thread was when the alarm came."""

    rank: int
    host: str
    step: int | None
    inside: str | None  # the ddpjob collective it waited in, None: its own code
    frame: str  # innermost frame of the main thread, "file.py:12 in fn"
    for_s: float  # how long it had been there (since the collective began / the step began)
    backward: bool  # the main thread is in autograd's backward (DDP's all-reduce waits there)
    failed: str | None = None  # this rank raised (its one-line error)


class Watch:
    """One rank's hang watch. The main thread only sets attributes (`step`, and `enter`/`leave`
    around a collective): no cost per step beyond that."""

    def __init__(self, rank: int, world_size: int, host: str, master_addr: str, master_port: int,
                 agent_round: int | None = None) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self.host = rank, world_size, host
        self.steps: Any = None  # the Job's StopFlag: its current_step is the step this rank is at
        self.inside: str | None = None
        self.since = time.monotonic()
        self._main = threading.main_thread().ident
        # One client, used by the listener thread and the main thread. c10d's client has a
        # mutex of its own (activeOpLock_), but a request is several socket writes and reads:
        # _LockedStore makes one request at a time certain whatever the torch version does.
        self._store = _LockedStore(dist.TCPStore(master_addr, master_port, is_master=False,
                                                 timeout=timedelta(seconds=REPORT_S),
                                                 wait_for_workers=False))
        # Keys of this process group only: torchrun's agent keeps its store across its restart
        # rounds (a round that crashed before all its ranks joined would shift a count).
        self._prefix = f"ddpjob/hang/{0 if agent_round is None else agent_round}/"
        self._alarm_key, self._reported_key = self._key("alarm"), self._key("reported")
        self._peek_key, self._answered, self._asked = self._key("peek"), 0, -1.0
        self._store.set(self._key(f"host/{rank}"), host)  # named even if it never reports
        self._closed = threading.Event()
        _enable_faulthandler()
        self._thread = threading.Thread(target=self._listen, name="ddpjob-hang-watch", daemon=True)
        self._thread.start()

    def _key(self, name: str) -> str:
        return self._prefix + name

    @property
    def step(self) -> int | None:
        return getattr(self.steps, "current_step", None)

    # ------------------------------------------------------------------ main thread
    def enter(self, what: str) -> None:
        self.inside, self.since = what, time.monotonic()

    def leave(self) -> None:
        self.inside, self.since = None, time.monotonic()

    def close(self) -> None:
        self._closed.set()

    def diagnose(self, what: str, exc: BaseException) -> ClusterFailure:
        """Called by the rank whose collective `what` failed with `exc`: wake every rank's
        watch, gather their reports and say in one line who did not arrive."""
        waited = time.monotonic() - self.since
        cause = " ".join(str(exc).split())[:160] or type(exc).__name__
        here = f"{what} at step {self.step}" if self.step is not None else what
        try:
            self._store.set(self._alarm_key, str(self.rank))
            self._publish(self._report(what))
            reports = self._gather()
        except Exception:  # noqa: BLE001 - rank 0's store is gone with rank 0
            return ClusterFailure(
                f"rank {self.rank} on {self.host}: {here} failed after {waited:.0f} s ({cause}), and "
                "rank 0's store no longer answers: rank 0 has ended or its node is gone",
                "look at rank 0's log for why it ended; every rank's stack is in its log")
        failed = min((r.rank for r in reports.values() if r.failed and r.rank != self.rank), default=None)
        # A peer that raised is the cause: its traceback is the place to look, not the timeout.
        hint = (f"rank {failed}'s log holds its traceback; every rank's log holds every "
                "thread's stack at that moment" if failed is not None else
                "each rank's log holds every thread's stack at that moment; if a step can "
                "legitimately take this long, raise train.dist_timeout_s")
        return ClusterFailure(f"rank {self.rank} on {self.host}: {here} failed after {waited:.0f} s "
                           f"({cause}); {describe(what, self.step, reports, self._hosts())}", hint)

    def explain(self, exc: BaseException) -> BaseException:
        """For an exception that ends this rank outside ddpjob's collectives: a collective that
        failed in the user's code (DDP's gradient all-reduce) becomes the diagnosis; any other
        error is told to the peers waiting for this rank, so that their line names the cause
        instead of "did not arrive". Returns what to report: `exc` or the DDPJobError."""
        if isinstance(exc, (DDPJobError, SystemExit, KeyboardInterrupt)):
            return exc
        if is_comm_failure(exc):
            frames = traceback.extract_tb(exc.__traceback__)
            return self.diagnose(BACKWARD if _in_backward(frames) else "a collective of the training code", exc)
        try:
            self._publish(self._report(self.inside, failed=" ".join(f"{type(exc).__name__}: {exc}".split())[:300]))
        except Exception:  # noqa: BLE001 - the store is gone: nothing to tell
            pass
        return exc

    # ------------------------------------------------------------------ both threads
    def _report(self, inside: str | None, failed: str | None = None) -> Report:
        frame, backward = "?", False
        top = sys._current_frames().get(self._main) if self._main is not None else None
        if top is not None:
            stack = traceback.extract_stack(top)
            # The innermost frame of the user's (or ddpjob's) code, not threading.py's wait().
            last = next((f for f in reversed(stack) if not f.filename.startswith(_LIBRARY_DIRS)), stack[-1])
            frame = f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"
            backward = _in_backward(stack)
        return Report(self.rank, self.host, self.step, inside, frame,
                      round(time.monotonic() - self.since, 1), backward, failed)

    def _publish(self, report: Report) -> None:
        first = not self._store.check([self._key(f"where/{self.rank}")])
        self._store.set(self._key(f"where/{self.rank}"), json.dumps(report.__dict__))
        if first:
            self._store.add(self._reported_key, 1)

    def _gather(self) -> dict[int, Report]:
        deadline = time.monotonic() + REPORT_S
        # A stop signal ends the wait, or spares it when it came first: srun ends the step
        # (SIGTERM, then SIGKILL after KillWait, 30 s by default) once a rank died, and a dead
        # rank never reports. Waiting on would cost the restart inside the allocation that much,
        # for reports that cannot come. The SIGTERM often comes before this rank's collective
        # fails (it was still computing when its peer was killed): bench P12 saw 2 of 10
        # recoveries wait out KillWait (5 s there) when only a signal during the wait counted.
        def ending() -> bool:
            return getattr(self.steps, "time", None) is not None
        while (self._store.add(self._reported_key, 0) < self.world_size and time.monotonic() < deadline
               and not ending()):
            time.sleep(0.25)
        if not ending():
            time.sleep(0.5)  # ranks whose own collective fails a moment later re-report as waiting
        out: dict[int, Report] = {}
        for r in range(self.world_size):
            key = self._key(f"where/{r}")
            if self._store.check([key]):
                out[r] = Report(**json.loads(self._store.get(key)))
        return out

    def _hosts(self) -> dict[int, str]:
        keys = [self._key(f"host/{r}") for r in range(self.world_size)]
        return {r: self._store.get(k).decode() for r, k in enumerate(keys) if self._store.check([k])}

    # ------------------------------------------------------------------ the watch thread
    def _listen(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                if not self._store.check([self._alarm_key]):
                    self._peek()
                    continue
                who = self._store.get(self._alarm_key).decode()
                if who != str(self.rank):
                    self._publish(self._report(self.inside))
            except Exception:  # noqa: BLE001 - rank 0 (the store) has ended: so does the job
                return
            print(f"[ddpjob] rank {self.rank} on {self.host}: a collective failed on rank {who}; "
                  "every thread's stack follows", file=sys.stderr, flush=True)
            dump_stacks()
            if self._closed.wait(EXIT_AFTER_S):
                return  # the main thread ended on its own (it raised from its collective)
            print(f"ddpjob: error: rank {self.rank} on {self.host} was still running "
                  f"{EXIT_AFTER_S:g} s after rank {who}'s collective failed (at "
                  f"{self._report(self.inside).frame}), expected it to end with the job. Hint: its "
                  "stack is above; ending this process", file=sys.stderr, flush=True)
            os._exit(1)


    def _peek(self) -> None:
        """The watch thread, between alarms: while the main thread waits (the same place for
        POLL_S), answer a rank that asks where everyone is; inside one of ddpjob's collectives for
        MISMATCH_S, ask. Ranks that do not wait add no request."""
        inside, since, step = self.inside, self.since, self.step
        waited = time.monotonic() - since
        if waited < POLL_S:
            return
        asked = self._store.add(self._peek_key, 0)
        if asked != self._answered:
            self._answered = asked
            self._store.set(self._key(f"peek/{self.rank}"), json.dumps({"asked": asked, **self._report(inside).__dict__}))
        if inside is None or step is None or waited < MISMATCH_S or self._asked == since:
            return
        self._asked = since  # once per collective entered, and by one of the ranks waiting in it
        if self._store.add(self._key(f"asking/{step}/{inside}"), 1) != 1:
            return
        asked = self._answered = self._store.add(self._peek_key, 1)
        answers = self._gather_peeks(asked)
        answers[self.rank] = self._report(inside)
        ahead = {r: rep for r, rep in answers.items() if rep.step is not None and rep.step > step}
        if ahead and self.inside == inside and self.since == since:  # still in that very call
            print(mismatch(inside, step, answers, ahead).line(), file=sys.stderr, flush=True)
            self._store.set(self._alarm_key, str(self.rank))  # the peers dump their stacks and end
            os._exit(1)  # the main thread waits inside gloo, which no Python exception reaches

    def _gather_peeks(self, asked: int) -> dict[int, Report]:
        """The reports of the ranks that answered peek number `asked` within REPORT_S."""
        keys = {r: self._key(f"peek/{r}") for r in range(self.world_size) if r != self.rank}
        out: dict[int, Report] = {}
        deadline = time.monotonic() + REPORT_S
        while len(out) < len(keys) and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)  # each waiting rank answers at its next poll: few sweeps
            for r, key in keys.items():
                if r not in out and self._store.check([key]):
                    got = json.loads(self._store.get(key))
                    if got.pop("asked") >= asked:
                        out[r] = Report(**got)
        return out


def mismatch(what: str, step: int, answers: dict[int, Report], ahead: dict[int, Report]) -> DDPJobError:
    """The line for a collective that some ranks issued at `step` and the ranks `ahead` went past."""
    called = sorted(r for r, rep in answers.items() if rep.inside == what and rep.step == step)
    where = "; ".join(f"rank {r} ({rep.host}) went on to step {rep.step}"
                      + (f" and waits in {rep.inside}" if rep.inside else
                         " and waits in DDP's gradient all-reduce" if rep.backward else f" ({rep.frame})")
                      for r, rep in sorted(ahead.items()))
    ranks = ", ".join(map(str, called)) or "?"
    return DDPJobError(f"{what} at step {step} was called on rank{'s' if len(called) > 1 else ''} {ranks} "
                       f"but not on every rank ({where}), expected every rank to make each collective call",
                       "a collective (job.log(..., average=...), job.all_reduce, job.finish) runs on every "
                       "rank: move it out of `if rank == 0:` (job.log without average may stay inside)")


class _LockedStore:
    """The four TCPStore requests the watch makes, one at a time across threads."""

    def __init__(self, store: Any) -> None:
        self._store, self._lock = store, threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self._lock:
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return bytes(self._store.get(key))

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return bool(self._store.check(keys))

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._store.add(key, amount))


def describe(what: str, step: int | None, reports: dict[int, Report], hosts: dict[int, str]) -> str:
    """Who did not arrive at `what` (of `step`), from the ranks' reports: the part of the error
    line that names ranks, hosts and where each one was."""
    late, failed, silent = [], [], []
    for r in sorted(set(hosts) | set(reports)):
        rep = reports.get(r)
        host = hosts.get(r, rep.host if rep else "?")
        if rep is None:
            silent.append(f"rank {r} ({host})")
        elif rep.failed:
            failed.append(f"rank {r} ({host}) failed: {rep.failed[:200]}")
        elif _arrived(rep, what, step):
            continue
        elif rep.inside:
            late.append(f"rank {r} ({host}) was in {rep.inside} at step {rep.step} for {rep.for_s:.0f} s")
        else:
            late.append(f"rank {r} ({host}) did not arrive: it was running its own code at "
                        f"{rep.frame} (step {rep.step}, for {rep.for_s:.0f} s)")
    parts = failed + late
    if silent:
        parts.append(f"{', '.join(silent)} did not answer (the process ended or is stuck outside "
                     "Python: see its log)")
    return "; ".join(parts) if parts else "every rank had arrived: the network between the nodes failed"


def _arrived(rep: Report, what: str, step: int | None) -> bool:
    if step is not None and rep.step is not None and rep.step != step:
        return False
    return rep.inside == what or (what == BACKWARD and rep.inside is None and rep.backward)


def _in_backward(frames: traceback.StackSummary) -> bool:
    # DDP's gradient all-reduce runs in autograd's engine, entered through these functions.
    return any("autograd" in f.filename and f.name in ("backward", "_engine_run_backward") for f in frames)


def dump_stacks() -> None:
    """Every thread's stack to stderr (the rank log): faulthandler writes it without the GIL
    dance; where stderr is no real file (a captured test), the Python equivalent."""
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):
        for ident, frame in sys._current_frames().items():
            print(f"Thread 0x{ident:x}:\n{''.join(traceback.format_stack(frame))}", file=sys.stderr)
    sys.stderr.flush()


def _enable_faulthandler() -> None:
    # Fatal signals (a segfault, NCCL's watchdog aborting the process) dump every thread's stack too.
    try:
        if not faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass


def make(env: Any) -> Watch | None:
    """The watch for a process group built on rank 0's TCPStore at MASTER_ADDR:MASTER_PORT."""
    try:
        return Watch(env.rank, env.world_size, env.hostname, env.master_addr, env.master_port, env.agent_round)
    except Exception as exc:  # noqa: BLE001 - no watch is no reason to stop training
        print(f"ddpjob: warning: rank {env.rank}: no hang watch ({' '.join(str(exc).split())[:120]})",
              file=sys.stderr, flush=True)
        return None
