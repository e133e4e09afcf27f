"""render.py: golden scripts, `bash -n`, hostile strings that reach srun byte-for-byte or are
refused, and a batch shell that outlives SIGTERM while the ranks checkpoint.

Regenerate the golden files after an intended template change with
`DDPJOB_REGEN_GOLDEN=1 .venv/bin/pytest tests/unit/test_render.py` and review the diff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpjob import __version__, config, jobfile
from ddpjob.errors import UsageError
from ddpjob.launch import render
from ddpjob.launch import slurmopts

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.toml"))
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RUN_DIR = Path("/scratch/runs/example")
PYTHON = "/opt/venv/bin/python"
BASH = shutil.which("bash") or "/bin/bash"

# A fake srun: records its argv (NUL-separated, so any byte survives) and DDPJOB_RUN_DIR.
# One record per step: FAKE_SRUN_LOG.warm for the warm-start server's (`srun --overlap ...`, in
# the background), FAKE_SRUN_LOG.ranks for the ranks'; each with its .env (the run dir it saw).
# The ranks' call ends only once the server's has written its record: the batch shell kills the
# server's step as it ends, which could otherwise come before a busy machine ran its first line.
FAKE_SRUN = r"""#!/bin/bash
case "$1" in --overlap) out="$FAKE_SRUN_LOG.warm" ;; *) out="$FAKE_SRUN_LOG.ranks" ;; esac
printf '%s' "$DDPJOB_RUN_DIR" > "$out.env"
printf '%s\0' "$@" > "$out.tmp" && mv "$out.tmp" "$out"
if [ "$out" = "$FAKE_SRUN_LOG.ranks" ] && [[ " $* " == *" ddpjob.node.warm "* ]]; then
    for _ in $(seq 1200); do [ -e "$FAKE_SRUN_LOG.warm" ] && break; sleep 0.05; done
