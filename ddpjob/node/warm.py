"""Warm starts: one process per node keeps torch imported and forks each rank's process from it,
so a restart inside the allocation skips the interpreter's and torch's start-up (P12 measured
7.3 s of a 8.2 s recovery there: `import torch`, then torch importing dynamo at the first
`Optimizer()`).

    python -u -m ddpjob.node.warm serve                 # one per node: a background srun step
    python -u -m ddpjob.node.warm run [-u] -m MODULE ARGS... # each rank, as srun's task

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
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

# What a rank imports before its first step, in the order it does (torch._dynamo comes with the
# first Optimizer(): torch wraps its methods in torch._disable_dynamo).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "numpy")
# Signals SLURM or srun may send a task: the client passes them on, the server ignores them (its
# children get them from SLURM too, as members of its step, and from their clients).
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGQUIT, signal.SIGALRM, signal.SIGCONT)
ENV = "DDPJOB_WARM"  # "1" in the batch shell that started the servers (templates/sbatch.sh.tmpl)
FORKED = "DDPJOB_WARM_FORKED"  # set in a forked rank's environment: its start record says warm
# How long a client retries a refused connection when ENV says a server was started: the srun
# step that runs it may still be starting. Past that the rank starts cold, which is only slower.
CONNECT_S = 20.0
REPLY_S = 600.0  # the server's first answer waits for its imports (once, at the job's start)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# What decided which code the server imported (and its children will): a client whose differ
# would run other code forked than cold, so it starts cold.
SAME = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE")


def address(env: dict[str, str] | os._Environ[str] = os.environ) -> bytes | None:
    """The node's server address for this job and uid (abstract: no file to clean up or to
    secure), or None outside a SLURM job step or with a node name we would not put in it."""
    job, node = env.get("SLURM_JOB_ID", ""), env.get("SLURMD_NODENAME", "")
    if not (job.isdigit() and _NAME.fullmatch(node)):
        return None
    return f"\0ddpjob-warm-{os.getuid()}-{job}-{node}".encode()


def _handle_relayed(handler: Any) -> None:
    for signum in RELAYED:
        signal.signal(signum, handler)


def _peer_uid(sock: socket.socket) -> int:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    return uid


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _read_line(sock: socket.socket, buf: bytearray, limit: int = 1 << 22) -> dict[str, Any] | None:
    """One JSON line from `sock` (None at EOF); bytes past it stay in `buf`."""
    while b"\n" not in buf:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > limit:
            raise ValueError("message too long")
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    out = json.loads(line)
    if not isinstance(out, dict):
        raise ValueError("not an object")
    return out


# ---------------------------------------------------------------------------------- the server


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket
    client_gone: bool = False


@dataclass
class Request:
    """What a client asked for: run `argv` (module first) as it would have, in its place."""

    argv: list[str]
    python: str  # the client's sys.executable
    env: dict[str, str]
    cwd: str
    umask: int
    cpus: list[int]
    fds: list[int]


def serve(addr: bytes) -> Request | None:
    """The server's loop. Returns None in the server when it is done, and the request in each
    child it forks (which then becomes the rank: see main)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(addr)
    except OSError as exc:
        print(f"ddpjob: warm start: cannot listen on {addr[1:].decode()} ({exc}); the ranks on "
              f"{os.environ.get('SLURMD_NODENAME', 'this node')} start cold", file=sys.stderr)
        return None
    listener.listen(64)  # clients that come during the imports wait in the backlog
    stopping = []
    _handle_relayed(signal.SIG_IGN)
    # SLURM ends the job's steps with SIGTERM: end once no child is left (a child may be
    # writing its checkpoint; it is in this step, so SLURM signals it itself)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    children: dict[int, _Child] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while not (stopping and not children):
        for key, _ in sel.select(timeout=1.0):
            if key.data is None:
                conn, _ = listener.accept()
                request = _take(conn, children)
                if request is None:
                    continue
                why = _differs(request)
                if why:
                    _refuse(conn, request, why)
                    continue
                pid = os.fork()
                if pid == 0:  # the child: leave the server behind, become the rank
                    sel.close()
                    listener.close()
                    for other in children.values():
                        other.conn.close()
                        os.close(other.pidfd)
                    conn.close()
                    return request
                for fd in request.fds:
                    os.close(fd)
                child = _Child(pid, os.pidfd_open(pid), conn)
                children[pid] = child
                sel.register(child.pidfd, selectors.EVENT_READ, ("exit", child))
                sel.register(conn, selectors.EVENT_READ, ("client", child))
                _send(conn, {"pid": pid})
            elif key.data[0] == "exit":
                _reap(key.data[1], children, sel)
            else:
                child = key.data[1]
                try:
                    gone = not child.conn.recv(4096)
                except OSError:
                    gone = True
                if gone:  # the client was killed: its rank must not outlive it
                    _kill(child)
                    _forget(sel, child.conn)
    sel.close()
    listener.close()
    return None


