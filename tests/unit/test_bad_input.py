"""Bad input through the CLI: exactly one `ddpjob: error: ... Hint: ...` line on stderr, exit 2
(usage) or 1 (runtime), no traceback (unless --debug), and nothing half-written: no run dir, the
-o file unchanged.

The cases call `cli.main(argv)` in this process (what the console script calls; its return value
is the exit status), in a work dir of their own. Three go through a real process, for what only
one shows: the console script's exit status and stderr, `python -m ddpjob`, and --debug's
traceback printed by the interpreter.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob import cli
from ddpjob.errors import DDPJobError

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [str(Path(sys.executable).parent / "ddpjob")]
if not Path(DDPJOB[0]).exists():  # not run from the venv: the module works the same
    DDPJOB = [sys.executable, "-m", "ddpjob"]
SMOKE = (REPO / "jobs" / "smoke.toml").read_text()
OLD = "#!/bin/bash\n# the previous script, which must survive a failed run\n"


class _Hung(BaseException):
    """Not an Exception: cli.main turns those into an 'internal error' line."""


@pytest.fixture(autouse=True)
def _process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a command may change in its process (it would end with a real one): the umask
    (rundir.private_umask), sys.path, the environment, signal handlers."""
    umask = os.umask(0o022)
    os.umask(umask)
    env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP,
                                                 signal.SIGUSR1, signal.SIGUSR2)}
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def _ddpjob(*argv: str, within_s: int = 60) -> int:
    """`ddpjob ARGV` in this process; the exit status the console script would have. A command
    that does not end within `within_s` (a FIFO read, a huge file read whole) fails the test."""
    def late(signum: int, frame: object) -> None:
        raise _Hung(f"`ddpjob {' '.join(argv)[:200]}` still running after {within_s} s")

    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(within_s)
    try:
        return cli.main(list(argv))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _the_one_line(err: str, out: str, expected: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ddpjob: error: ") and "Hint: " in lines[0], lines[0]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err and "internal error" not in err and out == "", (err, out[-2000:])
    return lines[0]


def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (root ignores permission bits: use /sys)."""
    if os.geteuid() == 0:
        if not Path("/sys/fs").is_dir():
            pytest.skip("running as root without /sys: no unwritable folder to test with")
        return Path("/sys/fs")
    d = tmp_path / "readonly"
    d.mkdir(mode=0o500)
    return d


def _job(tmp_path: Path, text: str) -> str:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return str(p)


def _edit(section: str, line: str) -> str:
    """smoke.toml with `line` at the top of [section], replacing that key if it is there
    (TOML refuses a key written twice)."""
    key = line.split("=")[0].strip()
    lines = SMOKE.splitlines()
    start = lines.index(f"[{section}]")
    out = [x for i, x in enumerate(lines) if not (i > start and x.split("=")[0].strip() == key
                                                  and _section_of(lines, i) == section)]
    out.insert(out.index(f"[{section}]") + 1, line)
    return "\n".join(out) + "\n"


def _section_of(lines: list[str], i: int) -> str:
    return next(x.strip("[]") for x in reversed(lines[:i]) if x.startswith("["))


def _source(tmp_path: Path, name: str, text: str) -> str:
    """A file of the user's in the folder ddpjob runs from (the test's work dir)."""
    (tmp_path / "work" / name).write_text(text)
    return name


def _entry(tmp_path: Path, name: str, text: str, entry: str) -> list[str]:
    """smoke.toml with train.entry naming a file of the user's that is wrong in some way."""
    _source(tmp_path, name, text)
    return ["jobs/smoke.toml", "--set", f"train.entry={json.dumps(entry)}"]


def _existing_run(tmp_path: Path, kind: str) -> str:
    d = tmp_path / "existing"
    d.mkdir()
    if kind == "other-config":
        (d / "config.json").write_text(json.dumps({"name": "someone-else"}))
    else:
        (d / "notes.txt").write_text("my thesis")
    return str(d)


def _template(tmp_path: Path, text: str | None) -> str:
    p = tmp_path / "my.tmpl"
    if text is not None:
        p.write_text(text)
    return str(p)


def _open_folder(tmp_path: Path, mode: int = 0o777) -> Path:
    """A scratch folder anyone may write, without the sticky bit: anyone could rename a run
    below it away and put theirs in its place."""
    d = tmp_path / "scratch"
    d.mkdir(exist_ok=True)
    d.chmod(mode)
    return d


def _fifo(tmp_path: Path) -> str:
    p = tmp_path / "my.tmpl"
    os.mkfifo(p)  # no writer: a plain open() of it blocks forever
    return str(p)


