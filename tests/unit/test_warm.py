"""node/warm.py, the warm-start server and its client, as real processes on this machine (no SLURM:
the address comes from SLURM_JOB_ID and SLURMD_NODENAME, which the tests set). One server for the
module (it imports torch once); every case waits for a file or a process, never a timer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob.node import warm

# The rank stand-in: reports what it sees, then does what argv[1] says.
RANK = r'''
import json, os, signal, sys, time
out = {"foo": os.environ.get("FOO"), "argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(),
       "ppid": os.getppid(), "torch_before": "torch" in sys.modules,
       "forked": os.environ.get("DDPJOB_WARM_FORKED"), "umask": oct(os.umask(0o22)),
       "session_leader": os.getsid(0) == os.getpid()}
try:  # a descriptor the task inherited (the local backend's run lock): the same number here
    out["fd9"] = os.read(9, 100).decode()
except OSError:
    out["fd9"] = None
print(json.dumps(out), flush=True)
what, here = sys.argv[1], os.environ.get("T", ".")
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    raise ValueError("boom from the rank")
if what == "signal":
    got = []
    signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
    open(os.path.join(here, "ready"), "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(5 if got else 6)
if what == "early":  # a stop signal at the rank's first line, before any handler of its own
    os.kill(os.getpid(), signal.SIGUSR2)
    from ddpjob.node import preemption
    flag = preemption.StopFlag.install()
    print(json.dumps({"code": flag.code, "signum": flag.signum}), flush=True)
    sys.exit(0)
if what == "flag":  # a stop signal sent while the task started: the rank's StopFlag takes it
    from ddpjob.node import preemption
    flag = preemption.StopFlag.install()
    deadline = time.monotonic() + 60
    while not flag.code and time.monotonic() < deadline:
        time.sleep(0.02)
    print(json.dumps({"code": flag.code, "signum": flag.signum}), flush=True)
    sys.exit(0)
if what == "hold":  # until the test kills something
    # written whole, then renamed: the test reads "pid" as soon as it exists, and an open()
    # then write() let it read the empty file in between under load
    with open(os.path.join(here, "pid.part"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(here, "pid.part"), os.path.join(here, "pid"))
    time.sleep(120)
'''


def _env(tmp: Path, job: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "DDPJOB"))}
    env.update(SLURM_JOB_ID=job, SLURMD_NODENAME="unit-node", PYTHONPATH=str(tmp), PYTHONSAFEPATH="1",
               T=str(tmp), DDPJOB_WARM="1")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, subprocess.Popen]]:
    tmp = tmp_path_factory.mktemp("warm")
    (tmp / "rankmod.py").write_text(RANK)
    job = str(900_000_000 + os.getpid())  # no other test's server has this address
    proc = subprocess.Popen([sys.executable, "-u", "-m", "ddpjob.node.warm", "serve"], cwd=tmp,
                            env=_env(tmp, job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield tmp, job, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _client(server: tuple[Path, str, subprocess.Popen], *args: str, job: str | None = None,
            umask: int = -1, name: list[str] = [], **env: str) -> subprocess.Popen:
    tmp, own, _ = server
    for file in ("ready", "pid"):
        (tmp / file).unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, "-u", "-m", "ddpjob.node.warm", "run", *name, "-m", "rankmod", *args],
                            cwd=tmp, env=_env(tmp, job or own, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, umask=umask)


def _until(cond, what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):  # gone before or while /proc was read (ENOENT, ESRCH)
        return True


def test_a_forked_rank_runs_as_the_task_would_with_torch_already_imported(server) -> None:
    proc = _client(server, "exit", "7", umask=0o027, FOO="bar")
    out, err = proc.communicate(timeout=300)
    seen = json.loads(out.splitlines()[0])
    assert proc.returncode == 7, err  # its exit status is the task's
    assert seen["foo"] == "bar" and seen["argv"] == ["exit", "7"] and seen["cwd"] == str(server[0])
    assert seen["ppid"] == server[2].pid and seen["forked"] == "1" and seen["torch_before"], seen
    assert seen["umask"] == oct(0o027)  # the task's, not the server's


def test_an_exception_in_the_rank_reaches_the_tasks_stderr_and_status(server) -> None:
    proc = _client(server, "raise")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "ValueError: boom from the rank" in err, err


def test_a_signal_to_the_task_reaches_the_rank(server) -> None:
    proc = _client(server, "signal")
    _until(lambda: (server[0] / "ready").exists() or proc.poll() is not None, "the rank's handler")
    proc.send_signal(signal.SIGUSR2)  # what srun does with scancel --signal=USR2
    proc.communicate(timeout=120)
    assert proc.returncode == 5  # the rank's handler ran


def test_a_stop_signal_before_the_ranks_handlers_is_kept_for_its_stop_flag(server) -> None:
    """SLURM's USR2 warning reaches a forked rank while it starts (a cluster run lost rank 0 of a
    restart to it on a busy host): noted, and the rank's StopFlag takes it over, as a cold
    `python -m ddpjob run` does. The signal is sent at the rank's first line, not by a timer."""
    proc = _client(server, "early")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (proc.returncode, err)  # not killed by USR2's default action
    seen = json.loads(out.splitlines()[1])
    assert seen["signum"] == signal.SIGUSR2 and seen["code"] != 0, seen


