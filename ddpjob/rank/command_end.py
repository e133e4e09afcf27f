"""How a [train] command's program ended, in ddpjob's terms (pure: rank/command.py runs the
program, this reads its end): its exit status, whether ddpjob had sent the stop signal, and the
last Python traceback on its stderr become this rank's Ending: done, a stop for a requeue (with
what the program did about it), or a crash with its class, exception and the user's file:line.

The rule, as torchrun users' programs behave (docs/commands.md, "Signals, grace and exit status"):
after ddpjob's own stop signal, whatever the program does to end is a stop, never COMPLETED and
never a crash: it saved and left (any exit status of its own handler, Lightning's 0 included), it
had no handler and died of the signal, it outlived the grace and was killed, or a peer that
stopped first made its collective fail ("Connection reset by peer"). Only an exception of its
own (a traceback that is not a peer's end) stays a crash.
"""

from __future__ import annotations

import os
import re
import signal
import sysconfig
from dataclasses import dataclass
from typing import Any

from ddpjob import exitcodes
from ddpjob.ledger import policy
from ddpjob.ledger.programend import DIED, EXITED, KILLED, PEER_GONE
from ddpjob.node.cluster import PORT_IN_USE

FINAL_LINES = 200  # a traceback that begins within them is the program's last words

_FRAME = re.compile(r'\s*File "(.+)", line ([0-9]+)(?:, in .*)?')
_RANK_PREFIX = re.compile(r"^\[rank[0-9]+\]: ")  # torch.distributed's excepthook marks each line
_EXCEPTION = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)(?:: (.*))?")
# A collective that failed because a peer is gone (its process died, its node left): the peer's
# end is the crash, this rank's exception only follows from it (as the API's ClusterFailure)
_PEER_GONE = re.compile(r"DistBackendError|DistNetworkError|DistStoreError|Connection (?:closed|reset) by peer"
                        r"|Broken pipe|NCCL communicator was aborted|[Ww]atchdog caught collective operation timeout")



@dataclass(frozen=True)
class Raised:
    """The last Python traceback a program printed: its exception and the innermost frame of its
    own code (not the interpreter's library or an installed package), where one is shown."""

    exception: str  # "ValueError" (a module-qualified name without its module)
    message: str
    where: str | None  # "train.py:42"


def _library(path: str) -> bool:
    folders = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return (path.startswith("<") or "/site-packages/" in path or "/dist-packages/" in path
            or any(path.startswith(d.rstrip("/") + "/") for d in folders))


def last_traceback(text: str) -> Raised | None:
    """The last traceback in a program's stderr (a chained exception's last part is the one that
    ended it), or None where none was printed."""
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    frames: list[tuple[str, str]] = []
    for line in lines[starts[-1] + 1:]:
        if m := _FRAME.fullmatch(line):
            frames.append((m.group(1), m.group(2)))
        elif line[:1] in (" ", "\t", ""):
            continue  # the frame's source line, the caret markers
        elif m := _EXCEPTION.fullmatch(line):
            theirs = [f for f in frames if not _library(f[0])] or frames
            where = f"{os.path.basename(theirs[-1][0])}:{theirs[-1][1]}" if theirs else None
            return Raised(m.group(1).rsplit(".", 1)[-1], " ".join((m.group(2) or "").split())[:300], where)
        else:
            break
    return None


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, cut at a word's end with an ellipsis (an error line
    cut mid-word reads as another word: "remote w at")."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "…"


@dataclass(frozen=True)
class Ending:
    """How this rank ends after its program did: its exit status, whether it stopped for a requeue
    (rank 0 records the stop) and what the program did about the stop signal (`program`), the
    fields of its crash record (None: no crash), and the signal it dies by (the program's own
    death, passed on so that srun / the supervisor see it)."""

    code: int
    stop: bool = False
    crash: dict[str, Any] | None = None
    signum: int | None = None
    program: str | None = None  # after a stop: EXITED, DIED, KILLED or PEER_GONE
    note: str | None = None  # a line for the rank's log about how the ending was read
    # read as exit 0 from a teardown abort alone (no trainer's `end` line vouches for it): rank 0
    # completes the run only where some rank's program exited 0 by itself (rank/command.py)
    teardown: bool = False


# What libstdc++ prints when a std::thread still running is destroyed: torch's gloo threads met
# by the interpreter's end (the trainers leave the process group standing; a script that calls
# destroy_process_group meets it too, less often)
TEARDOWN_ABORT = "terminate called without an active exception"


def _teardown_abort(returncode: int, stderr_tail: str) -> bool:
    """The program died of SIGABRT with TEARDOWN_ABORT among its last words."""
    return (returncode in (-signal.SIGABRT, 128 + signal.SIGABRT)
            and TEARDOWN_ABORT in "\n".join(stderr_tail.splitlines()[-5:]))


