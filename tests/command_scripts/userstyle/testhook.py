"""Test hooks of the user-style scripts (never a timer): USERSTYLE_AT="RANK:EPOCH:ATTEMPT:HOW[,...]"
(RANK "*" = every rank, ATTEMPT "" = any; the attempt is torchrun's TORCHELASTIC_RESTART_COUNT, so
the script reads nothing of ddpjob's own) acts when epoch EPOCH has ended. HOW = "pause": prints
"paused at epoch N" and sleeps (a stop signal ends it: the script's own handler, or death by it);
"kill": SIGKILLs this process; "raise": a ValueError, the script's own bug; "abortatexit": the
interpreter's end aborts as torch's teardown now and then does (libstdc++'s line, then SIGABRT);
"exitatexit": the interpreter's end is skipped with status 0 (that torch's own abort cannot
come there: a test that needs this rank to exit 0 by itself gets it every time).
The script itself is unchanged by the hook: a hook that does not fire costs nothing."""

import atexit
import os
import signal
import sys
import time


def _teardown_abort() -> None:
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()


def _exit_0() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def at_epoch_end(epoch: int, rank: int) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for spec in os.environ.get("USERSTYLE_AT", "").split(","):
        who, when, which, how = (spec + ":::").split(":")[:4]
        if not how or who not in ("*", str(rank)) or which not in ("", attempt) or int(when) != epoch:
            continue
        if how == "pause":
            print(f"paused at epoch {epoch}", flush=True)
            for _ in range(2400):
                time.sleep(0.05)
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "raise":
            raise ValueError(f"a bug at epoch {epoch}")
        elif how == "abortatexit":
            atexit.register(_teardown_abort)
        elif how == "exitatexit":
            atexit.register(_exit_0)
        return