def _take(conn: socket.socket, children: dict[int, _Child]) -> Request | None:
    """Read and check one request; None (connection closed) if it is not one to serve."""
    try:
        if _peer_uid(conn) != os.getuid():
            conn.close()
            return None
        conn.settimeout(10.0)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        buf = bytearray(data)
        try:
            msg = _read_line(conn, buf)
            if msg is None:
                raise ValueError("closed before a whole request")
            conn.settimeout(None)
            request = Request(argv=[str(a) for a in msg["argv"]], python=str(msg["python"]),
                              env={str(k): str(v) for k, v in msg["env"].items()},
                              cwd=str(msg["cwd"]), umask=int(msg["umask"]),
                              cpus=[int(c) for c in msg["cpus"]], fds=list(fds))
            if len(request.fds) != 3 or not request.argv:
                raise ValueError("expected 3 descriptors and a module")
        except Exception:
            for fd in fds:
                os.close(fd)
            raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        conn.close()
        return None
    # A new rank starts only once every rank of an earlier attempt on this node is gone (whose
    # client srun killed): an old rank 0 could still hold the rendezvous port.
    for child in list(children.values()):
        if child.client_gone or _closed(child.conn):
            _kill(child)
            os.waitpid(child.pid, 0)
    return request


def _differs(request: Request) -> str:
    """Why the client's interpreter would not import what this server did ("" if it would)."""
    if request.python != sys.executable:
        return f"its interpreter is {request.python}, the server's {sys.executable}"
    for key in SAME:
        if request.env.get(key) != os.environ.get(key):
            return f"its {key} differs from the server's"
    if not os.environ.get("PYTHONSAFEPATH") and request.cwd != os.getcwd():
        return "its working directory (first on sys.path without PYTHONSAFEPATH) differs"
    return ""


def _refuse(conn: socket.socket, request: Request, why: str) -> None:
    for fd in request.fds:
        os.close(fd)
    try:
        _send(conn, {"error": why})
    except OSError:
        pass
    conn.close()


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _kill(child: _Child) -> None:
    child.client_gone = True
    try:
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(child: _Child, children: dict[int, _Child], sel: selectors.BaseSelector) -> None:
    try:
        _, status = os.waitpid(child.pid, 0)
    except ChildProcessError:  # already reaped by _take
        status = None
    sel.unregister(child.pidfd)
    os.close(child.pidfd)
    _forget(sel, child.conn)
    if not child.client_gone:
        if status is not None:
            try:
                _send(child.conn, {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                      else {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
    child.conn.close()
    del children[child.pid]


def _forget(sel: selectors.BaseSelector, conn: socket.socket) -> None:
    try:
        sel.unregister(conn)
    except (KeyError, ValueError):
        pass


def _become(request: Request) -> None:
    """In the forked child: take the client's place (descriptors, directory, environment,
    affinity, signals) before running its module."""
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(request.cwd)
    os.umask(request.umask)
    os.environ.clear()
    os.environ.update(request.env)
    os.environ[FORKED] = "1"
    try:
        os.sched_setaffinity(0, request.cpus)
    except (OSError, ValueError):
        pass
    _handle_relayed(signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _name(f"ddpjob-r{request.env.get('SLURM_PROCID', '')}")


def _name(name: str) -> None:
    """`ps`, `top` and P12's kill storm tell the ranks apart by it (/proc/PID/comm)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------- the client


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
        if _peer_uid(sock) != os.getuid():  # someone else holds the name: never talk to it
            sock.close()
            return None
        return sock


def client(module_argv: list[str]) -> int:
    """Run `python -m MODULE ARGS...` through this node's server, else cold (exec)."""
    cold = [sys.executable, "-u", "-m", *module_argv]  # the ranks always run unbuffered
    addr = address()
    sock = _connect(addr, os.environ.get(ENV) == "1") if addr else None
    if sock is None:
        os.execv(sys.executable, cold)
    pending: list[int] = []
    pid: list[int] = []

    def relay(signum: int, frame: Any) -> None:
        if pid:
            try:
                os.kill(pid[0], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    _handle_relayed(relay)
    umask = os.umask(0o077)
    os.umask(umask)
    request = {"argv": module_argv, "python": sys.executable, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
               "cpus": sorted(os.sched_getaffinity(0))}
    buf = bytearray()
    try:
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        sock.settimeout(REPLY_S)
        reply = _read_line(sock, buf)
        sock.settimeout(None)
    except (OSError, ValueError):
        reply = None
    if not reply or not isinstance(reply.get("pid"), int):
        sock.close()  # the server went away before forking, or would run other code: start cold
        if reply and isinstance(reply.get("error"), str):
            print(f"ddpjob: warm start: rank {os.environ.get('SLURM_PROCID', '?')} starts cold: "
                  f"{reply['error']}", file=sys.stderr, flush=True)
        os.execv(sys.executable, cold)  # exec puts the relaying handlers back to the default
    pid.append(reply["pid"])
    for waiting in pending:
        relay(waiting, None)
    try:
        end = _read_line(sock, buf)
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
        _handle_relayed(signal.SIG_DFL)
        os.kill(os.getpid(), died_of)  # end as the rank ended: srun reports the same signal
        return 128 + died_of
    return int(end.get("exit", 1))


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 1:
        addr = address()
        if addr is None:
            print("ddpjob: warm start: not in a SLURM job step (SLURM_JOB_ID, SLURMD_NODENAME); "
                  "nothing to serve", file=sys.stderr)
            return 0
        request = serve(addr)
        if request is None:
            return 0
        _become(request)
        import runpy

        sys.argv = list(request.argv)
        runpy.run_module(request.argv[0], run_name="__main__", alter_sys=True)
        return 0
    rest = argv[1:]
    while rest[:1] == ["-u"]:  # submitit writes `PYTHON -u -m submitit.core._submit` after us
        rest = rest[1:]
    if argv[:1] == ["run"] and len(rest) >= 2 and rest[0] == "-m":
        return client(rest[1:])
    print("usage: python -m ddpjob.node.warm serve | run [-u] -m MODULE [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