def ending(returncode: int, *, requeue_exit: int, stopped: bool, stop_signal: int = signal.SIGTERM,
           killed: bool = False, hang_s: float | None = None, stderr_tail: str = "",
           trainer_ended: int | None = None, alone: bool = False, port: int | None = None,
           port_ours: bool = True) -> Ending:
    """The program's exit status -> this rank's ending. `stopped`: ddpjob sent it the stop signal
    (its module docstring: then any end but its own exception is a stop); `killed`: ddpjob's
    SIGKILL after the grace (SLURM's own SIGKILL ending a step is no stop); `hang_s`: ddpjob
    ended it as hung. Without a stop: 0 done; `requeue_exit` a stop (a time-limit stop of the
    program's own); a traceback a crash named after it (the user's, or infrastructure where it
    says a peer is gone); killed by a signal what the cluster broke; another status the user's.
    `trainer_ended`: the step at which an integration said the trainer's run ended by itself
    (metricslines.trainer_ended): a SIGABRT after it, with TEARDOWN_ABORT as the program's last
    words, is the interpreter's end meeting torch's threads, not a crash: done (after the stop
    signal, such an abort is the program's exit: a stop, as if it had exited 0). Without that
    line such an abort is read as exit 0 with `teardown` set: rank 0 completes the run only where
    a peer's program exited 0 by itself; every rank aborted, or the program runs `alone` (the
    job's one rank): unvouched_teardown(), a crash. `port` the
    MASTER_PORT the program got, `port_ours` ddpjob chose it (not the user): a program that could
    not listen on it met another program on the node, retried on another port."""
    if hang_s is not None:
        return Ending(exitcodes.ERROR, crash={
            "error": f"the command stopped making progress: no output or heartbeat for {hang_s:.0f} s",
            "error_class": policy.INFRASTRUCTURE})
    # Its last words a traceback: it raised, whatever signal came while it was ending (srun ends
    # the step with SIGTERM once a peer died, and that peer's death is what made it raise)
    raised = last_traceback("\n".join(stderr_tail.splitlines()[-FINAL_LINES:]))
    peer_gone = raised is not None and bool(_PEER_GONE.search(f"{raised.exception}: {raised.message}"))
    abort = raised is None and _teardown_abort(returncode, stderr_tail)
    if stopped:
        if returncode in (0, requeue_exit):  # its handler saved (or not) and left: Lightning's 0 too
            return Ending(exitcodes.REQUEUE, stop=True, program=EXITED)
        if abort:  # it left after the stop, and its interpreter's end met torch's threads
            return Ending(exitcodes.REQUEUE, stop=True, program=EXITED,
                          note=f"the program left after the stop signal, then its interpreter aborted in torch's "
                               f"teardown ({TEARDOWN_ABORT!r}): read as its exit")
        if raised is None and returncode in (-stop_signal, 128 + stop_signal):  # 128+N: a shell died of it
            return Ending(exitcodes.REQUEUE, stop=True, program=DIED)
        if raised is None and killed and returncode == -signal.SIGKILL:
            return Ending(exitcodes.REQUEUE, stop=True, program=KILLED)
        if peer_gone:
            return Ending(exitcodes.REQUEUE, stop=True, program=PEER_GONE)
    if returncode == 0:
        return Ending(exitcodes.OK)
    if abort and trainer_ended is not None:
        return Ending(exitcodes.OK, note=f"the program's trainer ended by itself at step {trainer_ended}, then its "
                                         f"interpreter aborted in torch's teardown ({TEARDOWN_ABORT!r}): read as done")
    if abort:  # its code ended; torch 2.x's gloo threads met the interpreter's end (1 run in 5 of
        # a pytorch/examples script that calls destroy_process_group, measured): exit 0 if a peer's
        # program exited 0 by itself (rank 0 decides, rank/command.py), else a crash
        return unvouched_teardown() if alone else Ending(exitcodes.OK, teardown=True, note=(
            f"the program's code ended, then its interpreter aborted in torch's teardown "
            f"({TEARDOWN_ABORT!r}): read as exit 0 where a peer's program exited 0 by itself"))
    if returncode == requeue_exit and raised is None:
        return Ending(exitcodes.REQUEUE, stop=True, program=EXITED)
    if returncode < 0 and raised is None:
        return Ending(128 - returncode, crash={"error": f"the command {_how(returncode)}",
                                               "error_class": policy.INFRASTRUCTURE}, signum=-returncode)
    raised = raised or last_traceback(stderr_tail)
    if raised is None:
        return Ending(exitcodes.ERROR, crash={"error": f"command exited with status {returncode} "
                                                       "(no Python traceback on its stderr)",
                                              "error_class": policy.USER})
    at = f" at {raised.where}" if raised.where else ""
    if PORT_IN_USE.search(f"{raised.exception}: {raised.message}"):
        whose = ("which ddpjob chose: another program on the node holds it (retried on another port)"
                 if port_ours else "which you set: another program on the node holds it; set a free one")
        return Ending(exitcodes.ERROR, crash={
            "error": f"the command could not listen on MASTER_PORT {port}, {whose} ({raised.exception}{at})",
            "error_class": policy.INFRASTRUCTURE if port_ours else policy.USER, "exception": raised.exception})
    if peer_gone:
        return Ending(exitcodes.ERROR, crash={
            "error": f"a peer of the command's process group is gone: {raised.exception}: "
                     f"{clip(raised.message, 200)}{at}",
            "error_class": policy.INFRASTRUCTURE, "exception": raised.exception})
    return Ending(exitcodes.ERROR, crash={
        "error": f"your code raised {raised.exception}: {raised.message}{at} (the command "
                 f"{_how(returncode)})", "error_class": policy.USER, "exception": raised.exception,
        **({"where": raised.where} if raised.where else {})})


def unvouched_teardown() -> Ending:
    """Rank 0's reading where every rank's program aborted in torch's teardown (or the only one
    did) and none exited 0 by itself: nothing says the program finished, so a crash of the
    cluster's class (a restart in place from the program's own checkpoint), not COMPLETED."""
    return Ending(128 + signal.SIGABRT, signum=signal.SIGABRT, crash={
        "error": f"the command was killed by SIGABRT in torch's teardown ({TEARDOWN_ABORT!r}) on every rank, "
                 "and no rank's program exited 0 to say it had finished", "error_class": policy.INFRASTRUCTURE})


def _how(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"