# (id, exit code, args builder(tmp_path) -> argv after `ddpjob sbatch`, text the line must hold)
CASES = [
    ("missing job file", 2, lambda t: ["nope.toml"], "not found"),
    ("bad toml", 2, lambda t: [_job(t, "[slurm\nnodes = 1\n")], "not valid TOML"),
    ("unknown section", 2, lambda t: [_job(t, SMOKE + "[slurmm]\nnodes = 2\n")], "'slurmm'"),
    ("unknown key", 2, lambda t: [_job(t, _edit("slurm", "nodez = 2"))],
     "expected one of: account, constraint, container, container_mounts"),
    ("wrong type", 2, lambda t: [_job(t, _edit("slurm", 'nodes = "two"'))], "expected an integer"),
    ("nodes zero", 2, lambda t: ["jobs/smoke.toml", "--nodes", "0"], "slurm.nodes is 0"),
    ("nodes negative", 2, lambda t: ["jobs/smoke.toml", "--nodes=-2"], "slurm.nodes is -2"),
    ("nodes not a number", 2, lambda t: ["jobs/smoke.toml", "--nodes", "two"], "invalid int"),
    ("bad time", 2, lambda t: ["jobs/smoke.toml", "--time", "4h"], "not a SLURM time limit"),
    ("bad signal", 2, lambda t: [_job(t, _edit("slurm", 'signal = "FOO"'))], "slurm.signal"),
    ("B: signal", 2, lambda t: ["jobs/smoke.toml", "--set", "slurm.signal=B:USR2"], "'B:USR2'"),
    ("set without =", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr"], "has no '='"),
    ("set unknown key", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lrr=0.1"],
     "unknown key 'train.lrr'"),
    ("set wrong type", 2, lambda t: ["jobs/smoke.toml", "--set", "train.max_steps=many"],
     "expected an integer"),
    ("global batch", 2, lambda t: ["jobs/smoke.toml", "--set", "train.global_batch_size=100"],
     "not a multiple"),
    ("unknown amp", 2, lambda t: ["jobs/smoke.toml", "--set", "train.amp=fp8"], "train.amp"),
    ("unknown grad compression", 2, lambda t: ["jobs/smoke.toml", "--set", 'train.grad_compression="fp8"'],
     "train.grad_compression"),
    ("grad compression with fsdp", 2, lambda t: ["jobs/smoke.toml", "--set", 'train.grad_compression="bf16"',
                                                 "--set", 'train.strategy="fsdp"'], "train.grad_compression"),
    ("unknown optimizer", 2, lambda t: ["jobs/smoke.toml", "--set", "train.optimizer=lion"],
     "train.optimizer"),
    ("unknown dataset", 2, lambda t: ["jobs/smoke.toml", "--set", "data.dataset=imagenet"],
     "data.dataset"),
    ("name with space", 2, lambda t: ["jobs/smoke.toml", "--name", "my job"], "name 'my job'"),
    ("name with newline", 2, lambda t: ["jobs/smoke.toml", "--name", "a\nb"], "name 'a\\nb'"),
    ("name with $()", 2, lambda t: ["jobs/smoke.toml", "--name", "$(touch PWNED)"], "name"),
    ("name with ;", 2, lambda t: ["jobs/smoke.toml", "--name", "a;touch PWNED"], "name"),
    ("name with %j", 2, lambda t: ["jobs/smoke.toml", "--name", "run%j"], "name"),
    ("name with ../", 2, lambda t: ["jobs/smoke.toml", "--name", "../escape"], "name"),
    ("name with leading -", 2, lambda t: ["jobs/smoke.toml", "--set", "name=-rf"], "name"),
    ("partition with quote", 2, lambda t: ["jobs/smoke.toml", "--partition", "lo'w"],
     "not a valid SLURM name"),
    ("account with space", 2, lambda t: ["jobs/smoke.toml", "--account", "a b"],
     "not a valid SLURM name"),
    ("sbatch_extra --wrap", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--wrap=true;rm -rf ~"]'))],
     "sets --wrap"),
    ("sbatch_extra newline", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--comment=a\\n#SBATCH --partition=high"]'))],
     "one '--option=value' argument"),
    ("sbatch_extra short option", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["-p high"]'))],
     "one '--option=value' argument"),
    ("setup newline", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["echo a\\ntouch PWNED"]'))],
     "contains a newline"),
    ("mem with space", 2, lambda t: ["jobs/smoke.toml", "--set", "slurm.mem=32 GB"], "slurm.mem"),
    ("lead beyond limit", 2, lambda t: ["jobs/smoke.toml", "--time", "1"], "below the time limit"),
    ("missing template", 2, lambda t: ["jobs/smoke.toml", "--template", _template(t, None)],
     "not found"),
    ("template is a folder", 2, lambda t: ["jobs/smoke.toml", "--template", str(t)], "directory"),
    ("run dir below a 0777 folder", 1, lambda t: ["jobs/smoke.toml", "--run-dir", str(_open_folder(t) / "a" / "run")],
     "which has no sticky bit (mode 0777)"),
    ("template is a FIFO", 2, lambda t: ["jobs/smoke.toml", "--template", _fifo(t)], "is a FIFO"),  # hung sbatch
    ("template is a device", 2, lambda t: ["jobs/smoke.toml", "--template", "/dev/zero"], "is a device"),
    ("unknown placeholder", 2, lambda t: ["jobs/smoke.toml", "--template",
                                          _template(t, "srun ${python} ${rundir}\n")],
     "unknown placeholder ${rundir}"),
    ("run dir with newline", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t / "a\nb")],
     "newline"),
    ("run dir with backslash", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t / "a\\b")],
     "backslash"),
    ("-o missing folder", 1, lambda t: ["jobs/smoke.toml", "-o", str(t / "no" / "x.sbatch")],
     "does not exist"),
    ("-o is a folder", 1, lambda t: ["jobs/smoke.toml", "-o", str(t)], "is a folder, expected a new file"),
    ("-o unwritable", 1, lambda t: ["jobs/smoke.toml", "-o", str(_unwritable(t) / "x.sbatch")],
     "cannot write"),
    ("unwritable run dir", 1, lambda t: ["jobs/smoke.toml", "--run-dir",
                                         str(_unwritable(t) / "ddpjob-run")], "cannot create run dir"),
    ("run dir with another config", 2, lambda t: ["jobs/smoke.toml", "--run-dir",
                                                  _existing_run(t, "other-config")],
     "holds another job"),
    ("run dir not a run dir", 2, lambda t: ["jobs/smoke.toml", "--run-dir",
                                            _existing_run(t, "foreign")], "is not empty"),
    ("no -o", 2, lambda t: ["jobs/smoke.toml"], "-o/--output"),
    # ---- issue 11: a newline at either end, control characters, odd digits
    ("name trailing newline", 2, lambda t: ["jobs/smoke.toml", "--name", "smoke\n"], "name"),
    ("name leading newline", 2, lambda t: ["jobs/smoke.toml", "--name", "\nsmoke"], "name"),
    ("name newline via --set", 2, lambda t: ["jobs/smoke.toml", "--set", 'name="smoke\\n"'], "name"),
    ("partition trailing newline", 2, lambda t: ["jobs/smoke.toml", "--partition", "gpu\n"],
     "slurm.partition"),
    ("partition leading newline", 2, lambda t: ["jobs/smoke.toml", "--partition", "\ngpu"],
     "slurm.partition"),
    ("partition unicode", 2, lambda t: ["jobs/smoke.toml", "--partition", "gp\u00fc"],
     "not a valid SLURM name"),
    ("account trailing newline", 2, lambda t: ["jobs/smoke.toml", "--account", "proj\n"],
     "slurm.account"),
    ("account leading newline", 2, lambda t: ["jobs/smoke.toml", "--account", "\nproj"],
     "slurm.account"),
    ("qos trailing newline", 2, lambda t: ["jobs/smoke.toml", "--qos", "high\n"], "slurm.qos"),
    ("qos with $()", 2, lambda t: ["jobs/smoke.toml", "--qos", "$(id)"], "slurm.qos"),
    ("constraint trailing newline", 2, lambda t: ["jobs/smoke.toml", "--set",
                                                  'slurm.constraint="a100\\n"'], "slurm.constraint"),
    ("constraint with backtick", 2, lambda t: ["jobs/smoke.toml", "--set",
                                               "slurm.constraint=a`id`"], "slurm.constraint"),
    ("mem trailing newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'slurm.mem="32G\\n"'],
     "slurm.mem"),
    ("mem trailing space", 2, lambda t: ["jobs/smoke.toml", "--set", 'slurm.mem="32G "'],
     "slurm.mem"),
    ("mem arabic digits", 2, lambda t: ["jobs/smoke.toml", "--set", 'slurm.mem="\u0663\u0662G"'],
     "slurm.mem"),
    ("time trailing newline", 2, lambda t: ["jobs/smoke.toml", "--time", "01:00:00\n"], "slurm.time"),
    ("time leading newline", 2, lambda t: ["jobs/smoke.toml", "--time", "\n01:00:00"], "slurm.time"),
    ("time arabic digits", 2, lambda t: ["jobs/smoke.toml", "--time", "\u0660\u0661:00:00"],
     "not a SLURM time limit"),
    ("time too long", 2, lambda t: ["jobs/smoke.toml", "--time", "99999999"], "at most 365 days"),
    # ---- sbatch_extra: abbreviations of reserved options, short options, separators
    ("extra --sig abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--sig=B:USR2@60"]'))],
     "--signal"),
    ("extra --part abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--part=evil"]'))],
     "--partition"),
    ("extra --out abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--out=/tmp/x-%j.out"]'))],
     "--output"),
    ("extra --err abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--err=/tmp/e"]'))],
     "--error"),
    ("extra --job abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--job=x"]'))],
     "--job-name"),
    ("extra --gpus", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--gpus=4"]'))],
     "--gpus-per-node"),
    ("extra --ntasks-per abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--ntasks-per=2"]'))],
     "--ntasks-per-node"),
    ("extra --open abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--open=truncate"]'))],
     "--open-mode"),
    ("extra --arr abbreviation", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--arr=0-3"]'))],
     "--array"),
    ("extra short -o", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["-o/tmp/x"]'))],
     "one '--option=value' argument"),
    ("extra packjob", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--comment=packjob"]'))],
     "hetjob"),
    ("extra HETJOB", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--comment=my-HetJob"]'))],
     "hetjob"),
    ("extra backslash", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--comment=a\\\\b"]'))],
     "backslash"),
    ("extra trailing newline", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--exclusive\\n"]'))],
     "newline"),
    # ---- setup lines that could become directives or swallow the script
    ("setup #SBATCH line", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["#SBATCH --partition=evil"]'))],
     "starts with '#'"),
    ("setup indented comment", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["  # note"]'))],
     "starts with '#'"),
    ("setup open quote", 2, lambda t: [_job(t, _edit("slurm", "setup = [\"echo 'a\"]"))],
     "not a complete shell line"),
    ("setup trailing backslash", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["echo a \\\\"]'))],
     "not a complete shell line"),
    ("setup here-doc", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["cat <<EOF"]'))], "here-document"),
    ("setup carriage return", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["echo a\\rb"]'))],
     "control character"),
    # ---- --set values that look like TOML but do not parse
    ("set list missing ]", 2, lambda t: ["jobs/smoke.toml", "--set", 'slurm.setup=["echo a", "echo b"'],
     "does not parse"),
    ("set table missing }", 2, lambda t: ["jobs/smoke.toml", "--set", "user.x={a = 1"], "does not parse"),
    ("set open double quote", 2, lambda t: ["jobs/smoke.toml", "--set", 'name="smoke'], "does not parse"),
    ("set open single quote", 2, lambda t: ["jobs/smoke.toml", "--set", "name='smoke"], "does not parse"),
    ("set lr list", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr=[0.1"], "does not parse"),
    # ---- paths the OS cannot take
    ("run dir hetjob", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t / "my-hetjob")], "hetjob"),
    ("run dir not UTF-8", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t) + "/r\udcff"],
     "not valid UTF-8"),
    ("run dir long component", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t / ("r" * 300))],
     "255"),
    ("-o long component", 2, lambda t: ["jobs/smoke.toml", "-o", str(t / ("o" * 300))], "255"),
    ("job file long component", 2, lambda t: [str(t / ("j" * 300)) + ".toml"], "255"),
    ("template long component", 2, lambda t: ["jobs/smoke.toml", "--template", "t" * 300], "255"),
    ("run dir too long", 2, lambda t: ["jobs/smoke.toml", "--run-dir", "/" + "/".join(["d" * 200] * 25)],
     "expected at most 4095"),
    ("entry long component", 2, lambda t: ["jobs/smoke.toml", "--set", f'train.entry="{"e" * 300}.py"'],
     "255"),
    # ---- values the nodes would fail on
    ("step schedule zero epochs", 2, lambda t: ["jobs/smoke.toml", "--set", "train.schedule=step",
                                                "--set", "train.lr_step_epochs=0"], "train.lr_step_epochs is 0"),
    ("seed too big", 2, lambda t: ["jobs/smoke.toml", "--set", "train.seed=100000000000000000000000"],
     "train.seed"),
    ("seed float", 2, lambda t: ["jobs/smoke.toml", "--set", "train.seed=1e23"], "expected an integer"),
    ("seed negative", 2, lambda t: ["jobs/smoke.toml", "--set", "train.seed=-1"], "train.seed is -1"),
    ("dist timeout huge", 2, lambda t: ["jobs/smoke.toml", "--set",
                                        "train.dist_timeout_s=100000000000000000000"], "train.dist_timeout_s"),
    ("dist timeout float", 2, lambda t: ["jobs/smoke.toml", "--set", "train.dist_timeout_s=1e20"],
     "expected an integer"),
    ("lr inf", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr=inf"], "train.lr is inf"),
    ("lr nan", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr=nan"], "train.lr is nan"),
    ("lr negative", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr=-0.1"], "train.lr is -0.1"),
    ("lr_gamma negative", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr_gamma=-5"], "train.lr_gamma"),
    ("lr_gamma zero", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr_gamma=0"], "train.lr_gamma"),
    ("weight decay inf", 2, lambda t: ["jobs/smoke.toml", "--set", "train.weight_decay=inf"],
     "train.weight_decay"),
    ("momentum negative", 2, lambda t: ["jobs/smoke.toml", "--set", "train.momentum=-1"], "train.momentum"),
    ("warmup epochs nan", 2, lambda t: ["jobs/smoke.toml", "--set", "train.warmup_epochs=nan"],
     "train.warmup_epochs"),
    ("label smoothing inf", 2, lambda t: ["jobs/smoke.toml", "--set", "train.label_smoothing=inf"],
     "train.label_smoothing"),
    ("every_minutes inf", 2, lambda t: ["jobs/smoke.toml", "--set", "checkpoint.every_minutes=inf"],
     "checkpoint.every_minutes"),
    ("unknown model", 2, lambda t: ["jobs/smoke.toml", "--set", "train.model=nosuchnet"], "train.model"),
    ("model typo", 2, lambda t: ["jobs/smoke.toml", "--set", "train.model=resnet19"], "resnet18"),
    ("model with newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'train.model="resnet18\\n"'],
     "train.model"),
    ("model plugin with space", 2, lambda t: ["jobs/smoke.toml", "--set", 'train.model="my pkg:fn"'],
     "train.model"),
    ("cifar10 data missing", 1, lambda t: ["jobs/smoke.toml", "--set", "data.dataset=cifar10",
                                           "--set", f"data.root={t / 'nodata'}"], "not ready"),
    ("data.root newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'data.root="a\\nb"'], "data.root"),
    ("dataset newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'data.dataset="a:b\\n"'],
     "data.dataset"),
    ("args newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'train.args=["a\\nb"]'], "train.args"),
    ("pretrained newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'train.pretrained="w\\n.pt"'],
     "train.pretrained"),
    # ---- sizes, bounded before anything is built from them
    ("nodes 10^30", 2, lambda t: ["jobs/smoke.toml", "--nodes", "1" + "0" * 30], "at most 100000"),
    ("tasks per node 2000", 2, lambda t: ["jobs/smoke.toml", "--tasks-per-node", "2000"],
     "slurm.tasks_per_node"),
    ("gpus per node 65", 2, lambda t: ["jobs/smoke.toml", "--gpus-per-node", "65"], "slurm.gpus_per_node"),
    ("cpus per task huge", 2, lambda t: ["jobs/smoke.toml", "--set", "slurm.cpus_per_task=100000"],
     "slurm.cpus_per_task"),
    ("world size", 2, lambda t: ["jobs/smoke.toml", "--nodes", "100000", "--tasks-per-node", "1024"],
     "ranks"),
    ("max requeues huge", 2, lambda t: ["jobs/smoke.toml", "--set", "slurm.max_requeues=100000"],
     "slurm.max_requeues"),
    ("init_keys empty", 2, lambda t: ["jobs/smoke.toml", "--set", "checkpoint.init_keys=[]"],
     "checkpoint.init_keys"),
    ("init_keys not a name", 2, lambda t: ["jobs/smoke.toml", "--set", 'checkpoint.init_keys=["../x"]'],
     "checkpoint.init_keys"),
    ("init_from with a newline", 2, lambda t: ["jobs/smoke.toml", "--set", 'checkpoint.init_from="a\\nb"'],
     "checkpoint.init_from"),
    ("batch size 2^40", 2, lambda t: ["jobs/smoke.toml", "--set", f"train.batch_size={2**40}"],
     "train.batch_size"),
    ("global batch huge", 2, lambda t: ["jobs/smoke.toml", "--set", f"train.global_batch_size={2**40}"],
     "train.global_batch_size"),
    ("epochs huge", 2, lambda t: ["jobs/smoke.toml", "--set", "train.epochs=10000000"], "train.epochs"),
    ("max steps huge", 2, lambda t: ["jobs/smoke.toml", "--set", f"train.max_steps={10**13}"],
     "train.max_steps"),
    ("num classes zero", 2, lambda t: ["jobs/smoke.toml", "--set", "train.num_classes=0"],
     "train.num_classes"),
    ("threads huge", 2, lambda t: ["jobs/smoke.toml", "--set", "train.threads=5000"], "train.threads"),
    ("synthetic huge", 2, lambda t: ["jobs/smoke.toml", "--set", "data.synthetic_train=1000000000"],
     "data.synthetic_train"),
    ("keep_last huge", 2, lambda t: ["jobs/smoke.toml", "--set", "checkpoint.keep_last=1000000"],
     "checkpoint.keep_last"),
    ("5000-digit integer in --set", 2, lambda t: ["jobs/smoke.toml", "--set", "train.max_steps=" + "9" * 5000],
     "an integer too long to read"),
    ("5000-deep list in the job file", 2, lambda t: [_job(t, SMOKE + "[user]\nx = " + "[" * 5000 + "]" * 5000 + "\n")],
     "nested too deeply"),
    ("5000-deep list in --set", 2, lambda t: ["jobs/smoke.toml", "--set", "user.x=" + "[" * 5000 + "]" * 5000],
     "nested too deeply"),
    ("container python that is an srun option", 2, lambda t: ["jobs/smoke.toml", "--set", 'slurm.container="img"',
                                                              "--set", 'slurm.container_python="--epilog=/x"'],
     "starts with '-'"),
    ("container that is an apptainer option", 2, lambda t: ["jobs/smoke.toml", "--set", 'slurm.container="--fakeroot"',
                                                            "--set", 'slurm.container_runtime="apptainer"'],
     "starts with '-'"),
    ("empty run dir", 2, lambda t: ["jobs/smoke.toml", "--run-dir", ""], "--run-dir is empty"),
    ("entry function misspelt", 1, lambda t: _entry(t, "mytrain.py", "def main():\n    pass\n", "mytrain:mian"),
     "did you mean 'main'?"),
    ("entry module missing", 1, lambda t: ["jobs/smoke.toml", "--set", 'train.entry="nosuchpkg.train:main"'],
     "module 'nosuchpkg.train' is not importable here"),
    ("entry script does not parse", 1, lambda t: _entry(t, "broken.py", "x = (", "broken.py"),
     "does not parse: '(' was never closed"),
    ("entry script with NUL bytes", 1, lambda t: _entry(t, "nul.py", "x = 1 " + chr(0), "nul.py"),
     "does not parse: source code string cannot contain null bytes. Hint"),
    ("init_from missing", 1, lambda t: ["jobs/smoke.toml", "--set", 'checkpoint.init_from="/nonexistent/run"'],
     "checkpoint.init_from '/nonexistent/run' does not exist"),
    ("too many setup lines", 2, lambda t: [_job(t, _edit("slurm", "setup = [" + ", ".join(['"true"'] * 1001) + "]"))],
     "entries"),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


def _work(tmp_path: Path) -> Path:
    """The folder ddpjob runs in: a copy of jobs/smoke.toml, nothing else."""
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    (work / "jobs" / "smoke.toml").write_text(SMOKE)
    return work


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line(case, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _, code, build, expected = case
    work = _work(tmp_path)
    monkeypatch.chdir(work)
    argv = build(tmp_path)
    out = work / "x.sbatch"
    out.write_text(OLD)
    if "-o" not in argv and "no -o" not in case[0]:
        argv += ["-o", str(out)]
    before = _snapshot(tmp_path)
    status = _ddpjob("sbatch", *argv)
    out_text, err = capfd.readouterr()
    line = _the_one_line(err, out_text, expected)
    assert status == code, line
    assert _snapshot(tmp_path) == before, "something was written or left half-written"
    assert not (work / "runs").exists() and out.read_text() == OLD
    assert not list(tmp_path.rglob("PWNED"))


def _case(name: str) -> tuple:
    return next(c for c in CASES if c[0] == name)


@pytest.mark.parametrize("name", ["unknown key", "unwritable run dir", "missing template"])
def test_debug_raises_instead_of_one_line(name: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _, code, build, expected = _case(name)
    with pytest.raises(DDPJobError, match=expected) as raised:
        _ddpjob("--debug", "sbatch", *build(tmp_path), "-o", str(tmp_path / "x.sbatch"))
    assert raised.value.exit_code == code
    assert capfd.readouterr().err == ""  # the traceback is the interpreter's to print


# ---- the three that need a real process
def test_the_console_script_exits_with_the_status_and_one_line(tmp_path: Path) -> None:
    work = _work(tmp_path)
    _, code, build, expected = _case("unknown key")
    r = subprocess.run(DDPJOB + ["sbatch", *build(tmp_path), "-o", str(work / "x.sbatch")], cwd=work,
                       capture_output=True, text=True, timeout=120)
    _the_one_line(r.stderr, r.stdout, expected)
    assert r.returncode == code == 2
    assert sorted(p.name for p in work.iterdir()) == ["jobs"]


def test_python_m_ddpjob_exits_1_for_a_runtime_error(tmp_path: Path) -> None:
    work = _work(tmp_path)
    _, code, build, expected = _case("unwritable run dir")
    r = subprocess.run([sys.executable, "-m", "ddpjob", "sbatch", *build(tmp_path), "-o", str(work / "x.sbatch")],
                       cwd=work, capture_output=True, text=True, timeout=120)
    _the_one_line(r.stderr, r.stdout, expected)
    assert r.returncode == code == 1


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    _, _, build, expected = _case("missing template")
    r = subprocess.run(DDPJOB + ["--debug", "sbatch", *build(tmp_path), "-o", str(tmp_path / "x.sbatch")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in r.stderr
    assert "Error" in r.stderr.splitlines()[-1] and expected in r.stderr.splitlines()[-1]


# ------------------------------------------------------------------ other commands
def _run_dir(tmp_path: Path, config_text: str | None = None, mode: int = 0o700, parent_mode: int = 0o700,
             **files: str) -> str:
    """A run dir made by `ddpjob sbatch`, then damaged: config.json replaced, files added, the
    folder it is in opened to `parent_mode`."""
    d = tmp_path / "run1"
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        assert _ddpjob("sbatch", str(REPO / "jobs/smoke.toml"), "--run-dir", str(d), "-o", "-") == 0, said.getvalue()
    if config_text is not None:
        (d / "config.json").write_text(config_text)
    for name, text in files.items():
        (d / name.replace("_", ".")).write_text(text)
    d.chmod(mode)
    tmp_path.chmod(parent_mode)
    return str(d)


LONG = "x" * 300
SUBMIT_SLURM = ["submit", "jobs/smoke.toml", "--backend", "slurm", "--dry-run"]
# (id, exit code, argv builder(tmp_path) -> argv after `ddpjob`, text the line must hold)
CMD_CASES = [
    ("submit local dry-run nodes 10^30", 2, lambda t: ["submit", "jobs/smoke.toml", "--backend", "local",
                                                      "--dry-run", "--nodes", "1" + "0" * 30], "slurm.nodes"),
    ("submit slurm run dir newline", 2, lambda t: [*SUBMIT_SLURM, "--run-dir",
                                                   "runs/z\\''\n#SBATCH --partition=evil #"], "newline"),
    ("submit slurm run dir backslash", 2, lambda t: [*SUBMIT_SLURM, "--run-dir", "runs/a\\b"], "backslash"),
    ("submit slurm run dir hetjob", 2, lambda t: [*SUBMIT_SLURM, "--run-dir", "runs/hetjob"], "hetjob"),
    ("submit slurm run dir percent", 2, lambda t: [*SUBMIT_SLURM, "--run-dir", "runs/100%"], "'%'"),
    ("submit slurm run dir not UTF-8", 2, lambda t: [*SUBMIT_SLURM, "--run-dir", "runs/r\udcff"], "UTF-8"),
    ("submit slurm setup directive", 2, lambda t: [*SUBMIT_SLURM, "--set",
                                                   'slurm.setup=["#SBATCH --partition=evil"]'], "starts with '#'"),
    ("submit slurm extra packjob", 2, lambda t: [*SUBMIT_SLURM, "--set",
                                                 'slurm.sbatch_extra=["--comment=packjob"]'], "hetjob"),
    ("submit slurm extra --part", 2, lambda t: [*SUBMIT_SLURM, "--set",
                                                'slurm.sbatch_extra=["--part=evil"]'], "--partition"),
    ("submit slurm name newline", 2, lambda t: [*SUBMIT_SLURM, "--name", "smoke\n"], "name"),
    ("submit sweep missing ]", 2, lambda t: [*SUBMIT_SLURM, "--sweep", "slurm.setup=[\"a\""], "does not parse"),
    ("status long component", 2, lambda t: ["status", LONG], "255"),
    ("status runs-root long component", 2, lambda t: ["status", "--runs-root", LONG], "255"),
    ("ls runs-root long component", 2, lambda t: ["ls", "--runs-root", LONG], "255"),
    ("logs long component", 2, lambda t: ["logs", LONG], "255"),
    ("cancel long component", 2, lambda t: ["cancel", LONG], "255"),
    ("run long component", 2, lambda t: ["run", LONG], "255"),
    ("plot -o long component", 2, lambda t: ["plot", "runs", "-o", LONG + ".png"], "255"),
    ("logs config.json []", 2, lambda t: ["logs", _run_dir(t, "[]")], "holds list"),
    ("logs config.json null", 2, lambda t: ["logs", _run_dir(t, "null")], "holds NoneType"),
    ("logs config.json string", 2, lambda t: ["logs", _run_dir(t, '"smoke"')], "holds str"),
    ("run config.json []", 2, lambda t: ["run", _run_dir(t, "[]")], "holds list"),
    ("run config.json null", 2, lambda t: ["run", _run_dir(t, "null")], "holds NoneType"),
    ("run config.json string", 2, lambda t: ["run", _run_dir(t, '"smoke"')], "holds str"),
    ("run config.json not JSON", 2, lambda t: ["run", _run_dir(t, "{")], "not valid JSON"),
    ("run group-writable run dir", 1, lambda t: ["run", _run_dir(t, mode=0o770)], "group/world-writable"),
    ("run world-writable run dir", 1, lambda t: ["run", _run_dir(t, mode=0o777)], "group/world-writable"),
    ("selftest size nan", 2, lambda t: ["selftest", "--size-mb", "nan"], "--size-mb is 'nan'"),
    ("selftest size inf", 2, lambda t: ["selftest", "--size-mb", "inf"], "--size-mb is 'inf'"),
    ("selftest size negative", 2, lambda t: ["selftest", "--size-mb", "-5"], "--size-mb is '-5'"),
    ("selftest size a petabyte", 2, lambda t: ["selftest", "--size-mb", "1e9"], "at most 65536"),
    ("selftest timeout negative", 2, lambda t: ["selftest", "--timeout", "-1"], "--timeout is '-1'"),
    ("plot -o empty", 2, lambda t: ["plot", "runs", "-o", ""], "-o is empty"),
    ("cancel empty", 2, lambda t: ["cancel", ""], "run directory is empty"),
    ("stop empty", 2, lambda t: ["stop", ""], "run directory is empty"),
    ("stop long component", 2, lambda t: ["stop", LONG], "255"),
    ("submit run dir below a 0777 folder", 1, lambda t: ["submit", "jobs/smoke.toml", "--backend", "local",
                                                         "--run-dir", str(_open_folder(t) / "run")],
     "which has no sticky bit (mode 0777): anyone could swap the run"),
    ("run RUN_DIR below a 0777 folder", 1, lambda t: ["run", _run_dir(t, parent_mode=0o777)],
     "which has no sticky bit (mode 0777): anyone could swap the run"),
    ("run run dir below a 0777 folder", 1, lambda t: ["run", "jobs/smoke.toml", "--run-dir", str(_open_folder(t) / "run")],
     "which has no sticky bit (mode 0777): anyone could swap the run"),
    ("stop a run never submitted", 1, lambda t: ["stop", _run_dir(t)], "has no job id"),
    ("sweep of 8 million points", 2, lambda t: ["submit", "jobs/smoke.toml", "--backend", "local", "--dry-run",
                                                *[a for k in ("train.lr", "train.seed", "train.max_steps")
                                                  for a in ("--sweep", k + "=" + ",".join(str(i + 1) for i in range(200)))]],
     "points, expected at most 1000"),  # told at the second axis (40000), before any product is built
]


def _work_without_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working folder, made the cwd, with an sbatch on PATH that fails if it is ever run
    (`--backend slurm` wants one on PATH)."""
    work = _work(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'fake sbatch must not run' >&2; exit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(work)
    return work


@pytest.mark.parametrize("case", CMD_CASES, ids=[c[0] for c in CMD_CASES])
def test_other_commands_give_one_line(case, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, code, build, expected = case
    work = _work_without_sbatch(tmp_path, monkeypatch)
    argv = build(tmp_path)
    before = _snapshot(tmp_path)
    status = _ddpjob(*argv)
    out_text, err = capfd.readouterr()
    line = _the_one_line(err, out_text, expected)
    assert status == code, line
    assert _snapshot(tmp_path) == before, "something was written"
    assert not (work / "runs").exists()


@pytest.mark.parametrize("backend", ["local", "slurm"])
@pytest.mark.parametrize("mistake", ["entry does not parse", "entry with NUL bytes", "init_from missing"])
def test_a_dry_run_runs_submits_checks_and_fails_the_same_way(mistake: str, backend: str, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit --dry-run` skipped the preflight checks and printed a script that submit then
    refused: the dry run gives submit's own line (submit's, here on the local backend)."""
    work = _work_without_sbatch(tmp_path, monkeypatch)
    argv = {"entry does not parse": _entry(tmp_path, "broken.py", "x = (", "broken.py"),
            "entry with NUL bytes": _entry(tmp_path, "nul.py", "x = 1" + chr(0), "nul.py"),
            "init_from missing": ["jobs/smoke.toml", "--set", 'checkpoint.init_from="runs/gone"']}[mistake]
    lines = []
    for extra in (["--backend", backend, "--dry-run"], ["--backend", "local"]):
        status = _ddpjob("submit", *argv, *extra)
        out_text, err = capfd.readouterr()
        lines.append(_the_one_line(err, out_text, "preflight check"))
        assert status == 1, lines[-1]
    assert lines[0] == lines[1]
    assert not (work / "runs").exists()


def _ddpjob_out(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `ddpjob ARGV` in this process."""
    capfd.readouterr()
    status = _ddpjob(*argv)
    out, err = capfd.readouterr()
    return status, out, err


def test_one_damaged_run_dir_does_not_break_ls_or_status(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    for name in ("a-good", "b-bad-job", "c-bad-events", "d-good"):
        _run_dir(tmp_path)
        (tmp_path / "run1").rename(runs / name) if runs.exists() else (
            runs.mkdir(), (tmp_path / "run1").rename(runs / name))
    (runs / "b-bad-job" / "job.json").write_text("[1, 2]")
    (runs / "c-bad-events" / "events.jsonl").write_text('[]\nnull\n"x"\n{"event": "start", "restart": "x"}\n')
    for argv in (["ls"], ["status"]):
        status, out, err = _ddpjob_out(capfd, *argv)
        assert status == 0 and err == "", err
        rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("runs/")}
        assert set(rows) == {f"runs/{n}" for n in ("a-good", "b-bad-job", "c-bad-events", "d-good")}
        assert "DAMAGED" not in rows["runs/a-good"]
    # the bad lines are skipped like a torn one, and status says which and why
    status, out, err = _ddpjob_out(capfd, "status", "runs/c-bad-events")
    assert status == 0 and err == "", err
    assert ("damaged     events.jsonl: skipped line 1 (not a record), line 2 (not a record) and 2 more"
            in out), out


@pytest.mark.parametrize("record, line, said", [
    ("metrics.jsonl", '{"kind": "train", "step": 3, "loss": 1' + "0" * 400 + ', "restart": 0, "time": 1.0}',
     "'loss' is 1000000000000000000000000000000000000000, expected a number below 2**53"),
    ("events.jsonl", '{"event": "start", "time": NaN, "restart": 0, "job_id": "local-1"}',
     "'time' is NaN, expected a finite number"),
    ("events.jsonl", '{"event": "start", "time": "soon", "restart": 0, "job_id": "local-1"}',
     "'time' is \"soon\", expected a finite number"),
    ("events.jsonl", '{"event": "stop", "time": 1, "step": Infinity, "restart": 0, "reason": "crash"}',
     "'step' is Infinity, expected an integer"),
    ("events.jsonl", '{"event": "stop", "reason": "preemption", "restart": "x"}',
     "'restart' is \"x\", expected an integer"),
])
def test_a_record_with_a_mistyped_field_is_skipped_and_named(tmp_path: Path, record: str, line: str, said: str,
                                                             capfd: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 400-digit loss, a NaN time, "time": "soon", an infinite step crashed ls, status and plot."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    _run_dir(tmp_path)
    (tmp_path / "run1").rename(runs / "bad")
    with open(runs / "bad" / record, "a") as f:
        f.write(line + "\n")
    for argv in (["ls"], ["ls", "--json"], ["status"], ["status", "runs/bad"], ["plot", "runs/bad", "-o", "p.png"]):
        status, out, err = _ddpjob_out(capfd, *argv)
        assert "Traceback" not in err and "internal error" not in err, (argv, err[-2000:])
        assert status == 0 or (argv[0] == "plot" and err.count("\n") == 1), (argv, err)
    status, out, err = _ddpjob_out(capfd, "status", "runs/bad")
    assert f"damaged     {record}: skipped line " in out and said in out, out


@pytest.mark.parametrize("damage", ["events FIFO", "metrics 2 GiB", "manifest -> /dev/zero", "job.json FIFO"])
def test_a_record_that_is_a_fifo_a_device_or_huge_is_damaged_and_nothing_hangs(
        tmp_path: Path, damage: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`status` and `ls` used to hang on a FIFO and read a 3 GB metrics.jsonl or /dev/zero whole
    (_ddpjob fails a command that does not end)."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("a-bad", "b-good"):
        _run_dir(tmp_path)
        (tmp_path / "run1").rename(runs / name)
    bad = runs / "a-bad"
    if damage == "events FIFO":
        os.mkfifo(bad / "events.jsonl")
    elif damage == "job.json FIFO":
        os.mkfifo(bad / "job.json")
    elif damage == "metrics 2 GiB":
        with open(bad / "metrics.jsonl", "wb") as f:
            f.truncate(2 << 30)  # sparse: no disk, but its size is what a reader would face
        (bad / "events.jsonl").write_text('{"event": "start", "restart": 0, "time": 1}\n')
    else:
        ck = bad / "checkpoints" / "step-000000001"
        ck.mkdir(parents=True)
        (ck / "manifest.json").symlink_to("/dev/zero")
    for argv in (["ls"], ["ls", "--json"], ["status"], ["status", "runs/a-bad"]):
        status, out, err = _ddpjob_out(capfd, *argv)
        assert status == 0 and "Traceback" not in err, (argv, err[-2000:])
        assert "runs/a-bad" in out, out
    status, out, err = _ddpjob_out(capfd, "ls")
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("runs/")}
    assert "DAMAGED" not in rows["runs/b-good"]
    if damage in ("events FIFO", "job.json FIFO"):  # what ls reads
        assert "DAMAGED" in rows["runs/a-bad"], out
    if damage == "metrics 2 GiB":  # what status of the run reads
        status, out, err = _ddpjob_out(capfd, "status", "runs/a-bad")
        assert "damaged     runs/a-bad/metrics.jsonl is 2147483648 bytes" in out, out