fi
exit "${FAKE_SRUN_EXIT:-0}"
"""


def _job(name: str) -> config.JobConfig:
    return jobfile.resolve(REPO / "jobs" / f"{name}.toml")


def _with_slurm(cfg: config.JobConfig, **changes) -> config.JobConfig:
    return dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, **changes))


def _stable(text: str) -> str:
    """The rendered text minus what changes whenever anyone adds a config key or bumps the
    version (checked on their own in test_header_names_the_config)."""
    text = re.sub(r"sha256:[0-9a-f]{16}", "sha256:<config.json digest>", text)
    text = re.sub(r"resume hash [0-9a-f]{16}", "resume hash <hash>", text)
    return text.replace(f"ddpjob {__version__}:", "ddpjob <version>:")


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_golden_script(job: Path) -> None:
    text = _stable(render.render_sbatch(jobfile.resolve(job), run_dir=RUN_DIR, python=PYTHON))
    golden = GOLDEN / f"{job.stem}.sbatch"
    if os.environ.get("DDPJOB_REGEN_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert golden.is_file(), f"no golden file {golden}; run with DDPJOB_REGEN_GOLDEN=1"
    assert text == golden.read_text(encoding="utf-8"), \
        f"{job.name} renders differently from {golden}; if intended, regenerate (see docstring)"


def test_header_names_the_config() -> None:
    cfg = _job("cifar10_resnet18")
    text = render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON)
    digest = hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16]
    assert f"# config: sha256:{digest} " in text and f"resume hash {cfg.hash()}\n" in text
    assert text.startswith(f"#!/bin/bash\n# ddpjob {__version__}: job cifar10-resnet18, 1 node(s) "
                           "x 4 task(s) = 4 ranks\n")


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_every_script_passes_bash_n(job: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(render.render_sbatch(jobfile.resolve(job), run_dir=RUN_DIR, python=PYTHON))
    r = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_directives_follow_the_job_file() -> None:
    text = render.render_sbatch(_job("cifar10_resnet50"), run_dir=RUN_DIR, python=PYTHON)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=cifar10-resnet50", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8", "#SBATCH --mem=128G",
        "#SBATCH --time=08:00:00", "#SBATCH --requeue", "#SBATCH --open-mode=append",
        "#SBATCH --signal=USR2@180",
        "#SBATCH --output=/scratch/runs/example/logs/batch-%j.out",
        "#SBATCH --error=/scratch/runs/example/logs/batch-%j.out",
    ]
    # sbatch stops reading #SBATCH at the first command: all of them come before it.
    first_command = next(i for i, line in enumerate(text.splitlines()[1:], 1)
                         if line.strip() and not line.startswith("#"))
    last_directive = max(i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    assert last_directive < first_command


def test_cpu_job_has_no_gpu_line_and_requeue_can_be_off() -> None:
    cfg = _with_slurm(_job("smoke"), requeue=False, signal="sigusr1", partition="low",
                      sbatch_extra=("--exclusive", "--comment=two words \"q\" #x"))
    cfg = jobfile.from_dict(cfg.to_dict())  # as a job file gives it: the signal's name made canonical
    assert cfg.slurm.signal == "USR1"
    text = render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON)
    assert "--gpus-per-node" not in text
    assert "#SBATCH --no-requeue" in text and "#SBATCH --requeue" not in text
    assert "#SBATCH --signal=USR1@60" in text and "#SBATCH --partition=low" in text
    # sbatch's own quoting: the value stays one argument, '#' is not a comment inside quotes.
    assert '#SBATCH --exclusive\n#SBATCH "--comment=two words \\"q\\" #x"' in text


def test_setup_lines_are_verbatim_and_extra_env_is_quoted(tmp_path: Path) -> None:
    cfg = _with_slurm(_job("smoke"), setup=("module load cuda/12.4  # why not", 'echo "$HOME"'))
    text = render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON,
                                extra_env={"NCCL_DEBUG": "INFO", "ODD": "a'b $(x) `y`"})
    assert "\nmodule load cuda/12.4  # why not\necho \"$HOME\"\n" in text
    assert "export NCCL_DEBUG=INFO\nexport ODD='a'\"'\"'b $(x) `y`'\n" in text
    with pytest.raises(UsageError, match="not a shell name"):
        render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON, extra_env={"A;B": "1"})


def test_percent_in_run_dir_is_escaped_for_slurm_patterns() -> None:
    text = render.render_sbatch(_job("smoke"), run_dir=Path("/r/100%j"), python=PYTHON)
    assert "#SBATCH --output=/r/100%%j/logs/batch-%j.out" in text
    assert "--output=/r/100%%j/logs/rank-%t.log" in text
    assert "export DDPJOB_RUN_DIR=/r/100%j\n" in text  # the shell sees the real path


# Strings that must reach the job unchanged: spaces, both quotes, $(...), backticks, ;, &, |,
# %j, a leading '-' in a path component, '#', '*', glob and tilde characters, non-ASCII.
HOSTILE = [
    "run dir with spaces",
    "it's \"quoted\"",
    "$(touch PWNED)",
    "`touch PWNED`",
    "a;touch PWNED;b",
    "x && touch PWNED || y | z",
    "%j %t %% 100%",
    "-rf --output=evil",
    "#not-a-comment * ? [a] ~root {a,b}",
    "ünïcødé ✓",
    "${IFS}$HOME$(id)",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_paths_reach_srun_byte_for_byte(name: str, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    run_dir = tmp_path / name / "run"
    python = str(tmp_path / name / "py thon")
    script = tmp_path / "job.sbatch"
    script.write_text(render.render_sbatch(_job("smoke"), run_dir=run_dir, python=python))
    (run_dir / "logs").mkdir(parents=True)  # as `ddpjob sbatch` leaves it
    assert subprocess.run([BASH, "-n", str(script)]).returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "argv"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_SRUN_LOG": str(log), "HOME": str(tmp_path)}
    r = subprocess.run([BASH, str(script)], cwd=work, env=env, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # 2 ranks a node: the warm-start server's step and the ranks'
    calls = {k: Path(f"{log}.{k}").read_bytes().split(b"\0")[:-1] for k in ("warm", "ranks")}
    escaped = str(run_dir).replace("%", "%%")
    assert calls["ranks"] == [b"--nodes=1", b"--ntasks=2", b"--kill-on-bad-exit=1", b"--unbuffered",
                                f"--output={escaped}/logs/rank-%t.log".encode(), b"--open-mode=append",
                                python.encode(), b"-u", b"-m", b"ddpjob.node.warm",
                                b"run", b"-m", b"ddpjob", b"run", str(run_dir).encode()]
    assert calls["warm"][0] == b"--overlap"
    assert calls["warm"][-5:] == [python.encode(), b"-u", b"-m", b"ddpjob.node.warm", b"serve"]
    assert (run_dir / "logs" / "warm-.log").is_file()  # its output went to RUN_DIR/logs (no job id here)
    assert all(Path(f"{log}.{k}.env").read_bytes() == str(run_dir).encode() for k in calls)
    pwned = [p for p in tmp_path.rglob("PWNED")] + [p for p in Path.cwd().glob("PWNED")]
    assert not pwned, "an injected command ran"


@pytest.mark.parametrize("run_dir, why", [
    ("/tmp/a\nb", "newline"),
    ("/tmp/a\rb", "control character"),
    ("/tmp/a\x00b", "control character"),
    ("/tmp/a\\b", "backslash"),
    ("/tmp/my-HETJOB-runs", "hetjob"),
    ("relative/dir", "relative"),
    ("-rf", "relative"),
])
def test_run_dirs_that_cannot_reach_the_job_are_refused(run_dir: str, why: str) -> None:
    with pytest.raises(UsageError, match=why) as exc:
        render.render_sbatch(_job("smoke"), run_dir=Path(run_dir), python=PYTHON)
    assert "\n" not in exc.value.line() and "Hint:" in exc.value.line()


@pytest.mark.parametrize("python", ["", "-c", "/usr/bin/py\nthon"])
def test_bad_python_is_refused(python: str) -> None:
    with pytest.raises(UsageError, match="python interpreter"):
        render.render_sbatch(_job("smoke"), run_dir=RUN_DIR, python=python)


def test_renderer_refuses_what_validation_would(tmp_path: Path) -> None:
    # Frozen dataclasses can be built without config.validate: the renderer checks again.
    cfg = _with_slurm(_job("smoke"), setup=("echo ok", "echo a\necho b"))
    with pytest.raises(UsageError, match="slurm.setup"):
        render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON)
    cfg = _with_slurm(_job("smoke"), sbatch_extra=("--comment=a\nb",))
    with pytest.raises(UsageError, match="newline"):
        render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON)


def test_the_job_strings_are_checked_once_along_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ddpjob resume` of a `ddpjob sbatch` run reads config.json (validated) and renders the
    template again: the strings that reach the script are checked at the load, not again by the
    renderer (validate.job_strings, one rule at one place); an unvalidated config still is."""
    from ddpjob import scriptsafe, validate

    seen: list[str] = []
    real = scriptsafe.sbatch_extra

    def counted(arg: str) -> str:
        seen.append(arg)
        return real(arg)

    monkeypatch.setattr(scriptsafe, "sbatch_extra", counted)
    validate._script_strings.cache_clear()
    cfg = jobfile.resolve(REPO / "jobs" / "smoke.toml", ["slurm.sbatch_extra=[\"--comment=once\"]"])
    render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON)
    slurmopts.sbatch_options(cfg)
    assert seen == ["--comment=once"]
    render.render_sbatch(_with_slurm(cfg, sbatch_extra=("--comment=other",)), run_dir=RUN_DIR, python=PYTHON)
    assert seen == ["--comment=once", "--comment=other"]


