"""A plain command as the entry ([train] command, docs/commands.md): each rank's `ddpjob run`
runs the user's program as one child process (no shell; no torch and no process group here: the
program forms its own at MASTER_ADDR:MASTER_PORT), with torchrun's variables.

runner._train hands over here. Rank 0 takes the run lock, checks the budgets and records the
start (as init() does for the API); the child runs, its output passed through and watched for a
hang; a stop signal reaches it as [train] command_signal, then SIGKILL after command_grace_s.
Its ending (ending(): pure) becomes this rank's exit: 0 done (COMPLETED), a stop for a requeue
(rank 0 decides through requeue.after_stop), a crash with this rank's crash record (the
traceback's exception and file:line named), or death by the same signal.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ddpjob import console, exitcodes, rundir, runlock
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.ledger import crashes, events, policy
from ddpjob.node import preemption
from ddpjob.node.cluster import ClusterEnv, command_environ, process_started
from ddpjob.rank import requeue

POLL_S = 0.1
TAIL_CHARS = 32768  # of the child's stderr, kept for its last traceback
FINAL_LINES = 200  # a traceback that begins within them is the program's last words
HEARTBEATS = "heartbeats"  # RUN_DIR/heartbeats/rank-N: the file a program touches each step

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


@dataclass(frozen=True)
class Ending:
    """How this rank ends after its program did: its exit status, whether it stopped for a requeue
    (rank 0 records the stop), the fields of its crash record (None: no crash), and the signal it
    dies by (the program's own death, passed on so that srun / the supervisor see it)."""

    code: int
    stop: bool = False
    crash: dict[str, Any] | None = None
    signum: int | None = None


def ending(returncode: int, *, requeue_exit: int, stopped: bool, stop_signal: int = signal.SIGTERM,
           killed: bool = False, hang_s: float | None = None, stderr_tail: str = "") -> Ending:
    """The program's exit status -> this rank's ending. 0: done. `requeue_exit`, or death by the
    stop signal once ddpjob sent it (`stopped`: a program that does not catch it dies of it) or by
    ddpjob's SIGKILL after the grace (`killed`; SLURM's own SIGKILL ending a step is no stop): a
    stop for a requeue. Its stderr ending with a Python traceback: a crash named after it (the
    user's, or infrastructure where it says a peer is gone). Killed by a signal: what the cluster
    broke (infrastructure). Another status: the user's. `hang_s`: ddpjob ended it as hung."""
    if hang_s is not None:
        return Ending(exitcodes.ERROR, crash={
            "error": f"the command stopped making progress: no output or heartbeat for {hang_s:.0f} s",
            "error_class": policy.INFRASTRUCTURE})
    if returncode == 0:
        return Ending(exitcodes.OK)
    # Its last words a traceback: it raised, whatever signal came while it was ending (srun ends
    # the step with SIGTERM once a peer died, and that peer's death is what made it raise)
    raised = last_traceback("\n".join(stderr_tail.splitlines()[-FINAL_LINES:]))
    if returncode == requeue_exit or (raised is None and ((stopped and returncode == -stop_signal)
                                                          or (killed and returncode == -signal.SIGKILL))):
        return Ending(exitcodes.REQUEUE, stop=True)
    if returncode < 0 and raised is None:
        return Ending(128 - returncode, crash={"error": f"the command {_how(returncode)}",
                                               "error_class": policy.INFRASTRUCTURE}, signum=-returncode)
    raised = raised or last_traceback(stderr_tail)
    if raised is None:
        return Ending(exitcodes.ERROR, crash={"error": f"command exited with status {returncode} "
                                                       "(no Python traceback on its stderr)",
                                              "error_class": policy.USER})
    at = f" at {raised.where}" if raised.where else ""
    if _PEER_GONE.search(f"{raised.exception}: {raised.message}"):
        return Ending(exitcodes.ERROR, crash={
            "error": f"a peer of the command's process group is gone: {raised.exception}: {raised.message[:200]}{at}",
            "error_class": policy.INFRASTRUCTURE, "exception": raised.exception})
    return Ending(exitcodes.ERROR, crash={
        "error": f"your code raised {raised.exception}: {raised.message}{at} (the command "
                 f"{_how(returncode)})", "error_class": policy.USER, "exception": raised.exception,
        **({"where": raised.where} if raised.where else {})})


def _how(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


@dataclass
class _Output:
    """The child's stdout and stderr passed through to this rank's, the time of the last byte,
    and stderr's tail."""

    last: float = field(default_factory=time.time)
    tail: str = ""
    threads: list[threading.Thread] = field(default_factory=list)

    def follow(self, src: IO[bytes], dst: IO[bytes], keep: bool) -> None:
        def pump() -> None:
            while chunk := os.read(src.fileno(), 65536):
                self.last = time.time()
                dst.write(chunk)
                dst.flush()
                if keep:
                    self.tail = (self.tail + chunk.decode("utf-8", "replace"))[-TAIL_CHARS:]
        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=5.0)  # a grandchild may hold the pipe open: do not wait for it


def _child_signals(cfg: JobConfig) -> None:
    """In the child before exec: the command's stop signal at its default action, SLURM's other
    stop signals ignored (SLURM signals every process of the step: they are ddpjob's to turn into
    the one the program expects). A program's own handler replaces either."""
    own = preemption.signal_number(cfg.train.command_signal)
    for name in (cfg.slurm.signal, "TERM"):
        if preemption.signal_number(name) != own:
            signal.signal(preemption.signal_number(name), signal.SIG_IGN)
    signal.signal(own, signal.SIG_DFL)


def _begin(cfg: JobConfig, env: ClusterEnv, run_dir: Path) -> tuple[int, runlock.RunLock | None]:
    """This attempt's number, and rank 0's hold on the run dir: the lock, the unseen ends and the
    budgets (requeue.check_start, as init() does; the start record follows: _Start). The other
    ranks read the number from the ledger (attempts.current: the attempt without an end yet, else
    the next)."""
    if not env.is_rank0:
        return requeue.attempt_of(env, events.read(run_dir)), None
    lock = runlock.RunLock.take(run_dir, f"{env.source} job {env.job_id or '-'} (rank 0, command)")
    restart, why = requeue.check_start(cfg, env, run_dir)
    if why:
        lock.release()
        raise DDPJobError(f"this is restart {restart} of run {run_dir.name}: {why}",
                          "raise the budget in [slurm], or find out why the job keeps stopping "
                          "(`ddpjob status RUN_DIR` lists every stop)")
    return restart, lock


@dataclass
class _Start:
    """Rank 0's start record of the attempt, written once the program logged its first step of
    this attempt (`resumed_step` = the step before it: where its own checkpoint took it), else
    when it ended (`resumed_step` = the newest step logged before). Its time is the first step
    line's own: the time from the launch to there is the ledger's start-up, and the polls that
    see the line come later (a fast program may have run every step and been signalled by then,
    which would leave its steps no productive time). The crash loop and the goodput ledger read it."""

    run_dir: Path
    env: ClusterEnv
    restart: int
    launched: float | None = field(default_factory=process_started)
    offset: int = 0  # of metrics.jsonl, read so far
    done: bool = False

    def first_step(self) -> tuple[int, float | None] | None:
        """(step, the line's time) of this attempt's first step line read since the last call."""
        path = self.run_dir / rundir.METRICS
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                text = f.read()
        except OSError:
            return None
        text = text[:text.rfind(b"\n") + 1]  # whole lines only: the program may be mid-write
        self.offset += len(text)
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if rec.get("restart") == self.restart and isinstance(step, int) and not isinstance(step, bool):
                t = rec.get("time")  # the program's own clock: a number, never ahead of now
                ok = isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                return step, min(float(t), time.time()) if ok else None
        return None

    def record(self, resumed: int | None, at: float | None = None) -> None:
        if self.done or not self.env.is_rank0:
            return
        self.done = True
        events.record(self.run_dir, "start", job_id=self.env.job_id, restart=self.restart, source=self.env.source,
                      world_size=self.env.world_size, host=self.env.hostname, launched_time=self.launched,
                      **({"resumed_step": resumed} if resumed else {}), **({"time": at} if at is not None else {}))

    def poll(self) -> None:
        if not self.done and self.env.is_rank0 and (first := self.first_step()) is not None:
            self.record(first[0] - 1, first[1])


def run(cfg: JobConfig, run_dir: Path, env: ClusterEnv) -> int:
    """Run the command on this rank to its end; this rank's exit status (or death by the
    signal that killed the program)."""
    t = cfg.train
    stop = preemption.StopFlag.install([cfg.slurm.signal, "TERM"])
    restart, lock = _begin(cfg, env, run_dir)
    begun = _Start(run_dir, env, restart)
    if env.is_rank0:
        begun.first_step()  # what earlier attempts logged is not this one's first step
    beat = run_dir / HEARTBEATS / f"rank-{env.rank}"
    beat.parent.mkdir(exist_ok=True)
    child_env = command_environ(env, {
        "DDPJOB_RUN_DIR": str(run_dir), "DDPJOB_ATTEMPT": str(restart),
        "DDPJOB_METRICS": str(run_dir / rundir.METRICS), "DDPJOB_HEARTBEAT": str(beat)})
    try:
        child = subprocess.Popen(list(t.command), env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=lambda: _child_signals(cfg))
    except OSError as exc:
        if lock is not None:
            lock.release()
        err = DDPJobError(f"train.command {t.command[0]!r} cannot be started on {env.hostname} ({exc.strerror}), "
                          "expected a program on the nodes' PATH or a path from the working directory "
                          f"{os.getcwd()}", "fix train.command (it runs without a shell)")
        # the user's setting: not retried (a rank crash record without a class reads as the cluster's)
        events.record(run_dir, "stop", reason="crash", rank=env.rank, host=env.hostname, job_id=env.job_id,
                      restart=restart, error=err.line(), error_class=policy.USER, exception=type(exc).__name__)
        raise err from None
    out = _Output()
    out.follow(child.stdout, sys.stdout.buffer, keep=False)  # type: ignore[arg-type]
    out.follow(child.stderr, sys.stderr.buffer, keep=True)  # type: ignore[arg-type]
    console.print0(f"ddpjob: attempt {restart}: running {' '.join(t.command)[:200]} (pid {child.pid})")
    sent: float | None = None  # when the stop signal went to the program
    hung: float | None = None
    killed = False  # ddpjob's SIGKILL after the grace
    while child.poll() is None:
        begun.poll()
        now = time.time()
        if stop.code != preemption.NONE and sent is None:
            sent = now
            child.send_signal(preemption.signal_number(t.command_signal))
        heard = max(out.last, beat.stat().st_mtime if beat.exists() else 0.0)
        if sent is None and hung is None and t.command_hang_s > 0 and now - heard > t.command_hang_s:
            hung = t.command_hang_s
            print(f"ddpjob: rank {env.rank}: no output or heartbeat for {hung:.0f} s: ending the command "
                  f"({signal.Signals(preemption.signal_number(t.command_signal)).name}, then SIGKILL after {t.command_grace_s:.0f} s)",
                  file=sys.stderr, flush=True)
            sent = now
            child.send_signal(preemption.signal_number(t.command_signal))
        if sent is not None and now - sent > t.command_grace_s and not killed:
            killed = True
            child.kill()
        time.sleep(POLL_S)
    out.join()
    begun.poll()
    begun.record(crashes.command_saved(run_dir))
    end = ending(child.returncode, requeue_exit=t.command_requeue_exit, stopped=stop.code != preemption.NONE,
                 stop_signal=preemption.signal_number(t.command_signal), killed=killed and hung is None,
                 hang_s=hung, stderr_tail=out.tail)
    return _finish(cfg, env, run_dir, restart, end, stop, lock)


def _finish(cfg: JobConfig, env: ClusterEnv, run_dir: Path, restart: int, end: Ending, stop: Any,
            lock: runlock.RunLock | None) -> int:
    """Record the ending (rank 0: the run's completion or the stop's decision; any rank: its
    crash) and leave as it says."""
    step = crashes.command_saved(run_dir)
    if end.stop and stop.code == preemption.PREEMPTED:
        peer = crashes.peer_crash(events.read(run_dir), env.job_id, restart, env.rank)
        if peer is not None:
            # srun's SIGTERM ending the step after a peer crashed, not a preemption: no stop and no
            # decision here, the batch shell decides the peer's crash (its verdict, a restart in
            # place). The program died of it or exited on it: this rank dies of it too, as it would
            # without the program. A script without a SIGTERM handler (nanoGPT's) is the common case.
            print(f"ddpjob: rank {env.rank} on {env.hostname}: the step ended after rank {peer.get('rank')}'s "
                  "crash (srun's SIGTERM): no stop recorded, the crash is decided", file=sys.stderr, flush=True)
            end = Ending(128 + signal.SIGTERM, signum=signal.SIGTERM)
    if end.crash is not None:
        events.record(run_dir, "stop", reason="crash", rank=env.rank, host=env.hostname, job_id=env.job_id,
                      restart=restart, step=step, **end.crash)
        print(f"ddpjob: rank {env.rank} on {env.hostname}: {end.crash['error']}", file=sys.stderr, flush=True)
    elif env.is_rank0 and end.code == exitcodes.OK:
        rundir.mark_completed(run_dir, step=step)
        console.print0(f"ddpjob: the command finished (exit 0): {run_dir} is COMPLETED")
    elif env.is_rank0 and end.stop:
        code = stop.code if stop.code != preemption.NONE else preemption.REQUEUE
        requeue.after_stop(cfg, env, run_dir, code, step, restart=restart, signal_time=stop.time)
    if lock is not None:
        lock.release()
    # only now: `scontrol requeue` of this job signals its step, this process too, while it records
    stop.uninstall()
    if end.signum is not None:
        if end.signum != signal.SIGKILL:
            signal.signal(end.signum, signal.SIG_DFL)
        os.kill(os.getpid(), end.signum)  # dies here where the default action is to end
    return end.code
