"""The local backend's supervisor: `python -m ddpjob.launch.local RUN_DIR [RUN_DIR ...]`.

Started detached by `ddpjob submit --backend local`; plays SLURM's part on one machine. It starts
nodes x tasks_per_node rank processes (`ddpjob run RUN_DIR`) with the torchrun variables, forwards
SIGUSR2 (preemption: ranks checkpoint, exit 3, get restarted) and SIGTERM/SIGINT (cancel: ranks
checkpoint and stop for good), kills the rest when one rank fails (like srun --kill-on-bad-exit),
and keeps its state in RUN_DIR/local.json for `status`/`logs`/`cancel`. Several run dirs (a sweep)
run one after another.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob import exitcodes, fileio, jobfile, rundir, runlock
from ddpjob.launch import slurmopts
from ddpjob.ledger import attempts, budget, crashes, events, policy, recovery
from ddpjob.node import preemption, warm
from ddpjob.store import memsnap

LOCAL = "local.json"
POLL_S = 0.1
CANCEL_GRACE_S = 60.0  # after a cancel, ranks may checkpoint this long before SIGKILL


def rank_command(run_dir: Path, warm_name: str | None = None) -> list[str]:
    """A rank's command: `ddpjob run RUN_DIR`, as a client of the run's warm-start server if
    it has one (node/warm.py: the rank is forked from a process that imported torch once)."""
    client = ["-m", warm.__name__, "run", "--name", warm_name] if warm_name else []
    return [sys.executable, "-u", *client, "-m", "ddpjob", "run", str(run_dir)]


def free_port() -> int:
    """A port the kernel just handed out, chosen again at every (re)start: a previous
    incarnation's port may still be in TIME_WAIT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(base: dict[str, str], rank: int, nodes: int, tasks_per_node: int, port: int,
             job_id: str, restart: int) -> dict[str, str]:
    """What torchrun would set, plus ddpjob's job id and restart count (docs/design.md)."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank % tasks_per_node),
        "WORLD_SIZE": str(nodes * tasks_per_node), "LOCAL_WORLD_SIZE": str(tasks_per_node),
        "GROUP_RANK": str(rank // tasks_per_node), "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "DDPJOB_JOB_ID": job_id, "DDPJOB_RESTART_COUNT": str(restart),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    return env


def log(message: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] supervisor: {message}", flush=True)


class Supervisor:
    """Runs one run dir to its end (COMPLETED / FAILED / CANCELLED), restarting on exit 3."""

    def __init__(self, run_dir: Path, job_id: str, command: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.job_id = job_id
        self.cfg = jobfile.read_run_config(run_dir)
        rundir.private_umask(self.cfg.slurm.share_group)  # the rank logs it opens; the ranks inherit it
        # the run's warm-start server (started with the first ranks), unless a command is given
        # by SLURM's rule (slurmopts.warm_start), all of the run's ranks being on this host
        self.warm_name = job_id if command is None and slurmopts.warm_start(
            self.cfg, ranks_per_host=self.cfg.slurm.world_size) else None
        self.warm: subprocess.Popen[bytes] | None = None
        self.command = command or rank_command(run_dir, self.warm_name)
        # ddpjob's own ranks take the stop signals that came while they started once their
        # handlers are in (preemption.block_stop_signals); another rank command (the tests')
        # gets them as they come
        self.hold_signals = command is None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.restarts = 0  # how many times the ranks were started again (local.json)
        self.attempt = 0  # the attempt that runs now: its number in the run's ledger (ledger/attempts.py)
        self.cancelled = False
        self.history: list[dict[str, Any]] = []
        self.pending: list[int] = []  # signals received, not yet forwarded
        self.lock: runlock.RunLock | None = None  # held from before the first write to the end
        self.first_bad: tuple[int, int] | None = None  # (rank, returncode) that failed first
        self.gave_up: str | None = None  # why a crash was not retried, where it is not the budget

    def write(self, state: str, **extra: Any) -> None:
        fileio.write_json_atomic(self.run_dir / LOCAL, {
            "pid": os.getpid(), "job_id": self.job_id, "state": state, "restarts": self.restarts,
            "world_size": self.cfg.slurm.world_size, "rank_pids": [p.pid for p in self.procs],
            "history": self.history, "updated_at": time.time(), **extra})

    def signal_ranks(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def kill_ranks(self) -> None:
        """SIGKILL to each rank's process group (its own children included)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def on_signal(self, signum: int) -> None:
        """The handler only records (printing inside a handler can hit a reentrant write);
        the wait loop forwards, once every rank of this start exists."""
        if signum != signal.SIGUSR2:
            self.cancelled = True  # TERM/INT: like scancel, the job ends after the ranks stop
        self.pending.append(signum)

    def forward_pending(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            name = signal.Signals(signum).name
            log(f"got {name}, forwarding it to {sum(p.poll() is None for p in self.procs)} rank(s)")
            events.record(self.run_dir, "signal", signal=name, source="local-supervisor",
                          job_id=self.job_id, restart=self.attempt)
            self.signal_ranks(signum)

    def code_env(self, env: dict[str, str]) -> dict[str, str]:
        """The ranks' (and their warm server's) view of the code: the copy frozen at submission
        first (launch/freeze.py), and `python -m` must not put the (live) working dir first."""
        frozen = str((self.run_dir / "code" / "python").resolve())
        env["PYTHONPATH"] = os.pathsep.join(x for x in (frozen, env.get("PYTHONPATH")) if x)
        env["PYTHONSAFEPATH"] = "1"
        return env

    def start_warm(self, logs: Path) -> None:
        """The run's warm-start server, once: it ends with the run (stop_warm) or, should this
        supervisor be killed, once it sees its parent gone and its last rank has ended."""
        if self.warm_name is None or (self.warm is not None and self.warm.poll() is None):
            return
        env = self.code_env({**os.environ, "OMP_NUM_THREADS": "1"})
        with open(logs / "warm-local.log", "ab") as out:
            self.warm = subprocess.Popen([sys.executable, "-u", "-m", warm.__name__, "serve", "--name",
                                          self.warm_name, "--parent", str(os.getpid())], env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop_warm(self) -> None:
        if self.warm is not None and self.warm.poll() is None:
            self.warm.terminate()  # it ends once no rank is left (every one has, here)
            try:
                self.warm.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.warm.kill()
                self.warm.wait()

    def start(self) -> None:
        s = self.cfg.slurm
        port = free_port()
        logs = self.run_dir / rundir.LOGS
        logs.mkdir(parents=True, exist_ok=True)
        self.start_warm(logs)
        self.procs = []
        # this attempt's number, taken before its ranks exist: they record under it (ledger/attempts.py)
        self.attempt = attempts.next_number(events.read(self.run_dir))
        for rank in range(s.world_size):
            env = self.code_env(rank_env(dict(os.environ), rank, s.nodes, s.tasks_per_node, port, self.job_id,
                                         self.attempt))
            if self.warm_name is not None:
                env[warm.ENV] = "1"  # the server was started: wait for it to listen, as on SLURM
            fds: tuple[int, ...] = ()
            if self.lock is not None and self.lock.fd is not None:  # rank 0 trains under our lock
                env.update(self.lock.inherit_env())
                fds = (self.lock.fd,)
            with open(logs / f"rank-{rank}.log", "ab") as out:
                # Own session per rank: a kill reaches the rank's children, and a Ctrl-C in the
                # submitting terminal never reaches the ranks behind the supervisor's back.
                self.procs.append(subprocess.Popen(self.command, env=env, stdout=out, pass_fds=fds,
                                                   stderr=subprocess.STDOUT, start_new_session=True,
                                                   preexec_fn=preemption.block_stop_signals
                                                   if self.hold_signals else None))
        log(f"started {s.world_size} rank(s) (attempt {self.attempt}, restart {self.restarts}, MASTER_PORT "
            f"{port}): " + ", ".join(str(p.pid) for p in self.procs))
        events.record(self.run_dir, "local_start", source="local-supervisor", job_id=self.job_id,
                      restart=self.attempt, world_size=s.world_size, master_port=port)
        self.write("RUNNING")

    def wait_ranks(self) -> list[int]:
        """Wait for every rank. One bad exit (not 0, not 3) gets the others SIGKILLed at once, like
        srun --kill-on-bad-exit: they would only hang in their next collective, and a failed
        run must not write a checkpoint. After a cancel, ranks get CANCEL_GRACE_S to save."""
        killed = False
        cancel_deadline: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]  # every one, each time (no any() short-cut)
            if None not in codes:
                break
            self.forward_pending()
            bad = [r for r, c in enumerate(codes) if c not in (None, 0, exitcodes.REQUEUE)]
            if bad and not killed:
                self.first_bad = (bad[0], int(codes[bad[0]] or 0))  # the crash's culprit
                log(f"rank {bad[0]} exited with {codes[bad[0]]}: killing the other ranks")
                self.kill_ranks()
                killed = True
            if self.cancelled and cancel_deadline is None:
                cancel_deadline = time.monotonic() + CANCEL_GRACE_S
            if cancel_deadline is not None and time.monotonic() > cancel_deadline and not killed:
                log(f"ranks still running {CANCEL_GRACE_S:.0f}s after the cancel: SIGKILL")
                self.kill_ranks()
                killed = True
            time.sleep(POLL_S)
        self.pending.clear()  # like SLURM: a signal to ranks that are gone is lost
        return [int(p.returncode) for p in self.procs]

    def run(self) -> str:
        """Start, wait, and carry out the policy's verdict (ledger/policy.py) on every end that is
        not the run's: a collective exit 3, a crash. Returns the final state."""
        while True:
            self.start()
            codes = self.wait_ranks()
            self.history.append({"restart": self.attempt, "exit_codes": codes, "time": time.time()})
            log(f"ranks exited with {codes}")
            if all(c == 0 for c in codes):
                state, reason = "COMPLETED", "all ranks exited 0"
            elif self.cancelled:
                state, reason = "CANCELLED", "cancelled by a signal"
            # a stop: every rank stopped for a requeue, or had ended with 0 before the stop came (a
            # [train] command's rank whose program was done; rank 0 decided the stop all the same)
            elif stopped(codes):
                verdict = self.after_stop()
                if verdict.action != policy.END:
                    self.restarts += 1
                    log(f"all ranks stopped for a requeue: {verdict.line}")
                    self.write("REQUEUED")
                    continue
                # the run ends as asked (`ddpjob stop`: STOPPED) or where it would go on (FAILED)
                state, reason = (("STOPPED", verdict.line) if verdict.asked
                                 else ("FAILED", f"stopped for a requeue, but {verdict.line}"))
            elif self.retry_crash(codes):
                continue
            else:
                state, reason = "FAILED", self.gave_up or f"exit codes {codes}"
            self.stop_warm()
            memsnap.remove_job(self.run_dir, self.job_id, memsnap.base_of(self.cfg))  # the ranks' in-memory snapshots
            events.record(self.run_dir, "local_end", source="local-supervisor", job_id=self.job_id,
                          restart=self.attempt, state=state, reason=reason)
            # The run dir is free before local.json says the job ended: a `ddpjob resume` that reads
            # the end must not find the lock still held (it would refuse the run as in use)
            if self.lock is not None:
                self.lock.release()
            self.write(state, reason=reason, exit_codes=codes)
            log(f"{state}: {reason}")
            return state


    def after_stop(self) -> policy.Verdict:
        """Every rank stopped with a checkpoint (exit 3): rank 0's decision, to carry out
        (rank/requeue.after_stop decided it as on SLURM: why they stopped, the requeues this
        submission spent; requeued_by the supervisor). Where rank 0 recorded no verdict (it died
        after the stop), the policy's is decided and recorded here, for a time limit (SIGUSR2)
        or the reason rank 0 recorded."""
        evs = events.read(self.run_dir)
        mine = [e for e in evs if events.is_decision(e) and events.of_attempt(e, self.job_id, self.attempt)]
        if mine and mine[-1].get("action"):
            d = mine[-1]
            return policy.Verdict(str(d["action"]), str(d.get("note") or ""), asked=bool(d.get("asked")))
        reason = str(mine[-1].get("reason")) if mine else "time_limit"
        verdict = recovery.decide_stop(self.cfg, self.run_dir, evs, self.job_id, reason).verdict
        events.decision(self.run_dir, reason, job_id=self.job_id, restart=self.attempt, source="local-supervisor",
                        **recovery.carried_here(verdict, budget.SUPERVISOR))
        return verdict

    def retry_crash(self, codes: list[int]) -> bool:
        """A rank failed (raised, was killed): the policy's verdict (ledger/policy.py), recorded
        here (no rank lived to) and carried out: the ranks run again from the newest snapshot or
        checkpoint, as the sbatch script does inside its allocation, or the run ends."""
        evs = events.read(self.run_dir)
        rank, code = self.first_bad or next(
            ((r, c) for r, c in enumerate(codes) if c not in (0, exitcodes.REQUEUE)), (0, max(codes)))
        culprit = crashes.from_returncode(rank, socket.gethostname(), code)
        saved = memsnap.retry_point(self.cfg, self.run_dir, self.job_id)
        crash, _ = recovery.settle(
            self.cfg, self.run_dir, evs, self.job_id, self.attempt, culprit,
            lambda c: {"status": max(codes), "source": "local-supervisor",
                       **recovery.carried_here(c.verdict, budget.SUPERVISOR, f"rank exit codes {codes}")},
            log, here=True, saved=saved)
        self.first_bad, self.gave_up = None, crash.verdict.line
        if crash.retry:
            self.restarts += 1
            self.write("RESTARTING")
        return crash.retry


def stopped(codes: Sequence[int]) -> bool:
    """The ranks' exit codes are a stop for a requeue: some exited 3, the rest 3 or 0."""
    return exitcodes.REQUEUE in codes and all(c in (0, exitcodes.REQUEUE) for c in codes)


def supervise(run_dirs: Sequence[Path], command: list[str] | None = None) -> int:
    """Each run dir in turn (a sweep's points run one after another); 0 iff all completed.

    SIGTERM (`ddpjob cancel`) cancels the point that runs, like scancel of one array task;
    SIGINT cancels it and every point not started yet. A point whose local.json a cancel
    marked CANCELLED before it started is skipped."""
    base_id = f"local-{os.getpid()}"
    sups = [Supervisor(d, base_id if len(run_dirs) == 1 else f"{base_id}_{i}",
                       command and [*command, str(d)]) for i, d in enumerate(run_dirs)]
    current: list[Supervisor] = []
    stop_all = [False]

    def handler(signum: int, _frame: Any) -> None:
        if current:
            current[0].on_signal(signum)
        if signum == signal.SIGINT:
            stop_all[0] = True

    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    # Every run dir is ours before anything is written to one: a second supervisor started on a
    # busy run dir (the login side's check raced, or was skipped) leaves no trace in it.
    try:
        for s in sups:
            s.lock = runlock.RunLock.take(s.run_dir, f"local supervisor of job {s.job_id}")
    except runlock.Busy as exc:
        log(exc.line())
        return 1
    for s in sups:
        s.write("PENDING")
    ok = True
    for s in sups:
        marked = (fileio.read_json(s.run_dir / LOCAL, {}) or {}).get("state") == "CANCELLED"
        if stop_all[0] or marked:
            s.write("CANCELLED", reason="cancelled before it started")
            ok = False
            continue
        current[:] = [s]
        ok = s.run() == "COMPLETED" and ok
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpjob.launch.local", description=__doc__)
    p.add_argument("run_dirs", nargs="+", type=Path)
    # Internal (tests): run this instead of `ddpjob run`; the run dir is appended.
    p.add_argument("--rank-command", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    command = shlex.split(args.rank_command) if args.rank_command else None
    return supervise([d.resolve() for d in args.run_dirs], command)


if __name__ == "__main__":
    raise SystemExit(main())
