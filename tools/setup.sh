#!/usr/bin/env bash
# Set up ddpjob's Python side from nothing: .venv in the repository root with torch, torchvision
# and `pip install -e '.[test]'`. Idempotent and quick when already done (a stamp records the
# hash of the packaging files it installed from). Run as root on a fresh Debian machine, or as
# any user where python3-venv is already installed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$ROOT/.venv
PY=$VENV/bin/python
# These exact versions install from the machine's local wheel store; others download gigabytes.
TORCH=2.14.1
TORCHVISION=0.29.1
STAMP=$VENV/.ddpjob-setup-stamp
log() { printf '[setup] %s\n' "$*"; }
# Like pip, a module that does not compile (torch ships one in Python 3.12 syntax) is skipped.
compile_py() { "$PY" -m compileall -q -j 0 "$@" >/dev/null || true; }
# pip with --no-compile, then compile_py over site-packages: pip byte-compiles the ~8,700 modules
# it installs one at a time (about a minute here); compileall does it on every core. The .pyc files
# must exist: where PYTHONDONTWRITEBYTECODE is set (this machine sets it), no run would ever write
# them, and every process would compile torch's sources again on each import.
# pip warns about every index location in this machine's pip.conf that does not exist: noise.
pip_install() {
    "$PY" -m pip install -q --no-compile "$@" 2>&1 | sed "/WARNING: Location '.*' is ignored/d"
    compile_py "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
}
T0=$(date +%s)

if [ ! -x "$PY" ]; then
    if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
        log "python3 -m venv is unavailable: installing python3-venv with apt"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    log "creating $VENV"
    python3 -m venv "$VENV"
fi

if "$PY" -c "import torch, torchvision, sys
sys.exit(not (torch.__version__.split('+')[0] == '$TORCH' and torchvision.__version__.split('+')[0] == '$TORCHVISION'))" >/dev/null 2>&1
then
    log "torch $TORCH and torchvision $TORCHVISION already installed"
else
    # The x86_64 wheels are CUDA builds: ~5.5 GB in the venv. Say so in one line before pip
    # fails half-way with "[Errno 28] No space left on device". 7 GiB: 1 GiB of room on top.
    free_kb=$(df -Pk "$VENV" | awk 'NR == 2 {print $4}')
    if [ "${free_kb:-0}" -lt $((7 * 1024 * 1024)) ]; then
        printf '[setup] error: %s MiB free for %s, torch %s + torchvision %s need about 6 GiB. Hint: free some space (an old clone'"'"'s .venv, /tmp) and rerun.\n' \
            "$((free_kb / 1024))" "$VENV" "$TORCH" "$TORCHVISION" >&2
        exit 1
    fi
    log "installing torch==$TORCH torchvision==$TORCHVISION (about a minute)"
    pip_install "torch==$TORCH" "torchvision==$TORCHVISION"
fi

want=$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && "$PY" -c 'import ddpjob, pytest' >/dev/null 2>&1; then
    log "ddpjob (editable) and test dependencies already installed"
else
    log "installing ddpjob (editable) with its test dependencies"
    pip_install -e "$ROOT[test]"
    echo "$want" >"$STAMP"
fi
# ddpjob's own modules too (an editable install: they stay in the repository), on every call, so
# that the test command starts from fresh .pyc files after an edit; quick when they are current.
compile_py "$ROOT/ddpjob"
log "python environment ready in $(( $(date +%s) - T0 ))s: $VENV"