def test_user_template_and_unknown_placeholder() -> None:
    text = render.render_sbatch(_job("smoke"), run_dir=RUN_DIR, python=PYTHON,
                                template="#!/bin/bash\n${sbatch_directives}\necho ${UPPER} $$ $x\n"
                                         "srun ${python} -m ddpjob run ${run_dir}\n")
    assert text.endswith("echo ${UPPER} $$ $x\nsrun /opt/venv/bin/python -m ddpjob run "
                         "/scratch/runs/example\n")
    with pytest.raises(UsageError, match=r"unknown placeholder \$\{rundir\}.*run_dir"):
        render.render_sbatch(_job("smoke"), run_dir=RUN_DIR, python=PYTHON,
                             template="srun ${python} ${rundir}\n")


def test_load_template(tmp_path: Path) -> None:
    assert render.load_template(None) == (REPO / "templates" / "sbatch.sh.tmpl").read_text()
    mine = tmp_path / "mine.tmpl"
    mine.write_text("#!/bin/bash\n")
    assert render.load_template(mine) == "#!/bin/bash\n"
    with pytest.raises(UsageError, match="not found"):
        render.load_template(tmp_path / "missing.tmpl")
    with pytest.raises(UsageError, match="is a directory"):
        render.load_template(tmp_path)
    (tmp_path / "bin.tmpl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UsageError, match="not UTF-8"):
        render.load_template(tmp_path / "bin.tmpl")
    os.mkfifo(tmp_path / "fifo.tmpl")  # without a writer: an open() for reading would block
    with pytest.raises(UsageError, match="is a FIFO, expected a text file"):
        render.load_template(tmp_path / "fifo.tmpl")
    with open(tmp_path / "big.tmpl", "wb") as f:
        f.truncate(render.TEMPLATE_LIMIT + 1)
    with pytest.raises(UsageError, match="is too large"):
        render.load_template(tmp_path / "big.tmpl")


def _start_batch(tmp_path: Path, fake_srun: str, **slurm) -> tuple[subprocess.Popen, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(fake_srun)
    (bin_dir / "srun").chmod(0o755)
    script = tmp_path / "job.sbatch"
    cfg = _with_slurm(_job("smoke"), **slurm)
    script.write_text(render.render_sbatch(cfg, run_dir=tmp_path / "run", python=sys.executable))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "T": str(tmp_path)}
    proc = subprocess.Popen([BASH, str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "err", "w"), text=True)
    _wait_for(lambda: (tmp_path / "started").exists(), proc)
    return proc, tmp_path


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"batch shell ended early: {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# A fake srun standing in for ranks that checkpoint on a signal: it records the signals it
# gets and exits with status 7 once the test creates $T/release. The warm-start server's step
# (jobs/smoke.toml runs 2 ranks a node) only waits to be killed, as the batch shell does at its end.
SLOW_SRUN = r"""#!/bin/bash
[ "$1" != --overlap ] || exec sleep 600
trap 'echo USR2 >> "$T/srun-signals"' USR2
trap 'echo TERM >> "$T/srun-signals"' TERM
touch "$T/started"
while [ ! -e "$T/release" ]; do sleep 0.05; done
exit 7
"""


def _noted(t: Path) -> int:
    return (t / "err").read_text().count("batch shell got SIGTERM")


def test_batch_shell_survives_sigterm_until_srun_exits(tmp_path: Path) -> None:
    proc, t = _start_batch(tmp_path, SLOW_SRUN)
    proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: _noted(t) == 1, proc)  # fails if the shell dies of it
    time.sleep(0.3)
    assert proc.poll() is None, "the batch shell died of SIGTERM while the ranks were running"
    proc.send_signal(signal.SIGTERM)  # a second one (scancel, then the time limit) as well
    _wait_for(lambda: _noted(t) == 2, proc)
    (t / "release").touch()
    proc.wait(timeout=30)
    assert proc.returncode == 7, (t / "err").read_text()  # srun's status, not 128+15
    assert "srun exited with status 7" in (t / "err").read_text()
    assert not (t / "srun-signals").exists(), "TERM must not be forwarded to srun"


