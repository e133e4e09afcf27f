"""A rank's output into RUN_DIR/logs/rank-R.log under torchrun, which otherwise writes it to its own
stdout only (unless --log-dir/--redirects/--tee), where `ddpjob logs` cannot find it.

Called by init() (rank/start.py) once the run dir is known: what the rank printed before (the
imports) is on torchrun's stdout alone. The other launchers write rank logs themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def tee(log: Path) -> bool:
    """From now on fd 1 and fd 2 still go where they went and are appended to `log`, through one
    `tee -a` each. The tees lead sessions of their own: a Ctrl-C in torchrun's terminal must not
    end them before the rank has written its last lines; each ends when the rank (and any child
    that inherited the descriptor) has closed its pipe, so a rank killed with -9 loses nothing it
    wrote. False where there is no `tee`."""
    program = shutil.which("tee")
    if program is None:
        return False
    log.parent.mkdir(parents=True, exist_ok=True)
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        proc = subprocess.Popen([program, "-a", str(log)], stdin=subprocess.PIPE, stdout=fd,
                                start_new_session=True)
        assert proc.stdin is not None
        os.dup2(proc.stdin.fileno(), fd)
        proc.stdin.close()
    return True