def _catches(pid: int, signum: int) -> bool:
    """/proc says the process has a handler for `signum` (SigCgt): its first lines have run."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)


@pytest.mark.parametrize("refused", [False, True])
def test_a_stop_signal_while_the_task_starts_reaches_the_rank(server, tmp_path: Path, refused: bool) -> None:
    """A requeued job's warning came 4 s into its start, while every srun task (the warm client)
    was still importing or waiting for the node's server: all of them died of SIGUSR2. Now the
    task notes it from its first line and the rank gets it, forked (relayed once it exists) or
    cold (where the server refuses it: kept pending across the exec for the rank's StopFlag). The
    signal is sent once /proc shows the task's handler, while no server listens yet; then the
    server starts."""
    tmp = server[0]
    job = str(800_000_000 + os.getpid() + (1 if refused else 0))
    proc = _client(server, "flag", job=job)
    _until(lambda: _catches(proc.pid, signal.SIGUSR2) or proc.poll() is not None, "the task's first lines")
    proc.send_signal(signal.SIGUSR2)
    # the server, with a PYTHONPATH of its own where it must refuse the task
    env = _env(tmp, job, **({"PYTHONPATH": f"{tmp}:{tmp_path}"} if refused else {}))
    srv = subprocess.Popen([sys.executable, "-u", "-m", "ddpjob.node.warm", "serve"], cwd=tmp, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        srv.kill()
        srv.wait()
    assert proc.returncode == 0, (proc.returncode, err)  # not ended by USR2's default action
    seen, flag = (json.loads(line) for line in out.splitlines()[:2])
    assert flag["signum"] == signal.SIGUSR2 and flag["code"] != 0, (flag, err)
    assert seen["forked"] == (None if refused else "1"), (seen, err)


def test_a_rank_killed_by_a_signal_ends_its_task_by_the_same_signal(server) -> None:
    proc = _client(server, "hold")
    _until(lambda: (server[0] / "pid").exists() or proc.poll() is not None, "the rank")
    os.kill(int((server[0] / "pid").read_text()), signal.SIGKILL)  # the OOM killer, kill -9
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL  # srun sees "Killed", as without the server


def test_a_killed_task_takes_its_rank_with_it(server) -> None:
    proc = _client(server, "hold")
    _until(lambda: (server[0] / "pid").exists() or proc.poll() is not None, "the rank")
    rank = int((server[0] / "pid").read_text())
    proc.kill()  # srun --kill-on-bad-exit SIGKILLs the tasks of the step
    proc.communicate(timeout=120)
    _until(lambda: _gone(rank), f"rank process {rank} to be killed")


def test_without_a_server_the_rank_starts_cold(server) -> None:
    proc = _client(server, "exit", "0", job="123", DDPJOB_WARM="0")
    out, err = proc.communicate(timeout=300)
    seen = json.loads(out.splitlines()[0])
    assert proc.returncode == 0, err
    assert not seen["torch_before"] and seen["forked"] is None and seen["ppid"] != server[2].pid, seen


def test_a_rank_whose_python_path_differs_starts_cold_with_a_line(server, tmp_path: Path) -> None:
    proc = _client(server, "exit", "0", PYTHONPATH=f"{server[0]}:{tmp_path}")
    out, err = proc.communicate(timeout=300)
    seen = json.loads(out.splitlines()[0])
    assert proc.returncode == 0 and seen["forked"] is None and not seen["torch_before"], seen
    assert err.count("\n") == 1 and "starts cold: its PYTHONPATH differs from the server's" in err, err


def test_a_server_owned_by_someone_else_is_never_used(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ends check the peer's uid: a name squatted by another user is not talked to."""
    monkeypatch.setenv("SLURM_JOB_ID", server[1])
    monkeypatch.setenv("SLURMD_NODENAME", "unit-node")
    addr = warm.address()
    assert addr is not None
    mine = warm._connect(addr, wait=True)
    assert mine is not None
    mine.close()
    monkeypatch.setattr(warm, "peer_uid", lambda sock: os.getuid() + 1)
    assert warm._connect(addr, wait=False) is None


def test_addresses_take_only_what_slurm_sets() -> None:
    assert warm.address({"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "n1"}) == f"\0ddpjob-warm-{os.getuid()}-12-n1".encode()
    for bad in ({}, {"SLURM_JOB_ID": "12"}, {"SLURM_JOB_ID": "1 2", "SLURMD_NODENAME": "n1"},
                {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "n1/../x"}):
        assert warm.address(bad) is None, bad


def test_a_rank_gets_the_tasks_inherited_descriptors_and_its_own_session(server) -> None:
    """The local backend's ranks lead their own sessions (a kill reaches their children) and
    rank 0 inherits the run lock's descriptor: forked, they get both as they would cold."""
    read, write = os.pipe()
    os.write(write, b"lock")
    os.close(write)
    try:
        tmp, job, srv = server
        proc = subprocess.Popen(
            ["bash", "-c", f'exec 9<&{read}; exec "$@"', "bash", sys.executable, "-u", "-m", "ddpjob.node.warm",
             "run", "-m", "rankmod", "exit", "0"], cwd=tmp, env=_env(tmp, job), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, pass_fds=(read,), start_new_session=True)
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(read)
    seen = json.loads(out.splitlines()[0])
    assert proc.returncode == 0 and seen["ppid"] == srv.pid, (seen, err)
    assert seen["fd9"] == "lock" and seen["session_leader"] is True, seen
    plain = _client(server, "exit", "0")
    seen = json.loads(plain.communicate(timeout=300)[0].splitlines()[0])
    assert seen["fd9"] is None and seen["session_leader"] is False and seen["ppid"] == srv.pid, seen


def test_a_named_server_forks_its_clients_and_ends_when_its_starter_is_gone(server) -> None:
    """The local backend's server: named after the run's job id, started by the supervisor with
    --parent; should the supervisor be killed, the server ends (once no rank is left)."""
    tmp = server[0]
    name = f"unit-{os.getpid()}"
    starter = subprocess.Popen(["bash", "-c", f'{sys.executable} -u -m ddpjob.node.warm serve --name {name} '
                                f'--parent $$ & echo $! > {tmp}/server.pid; wait'], cwd=tmp, env=_env(tmp, "0"))
    try:
        _until(lambda: (tmp / "server.pid").exists() and (tmp / "server.pid").read_text().strip(), "the server")
        pid = int((tmp / "server.pid").read_text())
        proc = _client(server, "exit", "3", name=["--name", name])
        out, err = proc.communicate(timeout=300)
        seen = json.loads(out.splitlines()[0])
        assert proc.returncode == 3 and seen["ppid"] == pid and seen["forked"] == "1", (seen, err)
        assert not _gone(pid)
        starter.kill()  # the supervisor dies (SIGKILL: nothing of it runs)
        starter.wait()
        _until(lambda: _gone(pid), f"server {pid} to end after its starter")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def test_the_server_ends_on_sigterm_once_no_rank_is_left(server) -> None:
    proc = server[2]
    proc.send_signal(signal.SIGTERM)  # the batch shell ends the servers' step
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert out == "", out  # nothing to say on a clean end
