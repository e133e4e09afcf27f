"""The test session's warm server: the `ddpjob run` ranks that tests/ranks.py starts are forked
from one process that imported torch once (ddpjob.node.warm, as a SLURM job's ranks are after a
restart), instead of each importing it again: about 4 s of CPU per rank on the 2-core CI machine,
where a test's ranks took most of their time starting.

    python -u tests/zygote.py serve NAME              # once per pytest session, on first use
    python -u tests/zygote.py run NAME MODULE ARGS... # each rank: warm.client, which relays
                                                      # signals and ends as its rank ended

The ranks are real processes with real signals and exit codes; only their start differs. A rank
whose PYTHONPATH or working directory differs from the server's is started cold by the caller
(`eligible`), so no test runs code other than it names.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# What a `ddpjob run` rank imports before its first step, beyond warmserver.PRELOAD (all installed
# packages, none from the repository: the ranks import ddpjob itself fresh)
PRELOAD_MORE = ("torchvision", "torch.utils.data", "torch.utils.tensorboard")
OFF = "DDPJOB_TEST_COLD"  # "1": every rank starts cold (to compare, or to rule the server out)

_server: subprocess.Popen[bytes] | None = None


def _name() -> str:
    return f"ddpjob-test-zygote-{os.getuid()}-{os.getpid()}"


def eligible(env: dict[str, str], cwd: Path, base: dict[str, str]) -> bool:
    """Would a rank with this environment and working directory import what a server started
    with `base` (ranks.base_env()) in REPO did?"""
    return (os.environ.get(OFF) != "1" and cwd.resolve() == REPO
            and all(env.get(k) == base.get(k) for k in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH",
                                                        "PYTHONNOUSERSITE", "PYTHONUSERBASE")))


def command(module_argv: list[str], log_dir: Path, base: dict[str, str]) -> list[str]:
    """The command that runs `python -m MODULE_ARGV` forked from this session's server (started
    on first use with the environment `base`, in REPO, its log in `log_dir`)."""
    global _server
    if _server is None or _server.poll() is not None:
        with open(log_dir / "zygote.log", "ab") as out:
            _server = subprocess.Popen([sys.executable, "-u", __file__, "serve", _name()], cwd=REPO, env=base,
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        atexit.register(_stop, _server)
    return [sys.executable, "-u", __file__, "run", _name(), *module_argv]


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM: the server ends once its last child has (any still running is killed first)."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main(argv: list[str]) -> int:
    sys.path.remove(str(TESTS))  # the script's folder, which `python tests/zygote.py` put first
    from ddpjob.node import warm, warmserver

    if argv[:1] == ["serve"] and len(argv) == 2:
        request = warmserver.serve(b"\0" + argv[1].encode(), warmserver.PRELOAD + PRELOAD_MORE)
        if request is not None:
            sys.path.insert(0, str(REPO))  # as `python -m` in REPO would have it
            warmserver.run_request(request)
        return 0
    if argv[:1] == ["run"] and len(argv) >= 3:
        return warm.client(argv[2:], b"\0" + argv[1].encode(), wait=True)
    print("usage: zygote.py serve NAME | run NAME MODULE [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