def test_batch_shell_forwards_the_job_signal_to_srun(tmp_path: Path) -> None:
    proc, t = _start_batch(tmp_path, SLOW_SRUN)
    proc.send_signal(signal.SIGUSR2)  # scancel --batch --signal=USR2
    _wait_for(lambda: (t / "srun-signals").exists(), proc)
    assert (t / "srun-signals").read_text() == "USR2\n"
    (t / "release").touch()
    proc.wait(timeout=30)
    assert proc.returncode == 7


def test_job_signal_term_is_not_forwarded(tmp_path: Path) -> None:
    proc, t = _start_batch(tmp_path, SLOW_SRUN, signal="TERM")
    proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: _noted(t) == 1, proc)
    time.sleep(0.3)  # a forwarded TERM would have reached srun's trap by now
    (t / "release").touch()
    proc.wait(timeout=30)
    assert proc.returncode == 7
    assert not (t / "srun-signals").exists()


CONTAINERS = {
    "pyxis": dict(container="nvcr.io#nvidia/pytorch:24.01-py3", container_runtime="pyxis",
                  container_python="python3", container_mounts=("/scratch/data:/data",)),
    "apptainer": dict(container="/images/torch.sif", container_runtime="apptainer",
                      container_mounts=("/scratch/cache",)),
}


