"""Whose error ended a rank, said in one line and recorded: the user's (an exception raised in
their own code: the rank, the exception and their line), the machine's (out of memory, a passing
I/O failure of a shared file system, a peer gone) or ddpjob's own (an internal error). The rank's
crash record (events.jsonl: `stop` with `rank`) carries the class the policy's verdict reads
(ledger/crashes.classify), whoever decides it: the batch shell, the local supervisor, or the
next round of a torchrun (rank/rounds.py). Used by `ddpjob run` (runner.py) and by a script on
the API run alone or under torchrun (the Job's excepthook and at-exit close: Uncaught).
"""

from __future__ import annotations

import atexit
import errno
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from ddpjob import freeze
from ddpjob.errors import ClusterFailure, DDPJobError
from ddpjob.ledger import events, policy
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank.usertable import MissingUserKey


def report(raised: BaseException, job: Any, env: ClusterEnv, run_dir: Path | None, *,
           traceback_shown: bool = False) -> BaseException:
    """What ends this rank, as the one line to raise or print (`raised` itself where there is
    none better), with the rank's crash record written into the run dir. `job`: the rank's Job
    (None before init() made one). `traceback_shown`: the caller printed `raised`'s traceback
    (Python's excepthook)."""
    # A collective that failed in the user's code (DDP's all-reduce) becomes the hang watch's
    # line naming the ranks that did not arrive; other errors are told to the peers.
    reported = job.explain(raised) if job is not None else raised
    if reported is raised:
        reported = out_of_memory(raised, env.rank)  # the machine's limit, not a bug
    if reported is raised:
        reported = theirs(raised, env.rank, run_dir)  # an error in the user's own code is theirs
        if reported is not raised and not traceback_shown:
            traceback.print_exception(raised)  # the rank's log keeps the whole story
    where = job.run_dir if job is not None else run_dir
    # a start the budgets refused has its decision on record already (start.StartRefused)
    if where is not None and not isinstance(reported, SystemExit) and not getattr(reported, "on_record", False):
        from ddpjob.rank import startcheck

        why = reported.line() if isinstance(reported, DDPJobError) else one_line(reported)
        step = job.current_step if job is not None else None
        events.rank_crash(where, rank=env.rank, host=env.hostname, job_id=env.job_id,
                          restart=job.restart if job is not None else startcheck.attempt_of(env, events.read(where)),
                          error=why, step=step, **error_kind(raised, reported, run_dir))
        if not isinstance(reported, (DDPJobError, KeyboardInterrupt)) and not traceback_shown:
            traceback.print_exception(raised)  # a bug: the log keeps the full story on every rank
    return reported


