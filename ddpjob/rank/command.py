"""A plain command as the entry ([train] command, docs/commands.md): each rank's `ddpjob run`
runs the user's program as one child process (no shell; no torch and no process group here: the
program forms its own at MASTER_ADDR:MASTER_PORT) with what torchrun would give it and nothing of
ddpjob's internals: the user's environment, umask and Python path (commandenv.py), torchrun's
variables, the working directory [train] command_cwd.

runner._train hands over here. Rank 0 takes the run lock, checks the budgets and records the
start (as init() does for the API); the child runs, its output passed through whole lines at a
time and watched for a hang; a stop signal reaches it as [train] command_signal, then SIGKILL
after command_grace_s. Its ending (command_end.ending: pure) becomes this rank's exit and its
`rank_end` record: 0 done, a stop for a requeue (rank 0 decides through requeue.after_stop), a
crash with this rank's crash record, or death by the same signal. The run is COMPLETED only when
every rank's program exited 0 with no stop pending: rank 0 waits for the others' ends first.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from ddpjob import commandpaths, console, exitcodes, fileio, rundir, runlock
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.ledger import crashes, events, metricslines, policy
from ddpjob.node import preemption
from ddpjob.node.cluster import ClusterEnv, process_started
from ddpjob.rank import commandenv, requeue, startcheck
from ddpjob.ledger.programend import PEER_GONE, stop_said
from ddpjob.rank.command_end import Ending, ending, unvouched_teardown

POLL_S = 0.1
TAIL_CHARS = 32768  # of the child's stderr, kept for its last traceback
HEARTBEATS = "heartbeats"  # RUN_DIR/heartbeats/rank-N: the file a program touches each step
PARTIAL_MAX = 65536  # bytes of a line without its end held back before they are written anyway


@dataclass
class _Output:
    """The child's stdout and stderr passed through to this rank's, whole lines at a time (in the
    rank's log both streams land in one file: chunks written as they come cut each other's lines,
    "Steps: 256/...dataloader.py:759: UserWarning"); a progress bar's carriage return ends a line
    too. Also the time of the last byte, stderr's tail and stdout's last line (the progress
    evidence of a program that logs no steps: ledger/progress.py)."""

    last: float = field(default_factory=time.time)
    tail: str = ""
    last_line: str = ""
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, src: IO[bytes], dst: IO[bytes], keep: bool) -> None:
        def write(data: bytes) -> None:
            with self.lock:  # one line at a time across both streams
                dst.write(data)
                dst.flush()

        def pump() -> None:
            held = b""
            while chunk := os.read(src.fileno(), 65536):
                self.last = time.time()
                if keep:
                    self.tail = (self.tail + chunk.decode("utf-8", "replace"))[-TAIL_CHARS:]
                held += chunk
                end = max(held.rfind(b"\n"), held.rfind(b"\r"))
                if end >= 0 or len(held) > PARTIAL_MAX:
                    whole, held = (held[:end + 1], held[end + 1:]) if end >= 0 else (held, b"")
                    write(whole)
                    if not keep:
                        self._note(whole)
            if held:  # its last words without a line end: ended here, so the other stream's lines stay whole
                write(held + b"\n")
                if not keep:
                    self._note(held)
        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _note(self, data: bytes) -> None:
        lines = [x.strip() for x in data.decode("utf-8", "replace").replace("\r", "\n").split("\n")]
        lines = [x for x in lines if x]
        if lines:
            self.last_line = lines[-1][:200]

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=5.0)  # a grandchild may hold the pipe open: do not wait for it


def _begin(cfg: JobConfig, env: ClusterEnv, run_dir: Path) -> tuple[int, runlock.RunLock | None]:
    """This attempt's number, and rank 0's hold on the run dir: the lock, the unseen ends and the
    budgets (startcheck.check_start, as init() does; the start record follows: _Start). The other
    ranks read the number from the ledger (attempts.current: the attempt without an end yet, else
    the next)."""
    if not env.is_rank0:
        return _peer_attempt(env, run_dir), None
    lock = runlock.RunLock.take(run_dir, f"{env.source} job {env.job_id or '-'} (rank 0, command)")
    restart, why = startcheck.check_start(cfg, env, run_dir)
    if why:
        lock.release()
        raise DDPJobError(f"this is restart {restart} of run {run_dir.name}: {why}",
                          "raise the budget in [slurm], or find out why the job keeps stopping "
                          "(`ddpjob status RUN_DIR` lists every stop)")
    return restart, lock


# A rank other than 0 waits at most this long for rank 0's word on an attempt left open by an
# earlier start (its records older than this rank's own start, by more than the clocks' slack)
PEER_WAIT_S, CLOCK_SLACK_S = 120.0, 10.0


def _peer_attempt(env: ClusterEnv, run_dir: Path) -> int:
    """A rank other than 0: the attempt rank 0 takes. The ledger's open attempt of the job is
    it, unless that attempt's launch (or start) is older than this rank's own start: then an
    earlier start of the job ended unseen (SIGKILL after GraceTime) and rank 0, under the run
    lock, is about to record its end and take the next number (startcheck.check_start). Read too
    early, the ranks ran under two numbers and rank 0 waited forever for the others' ends."""
    began = process_started() or time.time()
    deadline = time.time() + PEER_WAIT_S
    while True:
        evs = events.read(run_dir)
        n = startcheck.attempt_of(env, evs)
        firsts = [float(e.get("time") or 0) for e in evs
                  if e.get("event") in ("launch", "start") and events.of_attempt(e, env.job_id, n)]
        if not firsts or max(firsts) >= began - CLOCK_SLACK_S or time.time() > deadline:
            return n
        time.sleep(POLL_S * 2)


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


