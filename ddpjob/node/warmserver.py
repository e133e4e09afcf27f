"""The warm-start server and the protocol it shares with its client (node/warm.py, which tells
the whole story): it imports torch once, then forks one child per request; the child takes the
client's place (descriptors, directory, environment, affinity, session) and runs its module.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

from ddpjob import earlysignals  # standard library only, no environment read: safe to hold in the server

# What a rank imports before its first step, in the order it does (torch._dynamo comes with the
# first Optimizer(): torch wraps its methods in torch._disable_dynamo).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "numpy")
# Signals SLURM or srun may send a task: the client passes them on, the server ignores them (its
# children get them from SLURM too, as members of its step, and from their clients).
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGQUIT, signal.SIGALRM, signal.SIGCONT, signal.SIGABRT)
FORKED = "DDPJOB_WARM_FORKED"  # set in a forked rank's environment: its start record says warm
MAX_FDS = 64  # stdin, stdout, stderr and the inheritable descriptors a client passes on (a run lock)
# What decided which code the server imported (and its children will): a client whose differ
# would run other code forked than cold, so it starts cold.
SAME = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE")


def handle_relayed(handler: Any) -> None:
    for signum in RELAYED:
        signal.signal(signum, handler)


def peer_uid(sock: socket.socket) -> int:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    return uid


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def read_line(sock: socket.socket, buf: bytearray, limit: int = 1 << 22) -> dict[str, Any] | None:
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
    fds: list[int]  # received, in the order of `targets`
    targets: list[int]  # the client's descriptor numbers: 0, 1, 2, then those it would pass on exec
    session: bool  # the client leads its own session (the local backend's ranks): so does the rank


def serve(addr: bytes, preload: tuple[str, ...] = PRELOAD, parent: int | None = None) -> Request | None:
    """The server's loop. Returns None in the server when it is done, and the request in each
    child it forks (which then becomes the rank: see run_request). `parent`: end (once no child
    is left) when that process is gone, as a SLURM step ends with its job."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(addr)
    except OSError as exc:
        print(f"ddpjob: warm start: cannot listen on {addr[1:].decode()} ({exc}); the ranks on "
              f"{os.environ.get('SLURMD_NODENAME', 'this node')} start cold", file=sys.stderr)
        return None
    listener.listen(64)  # clients that come during the imports wait in the backlog
    stopping = []
    handle_relayed(signal.SIG_IGN)
    # SLURM ends the job's steps with SIGTERM: end once no child is left (a child may be
    # writing its checkpoint; it is in this step, so SLURM signals it itself)
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # what came while it started (warm.py holds them from its first line): a SIGTERM ends it as
    # one now would; none is left for the ranks forked from it to take as their own
    stopping.extend(True for signum, _ in earlysignals.noted if signum == signal.SIGTERM)
    earlysignals.noted.clear()
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            pass
    children: dict[int, _Child] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while not (stopping and not children):
        if parent is not None and os.getppid() != parent:
            stopping.append(True)
        # a SIGTERM does not wake select (PEP 475 retries it): look every 0.1 s, so the run or
        # job that ends its server does not wait out a long timeout
        for key, _ in sel.select(timeout=0.1):
            if key.data is None:
                conn, _ = listener.accept()
                request = _take(conn, children)
                if request is None:
                    continue
                why = _differs(request)
                if why:
                    _refuse(conn, request, why)
                    continue
                # The child starts with the server's SIG_IGN: a signal its client relays the
                # moment it has the pid would be lost. Blocked across the fork, it stays pending
                # until the child's own handlers are in (run_request).
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
                pid = os.fork()
                if pid != 0:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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
                send(conn, {"pid": pid})
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
        if peer_uid(conn) != os.getuid():
            conn.close()
            return None
        conn.settimeout(10.0)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
        buf = bytearray(data)
        try:
            msg = read_line(conn, buf)
            if msg is None:
                raise ValueError("closed before a whole request")
            conn.settimeout(None)
            request = Request(argv=[str(a) for a in msg["argv"]], python=str(msg["python"]),
                              env={str(k): str(v) for k, v in msg["env"].items()},
                              cwd=str(msg["cwd"]), umask=int(msg["umask"]),
                              cpus=[int(c) for c in msg["cpus"]], fds=list(fds),
                              targets=[int(t) for t in msg.get("targets", [0, 1, 2])],
                              session=bool(msg.get("session", False)))
            if request.targets[:3] != [0, 1, 2] or len(request.fds) != len(request.targets) or not request.argv:
                raise ValueError("expected stdin, stdout, stderr and a module")
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
        send(conn, {"error": why})
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
        if os.getpgid(child.pid) == child.pid:  # its own session: its children (DataLoader workers) too
            os.killpg(child.pid, signal.SIGKILL)
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
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
                send(child.conn, {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
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
    if request.session:
        os.setsid()
    # received descriptors may sit on each other's target numbers: move them out of the way first
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in request.fds]
    for fd in request.fds:
        os.close(fd)
    for target, fd in zip(request.targets, high):
        os.dup2(fd, target)  # inheritable, as the client's were
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
    handle_relayed(signal.SIG_DFL)
    # A stop signal before the rank's StopFlag is in is noted, not the default's end of the rank,
    # as `python -m ddpjob run` does from its first line: every module forked here is a rank
    # (ddpjob run, or submitit's _submit of its rank function) whose StopFlag.install takes the
    # noted ones over. SLURM's USR2 warning reaches the forked ranks while they start (a cluster
    # run lost its rank 0 to it during a restart's start-up on a busy host).
    earlysignals.hold()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)  # blocked by the server across the fork
    _name(f"ddpjob-r{request.env.get('SLURM_PROCID', '')}")


def _name(name: str) -> None:
    """`ps`, `top` and P12's kill storm tell the ranks apart by it (/proc/PID/comm)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_request(request: Request) -> None:
    """In a forked child: become the client's rank and run its module as `python -m` would."""
    _become(request)
    import runpy

    sys.argv = list(request.argv)
    runpy.run_module(request.argv[0], run_name="__main__", alter_sys=True)