class Uncaught:
    """A script on the API run alone or under torchrun (no `ddpjob run` around it): the Job's
    excepthook, which reports an uncaught error, and its close at exit. Installed by the Job."""

    def __init__(self, job: Any) -> None:
        self._job = job
        self._status: int | None = None  # the exit status of an uncaught error
        atexit.register(self._at_exit)
        self._excepthook = sys.excepthook
        sys.excepthook = self._report

    def _report(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        # Python prints the traceback, then the line; the rank's crash record is what a verdict
        # reads (the next round of a torchrun decides it: rank/rounds.py)
        job = self._job
        self._excepthook(kind, exc, tb)
        try:
            explained = report(exc, job, job.env, job.run_dir, traceback_shown=True)
        except Exception as failed:  # never hide the user's error behind ours
            print(f"ddpjob: rank {job.rank}: the crash could not be recorded ({failed!r})", file=sys.stderr, flush=True)
            explained = job.explain(exc)
        if isinstance(explained, DDPJobError):
            print(explained.line(), file=sys.stderr, flush=True)
        self._status = 130 if issubclass(kind, KeyboardInterrupt) else 1

    def _at_exit(self) -> None:
        """After an uncaught error this rank failed alone: its peers wait for it inside some
        collective, not in close()'s exit barrier, which would hold this process for the whole
        dist_timeout_s (300 s) so that torchrun or srun could not end the job before then. So: no
        barrier, and no interpreter teardown with the group left standing
        (dist.end_if_left_standing), as `ddpjob run` does."""
        self._job.close(failed=self._status is not None)
        if self._status is not None:
            from ddpjob.node import dist

            dist.end_if_left_standing(self._status)


def user_frame(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) where the exception comes from, if that is the user's code: the innermost
    frame outside the interpreter's library and installed packages (torch, numpy) is the
    user's, not ddpjob's. A syntax error's place is its own. None: ddpjob's own bug."""
    import sysconfig

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ddpjob package
    library = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}

    def under(path: str, folders: set[str] | list[str]) -> bool:
        full = os.path.abspath(path)
        return any(full == d or full.startswith(d.rstrip(os.sep) + os.sep) for d in folders)

    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        return (str(exc.filename), int(exc.lineno or 0)) if not under(exc.filename, [ours, *library]) else None
    # the innermost frame that is not library code: ddpjob's or the user's (for a key missing
    # from job.user, raised in ddpjob on purpose: the user's line that asked for it)
    theirs = isinstance(exc, MissingUserKey)
    innermost = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = frame.f_code.co_filename
        if not path.startswith("<") and not under(path, library) and not (theirs and under(path, [ours])):
            innermost = (path, line)
    return innermost if innermost is not None and not under(innermost[0], [ours]) else None


def theirs(exc: BaseException, rank: int, run_dir: Path | None = None) -> BaseException:
    """An exception raised in the user's own code, as one line that says so: the rank, the
    exception and their line, in their file rather than the run's frozen copy of it ("internal
    error" is for ddpjob's own bugs)."""
    if isinstance(exc, DDPJobError) or not isinstance(exc, Exception):
        return exc
    place = user_frame(exc)
    if place is None:
        return exc
    file, line = freeze.source_of(run_dir, place[0]), place[1]
    what = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    kind = type(exc).__name__
    if isinstance(exc, MissingUserKey):  # a KeyError to the user, its message unquoted
        kind, what = "KeyError", str(exc.args[0])
    return DDPJobError(f"rank {rank}: your code raised {kind}: {' '.join(what.split())[:300]} "
                       f"at {os.path.basename(file)}:{line}",
                       f"fix it in {file}; the traceback is in this rank's log")


# An OSError of these kinds in the user's code is a passing failure of the machine, most often a
# shared file system (NFS, Lustre, GPFS) timing out or a server restarting: retried once, not
# again at the same step and line (ledger/policy.py)
_TRANSIENT = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                        errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                        errno.EREMOTEIO, errno.EAGAIN, errno.EBUSY})


def error_kind(raised: BaseException, reported: BaseException, run_dir: Path | None) -> dict[str, Any]:
    """The crash record's verdict inputs (ledger/crashes.classify): whose error it is
    (policy.USER, TRANSIENT, INTERNAL or INFRASTRUCTURE), the exception's name and the user's
    file:line where it was raised in their code."""
    if isinstance(reported, ClusterFailure) or isinstance(raised, KeyboardInterrupt):
        return {"error_class": policy.INFRASTRUCTURE}  # a peer died, a stall, a node out of reach
    place = user_frame(raised)
    where = None if place is None else f"{os.path.basename(freeze.source_of(run_dir, place[0]))}:{place[1]}"
    kind = {"exception": type(raised).__name__, **({"where": where} if where else {})}
    if place is not None:  # raised in the user's code
        passing = isinstance(raised, (ConnectionError, TimeoutError)) or (
            isinstance(raised, OSError) and raised.errno in _TRANSIENT)
        return {"error_class": policy.TRANSIENT if passing else policy.USER, **kind}
    if isinstance(reported, DDPJobError):  # ddpjob refused what the user can fix: a setting, a file, memory
        return {"error_class": policy.USER, **kind}
    return {"error_class": policy.INTERNAL, **kind}  # ddpjob's own bug


def out_of_memory(exc: BaseException, rank: int) -> BaseException:
    """Running out of host or GPU memory is neither the user's bug nor ddpjob's: one line that says
    which memory and what to change. (The kernel's OOM killer sends SIGKILL instead: nothing runs
    here, and srun/the supervisor report the killed rank.)"""
    text = " ".join(str(exc).split())
    gpu = type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in text
    host = isinstance(exc, MemoryError) or "can't allocate memory" in text or "DefaultCPUAllocator" in text
    if not (gpu or host):
        return exc
    which = "GPU" if gpu else "host"
    place = user_frame(exc)
    at = f" at {os.path.basename(place[0])}:{place[1]}" if place else ""
    return DDPJobError(f"rank {rank} ran out of {which} memory{at} ({type(exc).__name__}: {text[:160]})",
                       "lower train.batch_size (train.accumulation_steps keeps the global batch)"
                       + ("" if gpu else ", or ask for more memory: [slurm] mem"))


def one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
