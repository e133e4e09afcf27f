"""Warm starts: one process per node keeps torch imported and forks each rank's process from it,
so a restart inside the allocation skips the interpreter's and torch's start-up (P12 measured
7.3 s of a 8.2 s recovery there: `import torch`, then torch importing dynamo at the first
`Optimizer()`).

    python -u -m ddpjob.node.warm serve                      # one per node: a background srun step
    python -u -m ddpjob.node.warm run [-u] -m MODULE ARGS...  # each rank, as srun's task
    ... serve --name NAME --parent PID / run --name NAME ...  # the local backend: one per run

The local backend's supervisor (launch/local.py) plays SLURM's part: it starts one server per run
(named after its job id; the server ends when the supervisor does) and each rank as a client.

The task srun starts (the client) hands the node's server its environment, working directory,
umask, CPU affinity and stdin/stdout/stderr (SCM_RIGHTS) over an abstract unix socket named after
the uid, the job and the node. Both ends check the other's uid (SO_PEERCRED): another user's
process can neither run code as ours nor read our environment. The server forks; the child takes
the client's environment and descriptors and runs the module as `python -m` would, the rest of
the interpreter's life included (atexit, exit status). The client relays the signals srun and
SLURM send it and ends as the child ended (the same code, or killed by the same signal), so srun's
--kill-on-bad-exit and the restart decision see what they saw without it. A client that is killed
(srun's SIGKILL after a bad exit) closes its socket, and the server kills its child: no rank
outlives its task. Anything amiss (no server, another owner, a server that goes away before the
fork) and the client runs the module itself, cold, as before.

Forking after `import torch` is what every DataLoader worker does; the server imports nothing of
ddpjob (frozen code, environment read at import) and starts no thread, CUDA or process group, so
the child starts as clean as a fresh interpreter that has imported torch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from typing import Any, NoReturn

from ddpjob import earlysignals

if __name__ == "__main__":
    # srun's task (or the node's server): a stop signal from here on is noted, not the default's
    # end of the task while the imports below and the connection run. A stressed pass saw a
    # requeued job's warning signal come 4 s into its start: every task died of SIGUSR2.
    earlysignals.hold()

from ddpjob.node import preemption  # noqa: E402
from ddpjob.node.warmserver import MAX_FDS, handle_relayed, peer_uid, read_line, run_request, serve  # noqa: E402

ENV = "DDPJOB_WARM"  # "1" where the servers were started (templates/sbatch.sh.tmpl, launch/local.py)
# How long a client retries a refused connection when ENV says a server was started: the srun
# step that runs it may still be starting. Past that the rank starts cold, which is only slower.
CONNECT_S = 20.0
REPLY_S = 600.0  # the server's first answer waits for its imports (once, at the job's start)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def address(env: dict[str, str] | os._Environ[str] = os.environ) -> bytes | None:
    """The node's server address for this job and uid (abstract: no file to clean up or to
    secure), or None outside a SLURM job step or with a node name we would not put in it."""
    job, node = env.get("SLURM_JOB_ID", ""), env.get("SLURMD_NODENAME", "")
    if not (job.isdigit() and _NAME.fullmatch(node)):
        return None
    return f"\0ddpjob-warm-{os.getuid()}-{job}-{node}".encode()


def _connect(addr: bytes, wait: bool) -> socket.socket | None:
    deadline = time.monotonic() + (CONNECT_S if wait else 0.0)
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(addr)
        except ConnectionRefusedError:
            sock.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
            continue
        except OSError:
            sock.close()
            return None
        if peer_uid(sock) != os.getuid():  # someone else holds the name: never talk to it
            sock.close()
            return None
        return sock


def _inherited() -> list[int]:
    """The descriptors above stderr that an exec would pass on (not close-on-exec): the rank
    gets them at the same numbers, as it would cold (the local backend's run lock)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                out.append(fd)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return sorted(out)[:MAX_FDS - 3]


def client(module_argv: list[str], addr: bytes | None = None, wait: bool = False) -> int:
    """Run `python -m MODULE ARGS...` through a server (this node's, unless `addr` names
    another), else cold (exec). `wait`: retry a refused connection (the server may be starting)."""
    cold = [sys.executable, "-u", "-m", *module_argv]  # the ranks always run unbuffered
    addr = addr or address()
    sock = _connect(addr, wait or os.environ.get(ENV) == "1") if addr else None
    if sock is None:
        _exec(cold)
    pid: list[int] = []

    def relay(signum: int, frame: Any) -> None:
        if not pid:  # no rank yet: noted with what came while this task started, for it or cold
            earlysignals.note(signum, frame)
            return
        try:
            os.kill(pid[0], signum)
        except ProcessLookupError:
            pass

    handle_relayed(relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, preemption.HELD)  # held back by the launcher: relayed now
    umask = os.umask(0o077)
    os.umask(umask)
    targets = [0, 1, 2, *_inherited()]
    request = {"argv": module_argv, "python": sys.executable, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
               "cpus": sorted(os.sched_getaffinity(0)), "targets": targets, "session": os.getsid(0) == os.getpid()}
    buf = bytearray()
    try:
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], targets)
        sock.settimeout(REPLY_S)
        reply = read_line(sock, buf)
        sock.settimeout(None)
    except (OSError, ValueError):
        reply = None
    if not reply or not isinstance(reply.get("pid"), int):
        sock.close()  # the server went away before forking, or would run other code: start cold
        if reply and isinstance(reply.get("error"), str):
            print(f"ddpjob: warm start: rank {os.environ.get('SLURM_PROCID', '?')} starts cold: "
                  f"{reply['error']}", file=sys.stderr, flush=True)
        _exec(cold)  # exec puts the relaying handlers back to the default
    pid.append(reply["pid"])
    while earlysignals.noted:
        relay(earlysignals.noted.pop(0)[0], None)
    try:
        end = read_line(sock, buf)
    except (OSError, ValueError):
        end = None
    if end is None:  # the server died (its node is going down with it)
        print(f"ddpjob: warm start: the server forking rank {os.environ.get('SLURM_PROCID', '?')} "
              "went away; ending the task", file=sys.stderr, flush=True)
        try:
            os.kill(pid[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        return 1
    if "signal" in end:
        died_of = int(end["signal"])
        handle_relayed(signal.SIG_DFL)
        os.kill(os.getpid(), died_of)  # end as the rank ended: srun reports the same signal
        return 128 + died_of
    return int(end.get("exit", 1))


def _exec(cold: list[str]) -> NoReturn:
    """Run the module in this process, cold. A stop signal noted meanwhile is not lost: it is
    sent again with the stop signals blocked, which exec keeps, and stays pending until the
    rank's StopFlag opens the mask (preemption.StopFlag.install), as the local supervisor holds them."""
    if earlysignals.noted:
        preemption.block_stop_signals()
        for signum in dict.fromkeys(signum for signum, _ in earlysignals.noted):
            if signum in preemption.HELD:
                os.kill(os.getpid(), signum)
    os.execv(sys.executable, cold)


def named(name: str) -> bytes | None:
    """The address of a server named by its starter (the local backend: one per run), not by
    SLURM's job and node; None for a name we would not put in it."""
    return f"\0ddpjob-warm-{os.getuid()}-{name}".encode() if _NAME.fullmatch(name) else None


def main(argv: list[str]) -> int:
    what, rest = argv[:1], argv[1:]
    name = parent = None
    while len(rest) >= 2 and rest[0] in ("--name", "--parent"):
        if rest[0] == "--name":
            name = rest[1]
        else:
            parent = int(rest[1]) if rest[1].isdigit() else None
        rest = rest[2:]
    addr = named(name) if name is not None else None
    usable = name is None or addr is not None
    if what == ["serve"] and not rest and usable:
        addr = addr or address()
        if addr is None:
            print("ddpjob: warm start: not in a SLURM job step (SLURM_JOB_ID, SLURMD_NODENAME); "
                  "nothing to serve", file=sys.stderr)
            return 0
        request = serve(addr, parent=parent)
        if request is None:  # the server, done: nothing to flush or close, and tearing down what
            os._exit(0)  # torch imported took 1.8 s, which the run's end waited for
        run_request(request)
        return 0
    while rest[:1] == ["-u"]:  # submitit writes `PYTHON -u -m submitit.core._submit` after us
        rest = rest[1:]
    if what == ["run"] and len(rest) >= 2 and rest[0] == "-m" and usable:
        return client(rest[1:], addr)
    print("usage: python -m ddpjob.node.warm serve [--name NAME] [--parent PID] | "
          "run [--name NAME] [-u] -m MODULE [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