def run(cfg: JobConfig, run_dir: Path, env: ClusterEnv, stop: preemption.StopFlag | None = None) -> int:
    """Run the command on this rank to its end; this rank's exit status (or death by the
    signal that killed the program). `stop`: the flag-only handlers runner installed as it
    started (a stop that came during start-up is in it), else installed here."""
    t = cfg.train
    stop = stop or preemption.StopFlag.install([cfg.slurm.signal, "TERM"])
    restart, lock = _begin(cfg, env, run_dir)
    begun = _Start(run_dir, env, restart)
    if env.is_rank0:
        begun.first_step()  # what earlier attempts logged is not this one's first step
    beat = run_dir / HEARTBEATS / f"rank-{env.rank}"
    beat.parent.mkdir(exist_ok=True)
    metrics = run_dir / rundir.METRICS
    for own in (beat, metrics):  # ddpjob's files, private whatever umask the program has
        os.close(os.open(own, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    argv = commandpaths.argv(cfg, run_dir, restart)
    cwd = commandpaths.workdir(cfg, run_dir, restart)
    child_env = commandenv.environ(cfg, env, run_dir, restart, {
        "DDPJOB_METRICS": str(metrics), "DDPJOB_HEARTBEAT": str(beat)})
    try:
        child = subprocess.Popen(argv, cwd=cwd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=commandenv.child_setup(cfg, env))
    except OSError as exc:
        if lock is not None:
            lock.release()
        what = (f"train.command_cwd {str(cwd)!r} is not a directory on {env.hostname}"
                if not cwd.is_dir() else f"train.command {argv[0]!r} cannot be started on {env.hostname} "
                f"({exc.strerror}), expected a program on the nodes' PATH or a path from the working directory {cwd}")
        err = DDPJobError(what, "fix train.command / train.command_cwd (the command runs without a shell)")
        # the user's setting: not retried (a rank crash record without a class reads as the cluster's)
        events.rank_crash(run_dir, rank=env.rank, host=env.hostname, job_id=env.job_id, restart=restart,
                          error=err.line(), error_class=policy.USER, exception=type(exc).__name__)
        raise err from None
    launched = time.time()
    if env.is_rank0:  # the job is on record now (`ddpjob status`, `stop`), whether it ever logs a step or not
        events.record(run_dir, "launch", job_id=env.job_id, restart=restart, world_size=env.world_size,
                      host=env.hostname, source=env.source)
    out = _Output()
    out.follow(child.stdout, sys.stdout.buffer, keep=False)  # type: ignore[arg-type]
    out.follow(child.stderr, sys.stderr.buffer, keep=True)  # type: ignore[arg-type]
    console.print0(f"ddpjob: attempt {restart}: running {' '.join(argv)[:200]} in {cwd} (pid {child.pid})")
    sent: float | None = None  # when the stop signal went to the program
    hung: float | None = None
    killed = False  # ddpjob's SIGKILL after the grace
    signum = preemption.signal_number(t.command_signal)
    while child.poll() is None:
        begun.poll()
        now = time.time()
        if stop.code != preemption.NONE and sent is None:
            sent = now
            child.send_signal(signum)
        heard = max(out.last, beat.stat().st_mtime if beat.exists() else 0.0)
        if sent is None and hung is None and t.command_hang_s > 0 and now - heard > t.command_hang_s:
            hung = t.command_hang_s
            print(f"ddpjob: rank {env.rank}: no output or heartbeat for {hung:.0f} s: ending the command "
                  f"({signal.Signals(signum).name}, then SIGKILL after {t.command_grace_s:.0f} s)",
                  file=sys.stderr, flush=True)
            sent = now
            child.send_signal(signum)
        if sent is not None and now - sent > t.command_grace_s and not killed:
            killed = True
            child.kill()
        time.sleep(POLL_S)
    out.join()
    begun.poll()
    # A program that logs no steps: all ddpjob knows is that it ran from its launch, which the
    # ledger books as training, not start-up (a program that logs steps and ended before its
    # first line of this attempt spent the attempt starting)
    saved = crashes.command_saved(run_dir)
    begun.record(saved, launched if saved is None else None)
    end = ending(child.returncode, requeue_exit=t.command_requeue_exit, stopped=stop.code != preemption.NONE,
                 stop_signal=signum, killed=killed and hung is None, hang_s=hung, stderr_tail=out.tail,
                 trainer_ended=metricslines.trainer_ended(fileio.read_jsonl(metrics)[-50:], restart),
                 alone=env.world_size == 1,
                 port=env.master_port, port_ours=env.port_derived)
    if end.note:
        print(f"ddpjob: rank {env.rank} on {env.hostname}: {end.note}", file=sys.stderr, flush=True)
    return _finish(cfg, env, run_dir, restart, end, stop, lock, out.last_line)


def _rank_ends(run_dir: Path, env: ClusterEnv, restart: int) -> dict[Any, dict[str, Any]]:
    """The `rank_end` records of this attempt so far, by rank."""
    return {e.get("rank"): e for e in events.read(run_dir)
            if e.get("event") == "rank_end" and events.of_attempt(e, env.job_id, restart)}


def _others_ended(run_dir: Path, env: ClusterEnv, restart: int, stop: preemption.StopFlag,
                  grace_s: float) -> list[dict[str, Any]] | None:
    """Rank 0, its own program done: every rank's `rank_end` of this attempt, waited for (a peer
    may still be saving, or crash yet: its crash wins over rank 0's exit 0). None: a stop came
    and a rank had not ended within the grace after it (its `ddpjob run` died without a word:
    srun or the supervisor ends the step and the batch shell decides what they saw)."""
    deadline: float | None = None
    while True:
        ends = _rank_ends(run_dir, env, restart)
        if len(ends) >= env.world_size:
            return list(ends.values())
        if stop.code != preemption.NONE and deadline is None:
            deadline = time.time() + grace_s
        if deadline is not None and time.time() > deadline:
            return None
        time.sleep(POLL_S * 2)


# How long rank 0 waits for a peer's word on what its program did: that program has ended
# already (rank 0's saw it leave), so its rank_end comes within moments, and the stop's
# decision must not wait long for a peer's wrapper that died without one
PEER_WORDS_S = 5.0


def _program_of_the_stop(run_dir: Path, env: ClusterEnv, restart: int, stop: preemption.StopFlag,
                         wait_s: float) -> str:
    """What the program did about the stop, where rank 0's own program only saw a peer leave (it
    waited in a collective while a peer died of the signal first): the first rank's end that says
    more (it exited by itself, died of the signal, was killed), waited for at most `wait_s`."""
    ends = _others_ended(run_dir, env, restart, stop, wait_s) or list(_rank_ends(run_dir, env, restart).values())
    told = sorted((e for e in ends if e.get("program") not in (None, PEER_GONE)), key=lambda e: int(e.get("rank", 0)))
    return str(told[0]["program"]) if told else PEER_GONE


def _finish(cfg: JobConfig, env: ClusterEnv, run_dir: Path, restart: int, end: Ending,
            stop: preemption.StopFlag, lock: runlock.RunLock | None, last_line: str) -> int:
    """Record the ending (every rank: its rank_end; rank 0: the run's completion or the stop's
    decision; any rank: its crash) and leave as it says."""
    step, lost = crashes.command_point(run_dir)
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

    def crashed(crash: dict[str, Any]) -> None:
        # the step it crashed after, as far as its lines tell (the verdict's "at step N"), not the
        # save it resumes from: the decision carries that
        reached = step + lost if step is not None and lost is not None else step
        events.rank_crash(run_dir, rank=env.rank, host=env.hostname, job_id=env.job_id, restart=restart,
                          step=reached, last_output=last_line, **crash)
        print(f"ddpjob: rank {env.rank} on {env.hostname}: {crash['error']}", file=sys.stderr, flush=True)

    if end.crash is not None:
        crashed(end.crash)
    events.record(run_dir, "rank_end", rank=env.rank, host=env.hostname, job_id=env.job_id, restart=restart,
                  status=end.code, stop=end.stop, **({"program": end.program} if end.program else {}),
                  **({"teardown": True} if end.teardown else {}))
    complete = env.is_rank0 and end.code == exitcodes.OK
    if complete and env.world_size > 1:
        ends = _others_ended(run_dir, env, restart, stop, cfg.train.command_grace_s)
        if ends is None:
            print(f"ddpjob: rank 0: a stop came and rank(s) had not ended {cfg.train.command_grace_s:.0f} s "
                  "later: not COMPLETED; the step's end is decided from what srun or the supervisor saw",
                  file=sys.stderr, flush=True)
            end, complete = Ending(128 + signal.SIGTERM, signum=signal.SIGTERM), False
        elif failed := sorted(str(e.get("rank")) for e in ends if e.get("status") != exitcodes.OK and not e.get("stop")):
            # one rank's crash wins over rank 0's exit 0, and over srun's SIGTERM that followed it
            # (--kill-on-bad-exit): no stop here, the crash is decided (the batch shell, the supervisor)
            console.print0(f"ddpjob: rank 0's program exited 0, rank(s) {', '.join(failed)} did not: the run is not COMPLETED")
            complete = False
            if stop.code == preemption.PREEMPTED:
                end = Ending(128 + signal.SIGTERM, signum=signal.SIGTERM)
        elif stop.code != preemption.NONE or any(e.get("stop") for e in ends):
            program = next((str(e["program"]) for e in ends if e.get("program")), None)
            end, complete = Ending(exitcodes.REQUEUE, stop=True, program=program), False
        elif all(e.get("teardown") for e in ends):
            end, complete = unvouched_teardown(), False
            if end.crash is not None:
                crashed(end.crash)
    elif complete and stop.code != preemption.NONE:
        end, complete = Ending(exitcodes.REQUEUE, stop=True, program=end.program), False
    if complete:
        rundir.mark_completed(run_dir, step=step)
        events.decision(run_dir, "finished", job_id=env.job_id, restart=restart, step=step)
        console.print0(f"ddpjob: every rank's program exited 0: {run_dir} is COMPLETED")
    elif env.is_rank0 and end.stop:
        if end.program == PEER_GONE and env.world_size > 1:
            wait_s = min(cfg.train.command_grace_s, PEER_WORDS_S)
            end = replace(end, program=_program_of_the_stop(run_dir, env, restart, stop, wait_s))
        if end.program:
            console.print0(f"ddpjob: {stop_said(end.program, signal.Signals(preemption.signal_number(cfg.train.command_signal)).name, cfg.train.command_grace_s)}")
        # the job's warning signal first (time limit, `ddpjob stop`), then SIGTERM: srun ending the
        # step once a peer's program had left with its stop status (--kill-on-bad-exit), no scancel
        code = (stop.first if stop.first == preemption.REQUEUE else stop.code) if stop.code != preemption.NONE \
            else preemption.REQUEUE
        requeue.after_stop(cfg, env, run_dir, code, step, restart=restart, signal_time=stop.time,
                           program=end.program, steps_lost=lost)
    if lock is not None:
        lock.release()
    # only now: `scontrol requeue` of this job signals its step, this process too, while it records
    stop.uninstall()
    if end.signum is not None:
        if end.signum != signal.SIGKILL:
            signal.signal(end.signum, signal.SIG_DFL)
        os.kill(os.getpid(), end.signum)  # dies here where the default action is to end
    return end.code