@pytest.mark.parametrize("runtime", sorted(CONTAINERS))
def test_golden_container_script(runtime: str) -> None:
    """[slurm] container: pyxis puts the image on srun's line, apptainer wraps the interpreter;
    the run dir, ddpjob's source and the data are mounted at their own paths."""
    cfg = _with_slurm(_job("smoke"), **CONTAINERS[runtime])
    text = _stable(render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON))
    text = text.replace(str(REPO), "<ddpjob source>").replace(sys.prefix, "<prefix>")
    golden = GOLDEN / f"smoke-{runtime}.sbatch"
    if os.environ.get("DDPJOB_REGEN_GOLDEN"):
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8"), f"regenerate {golden} if intended"
    assert subprocess.run([BASH, "-n"], input=text, text=True).returncode == 0
    # the plain job without its warm-start server (a container has none: slurmopts.warm_start)
    plain = _stable(render.render_sbatch(_with_slurm(_job("smoke"), warm_start=False), run_dir=RUN_DIR, python=PYTHON))
    changed = [ln for ln in text.splitlines() if ln not in plain.splitlines()]
    assert changed and all(ln.lstrip().startswith("ddpjob_srun ") or "-m ddpjob run" in ln for ln in changed), \
        changed  # only the srun command differs


def test_golden_warm_start_script() -> None:
    """A job on CPUs that may restart ([slurm] max_failures) or runs several ranks per node: the
    batch shell starts one warm-start server per node (its own --overlap step, its output in
    RUN_DIR/logs) and the ranks' srun runs them through it; nothing else changes. One rank per
    node that never restarts, GPUs, a container or warm_start = false: as before."""
    cfg = _with_slurm(_job("smoke"), max_failures=2)
    text = _stable(render.render_sbatch(cfg, run_dir=RUN_DIR, python=PYTHON))
    golden = GOLDEN / "smoke-warm.sbatch"
    if os.environ.get("DDPJOB_REGEN_GOLDEN"):
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8"), f"regenerate {golden} if intended"
    assert subprocess.run([BASH, "-n"], input=text, text=True).returncode == 0
    plain = _stable(render.render_sbatch(_with_slurm(_job("smoke"), max_failures=2, warm_start=False),
                                         run_dir=RUN_DIR, python=PYTHON))
    changed = [ln.strip() for ln in text.splitlines() if ln not in plain.splitlines()]
    assert changed[0] == "export DDPJOB_WARM=1" and changed[2] == "DDPJOB_WARM_PID=$!", changed
    assert changed[1].startswith("srun --overlap --no-kill ") and \
        changed[1].endswith(' -u -m ddpjob.node.warm serve >>"$DDPJOB_RUN_DIR"/logs/warm-"$SLURM_JOB_ID".log 2>&1 &')
    assert len(changed) == 4 and changed[3].endswith("-u -m ddpjob.node.warm run -m ddpjob run /scratch/runs/example"), changed

    def warm(**slurm: object) -> bool:
        return "ddpjob.node.warm" in render.render_sbatch(_with_slurm(_job("smoke"), **slurm),
                                                           run_dir=RUN_DIR, python=PYTHON)

    assert _job("smoke").slurm.tasks_per_node == 2 and warm(max_failures=0)  # 2 ranks a node
    assert warm(max_failures=2, tasks_per_node=1) and not warm(max_failures=0, tasks_per_node=1)
    # the local backend runs every rank on one host: the run's world size decides there
    one = _with_slurm(_job("smoke"), max_failures=0, tasks_per_node=1)
    assert not slurmopts.warm_start(one, ranks_per_host=1) and slurmopts.warm_start(one, ranks_per_host=2)
    for off in (dict(gpus_per_node=1), dict(warm_start=False), CONTAINERS["apptainer"]):
        other = _stable(render.render_sbatch(_with_slurm(_job("smoke"), max_failures=2, **off),
                                             run_dir=RUN_DIR, python=PYTHON))
        assert "ddpjob.node.warm" not in other and "# (off)" in other, off


@pytest.mark.parametrize("changes, found", [
    (dict(container="img", container_runtime="docker"), "slurm.container_runtime is 'docker'"),
    (dict(container="my image.sif"), "has a space or a comma"),
    (dict(container="img", container_mounts=("relative/x",)), "container_mounts entry"),
    (dict(container="img", container_mounts=("/a:/b:/c",)), "container_mounts entry"),
])
def test_container_settings_are_validated(changes: dict, found: str) -> None:
    from ddpjob import validate

    with pytest.raises(UsageError, match=re.escape(found)):
        validate.validate(_with_slurm(_job("smoke"), **changes))
