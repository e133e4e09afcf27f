"""`ddpjob submit JOB.toml`: resolved config -> run dir(s) -> submitit on SLURM, or local processes.

Login-node side, after config.py: writes RUN_DIR/config.json once, then hands the run dir to
the scheduler: a submitit SlurmExecutor job (a job array for a sweep) whose callable is
`NodeTask(run_dir)`, or the detached local supervisor (ddpjob/launch/local.py). Writes job.json and
job.sbatch; status/logs/cancel (control.py) read them back.

Requeue contract on SLURM. `NodeTask` is stateless (a run dir path): every incarnation resumes
from the newest checkpoint in the run dir, so submitit may pickle it once and rerun it (a
successor job gets a copy of the pickle under its own id). On the node,
`ddpjob.rank.runner.run_node` replaces submitit's USR2/TERM handlers with flag-only ones; on a
stop rank 0's Job decides and does the requeue (node/requeue.py, the one decision, preemption
within GraceTime included), and the task returns 3; `NodeTask` then ends with SystemExit(3) and
no result pickle, as submitit's own handler does after requeueing, so a submitit Job waits for
the next incarnation. 0 returns 0; a crash goes to requeue.after_crash on rank 0 (max_failures),
else raises, so submitit records the failure and the job ends FAILED. Should a signal reach
submitit's handler before ours is installed, `checkpoint()` hands submitit the same task.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import itertools
import math
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from ddpjob import config, console, exitcodes, rundir, runlock, scriptsafe
from ddpjob.rank import entry
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError, UsageError
from ddpjob import freeze, slurm
from ddpjob.launch import container, entrycheck, local

MAX_POINTS = 1000  # SLURM's default MaxArraySize is 1001
COMPLETING_WAIT_S, POLL_S = 60.0, 1.0  # resume after a cancel: how long a COMPLETING job is awaited
sleep = time.sleep  # tests skip the pauses


# ------------------------------------------------------------------ node side
class NodeTask:
    """The callable submitit pickles and runs once per task (= rank) and per incarnation."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = str(run_dir)

    def __call__(self) -> int:
        from ddpjob.rank.runner import run_node  # imported on the node: torch stays off the login node

        code = int(run_node(self.run_dir))
        if code == 0:
            return 0
        if code == exitcodes.REQUEUE:
            # rank 0's Job decided and did the requeue (node/requeue.py): nothing to decide here
            raise SystemExit(exitcodes.REQUEUE)  # checkpoint written, requeue asked: no result pickle
        retried = self._retried_after_crash(code)
        # A rank that failed alone may have left its process group standing, whose teardown can
        # abort (node/dist.py). submitit must still write its result pickle and re-raise first:
        # atexit runs after that, with the status the process ends with (1 for the exception).
        from ddpjob.node import dist

        atexit.register(dist.end_if_left_standing, code if retried else 1)
        if retried:
            raise SystemExit(code)  # brought back from the newest checkpoint: no result pickle
        raise RuntimeError(f"ddpjob run {self.run_dir} exited with {code}; see the rank logs "
                           f"(`ddpjob logs {self.run_dir} --rank R`)")

    def _retried_after_crash(self, code: int) -> bool:
        """Rank 0 hands a crash to requeue.py's one decision (max_failures); the batch script's
        equivalent for `ddpjob sbatch` jobs is in templates/sbatch.sh.tmpl."""
        from ddpjob.rank import requeue
        from ddpjob.node.cluster import ClusterEnv

        env = ClusterEnv.from_environ()
        if not env.is_rank0 or env.source != "slurm":
            return False
        return bool(requeue.after_crash(config.read_run_config(self.run_dir), env,
                                        Path(self.run_dir), code))

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"NodeTask({self.run_dir!r})"


# ------------------------------------------------------------------ sweeps
@dataclass(frozen=True)
class SweepPoint:
    index: int
    values: dict[str, Any]  # "train.lr" -> 0.1 (typed like --set)
    overrides: tuple[str, ...]  # ("train.lr=0.1", ...)

    @property
    def id(self) -> str:  # the point's folder name, = its SLURM array index
        return str(self.index)


def split_values(text: str) -> list[str]:
    """`0.1,0.05` -> ['0.1', '0.05']; commas inside [...] or quotes do not split."""
    items, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
            continue
        cur += ch
    items.append(cur.strip())
    return items


def expand_sweep(specs: list[str]) -> list[SweepPoint]:
    """The cartesian product of `--sweep KEY=V1,V2` axes, first axis varying slowest
    ([] without axes: not a sweep)."""
    if not specs:
        return []
    axes: list[tuple[str, list[tuple[str, Any]]]] = []
    for spec in specs:
        if "=" not in spec:
            raise UsageError(f"--sweep '{spec}' has no '=', expected section.key=v1,v2",
                             "e.g. --sweep train.lr=0.1,0.05")
        key, text = (s.strip() for s in spec.split("=", 1))
        values = split_values(text)
        if not text.strip() or any(v == "" for v in values):
            raise UsageError(f"--sweep '{spec}' has an empty value, expected v1,v2,...",
                             "e.g. --sweep train.lr=0.1,0.05")
        if key in [k for k, _ in axes]:
            raise UsageError(f"--sweep key '{key}' is given twice", "list all its values in one --sweep")
        axes.append((key, [(v, config.parse_override(f"{key}={v}")[1]) for v in values]))
        count = math.prod(len(vals) for _, vals in axes)  # before the product is built, not after
        if count > MAX_POINTS:
            raise UsageError(f"the sweep has {count} points, expected at most {MAX_POINTS}",
                             "split it into several sweeps (SLURM limits job arrays)")
    points = []
    for i, combo in enumerate(itertools.product(*[vals for _, vals in axes])):
        keys = [k for k, _ in axes]
        points.append(SweepPoint(i, {k: typed for k, (_, typed) in zip(keys, combo)},
                                 tuple(f"{k}={raw}" for k, (raw, _) in zip(keys, combo))))
    if len(points) > MAX_POINTS:
        raise UsageError(f"the sweep has {len(points)} points, expected at most {MAX_POINTS}",
                         "split it into several sweeps (SLURM limits job arrays)")
    return points


# ------------------------------------------------------------------ SLURM via submitit
def slurm_parameters(cfg: JobConfig, folder: Path | None = None, *,
                     run_dirs: Sequence[Path] = ()) -> dict[str, Any]:
    """SlurmExecutor.update_parameters(...) for a job: the pure mapping from [slurm].

    `folder` is submitit's log (and pickle) folder, RUN_DIR/logs (a sweep's: SWEEP/logs): given,
    the script first refuses to start if it or the run dir is writable by others, and puts the
    run dir's frozen code first on PYTHONPATH (see _guard_lines); `run_dirs` are the runs the
    script serves (default: folder's parent; a sweep's points: one job array)."""
    s = cfg.slurm
    scriptsafe.job_strings(cfg)  # the same checks as the template path (render.py)
    secs = config.parse_time_s(s.time)
    params: dict[str, Any] = {
        "job_name": cfg.name, "nodes": s.nodes, "ntasks_per_node": s.tasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        # submitit wants whole minutes (it also times its own timeout logic with them); the
        # exact limit still reaches sbatch through additional_parameters below.
        "time": max(1, math.ceil(secs / 60)),
        "signal_delay_s": s.signal_lead_s,
        # As in the template: one failed rank ends the step instead of leaving the others
        # hanging in a collective until the time limit.
        "srun_args": ["--kill-on-bad-exit=1"],
    }
    if folder is not None:  # [slurm] container, pyxis: srun's options (apptainer: see _python)
        params["srun_args"] += container.srun_options(cfg, str(folder.parent), sys.executable)
    # submitit writes setup lines right after the #SBATCH block, where sbatch still reads
    # directives: the guard's first line is a command, which ends that scan (and the
    # scriptsafe checks refuse setup lines starting with '#' anyway).
    params["setup"] = [*_guard_lines(cfg, folder, run_dirs), *scriptsafe.setup_lines(s.setup)]
    if s.gpus_per_node > 0:
        params["gpus_per_node"] = s.gpus_per_node
    for key in ("mem", "partition", "account", "qos", "constraint"):
        if getattr(s, key):
            params[key] = getattr(s, key)
    extra: dict[str, Any] = {"time": s.time, "open-mode": "append"}
    extra["requeue" if s.requeue else "no-requeue"] = True
    if s.signal != "USR2":  # submitit writes USR2@delay; any other signal replaces that line
        extra["signal"] = f"{s.signal}@{s.signal_lead_s}"
    for arg in s.sbatch_extra:  # "--exclusive", "--mail-type=END"
        key, value = scriptsafe.split_extra(arg)
        extra[key] = True if value is None else value
    params["additional_parameters"] = extra
    return params


def _guard_lines(cfg: JobConfig, folder: Path | None, run_dirs: Sequence[Path] = ()) -> list[str]:
    """Shell lines that open submitit's script body (before srun).

    Why the permission guard: submitit unpickles RUN_DIR/logs/*_submitted.pkl at every start,
    so whoever can write that folder runs code as the job's user. Run dirs are created 0700
    (0750 with slurm.share_group); this refuses a folder someone loosened since, before the
    pickle is read. Why the trap: SLURM sends SIGTERM to the batch shell too (scancel, time
    limit, preemption); without a trap bash dies at once and the job ends while the ranks are
    still writing their checkpoint. Trapped, bash waits for srun (the template does the same).
    Why the task count: submitit's bare `srun` takes it from SLURM_NTASKS, which after an elastic
    shrink of the pending job (scontrol update NumNodes=1 ...) still holds the submission's count;
    recompute it from the allocation, as the template's --ntasks does. Why the array index: each
    of a sweep's points froze its code into its own run dir, SWEEP/<array index> (SweepPoint.id),
    and its job array has one script for them all."""
    s = cfg.slurm
    lines = ["trap 'echo \"ddpjob: batch shell got a stop signal; waiting for the ranks\" >&2' "
             "TERM INT HUP",
             f"DDPJOB_NTASKS=$(( ${{SLURM_JOB_NUM_NODES:-{int(s.nodes)}}} * {int(s.tasks_per_node)} ))",
             "export SLURM_NTASKS=$DDPJOB_NTASKS SLURM_NPROCS=$DDPJOB_NTASKS"]
    if folder is not None:  # the code frozen at submission comes first (launch/freeze.py)
        if len(run_dirs) > 1:  # SLURM sets the index: digits only, quoted all the same
            point = freeze.python_path(Path("POINT")).relative_to("POINT")
            code = f"{shlex.quote(str(folder.parent))}/\"$SLURM_ARRAY_TASK_ID\"/{shlex.quote(str(point))}"
        else:
            code = shlex.quote(str(freeze.python_path(run_dirs[0] if run_dirs else folder.parent)))
        lines.append(f"export PYTHONPATH={code}${{PYTHONPATH:+:$PYTHONPATH}} PYTHONSAFEPATH=1")
    if folder is not None:
        dirs = " ".join(shlex.quote(str(d)) for d in (folder.parent, folder))
        lines.append(f"for DDPJOB_D in {dirs}; do if [ -n \"$(find \"$DDPJOB_D\" -maxdepth 0 "
                     "\\( -perm /022 -o ! -user \"$(id -u)\" \\) 2>/dev/null)\" ]; then echo "
                     "\"ddpjob: $DDPJOB_D is writable by others or not owned by $(id -un): refusing "
                     "to unpickle the job from it (chmod go-w it, then resubmit)\" >&2; exit 1; fi; "
                     "done")
        # the pickles too: a group-writable one in a 0750 folder is still code others wrote
        logs = shlex.quote(str(folder))
        lines.append(f"for DDPJOB_F in {logs}/*.pkl; do if [ -e \"$DDPJOB_F\" ] && [ -n \"$(find "
                     "\"$DDPJOB_F\" -maxdepth 0 \\( -perm /022 -o ! -user \"$(id -u)\" \\) 2>/dev/null)\" ]; "
                     "then echo \"ddpjob: $DDPJOB_F is writable by others or not owned by $(id -un): refusing "
                     "to unpickle it (resubmit)\" >&2; exit 1; fi; done")
    return lines


def _python(cfg: JobConfig, folder: Path) -> str:
    """The interpreter command submitit runs under srun: inside `apptainer exec ...` with
    [slurm] container (submitit's `python` parameter exists for exactly this)."""
    words = [*container.exec_prefix(cfg, str(folder.parent), sys.executable),
             container.interpreter(cfg, sys.executable)]
    return " ".join(shlex.quote(w) for w in words)


def submitit_command(cfg: JobConfig, folder: Path) -> str:
    """What submitit runs under srun (SlurmExecutor._submitit_command_str)."""
    return f"{_python(cfg, folder)} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def sbatch_text(cfg: JobConfig, folder: Path, run_dirs: Sequence[Path] = ()) -> str:
    """The script submitit would submit, without submitting (for --dry-run)."""
    from submitit.slurm.slurm import _make_sbatch_string

    scriptsafe.run_dir(str(folder), submitit=True)
    return _make_sbatch_string(command=submitit_command(cfg, folder), folder=folder,
                               map_count=len(run_dirs) if len(run_dirs) > 1 else None,
                               **slurm_parameters(cfg, folder, run_dirs=run_dirs))


def preflight_slurm(cfg: JobConfig) -> None:
    """Fail in one line before anything is written: no sbatch/srun, unknown partition."""
    for tool in ("sbatch", "srun"):
        if shutil.which(tool) is None:
            raise DDPJobError(f"--backend slurm needs `{tool}`, which is not on PATH",
                              "run on a SLURM login node, or use --backend local")
    parts = slurm.partitions()
    if isinstance(parts, slurm.Failed):
        raise DDPJobError(f"sinfo did not answer ({parts.why}), expected the partition list",
                          "is the SLURM controller up? try `sinfo`")
    if cfg.slurm.partition and cfg.slurm.partition not in parts:
        raise DDPJobError(f"partition '{cfg.slurm.partition}' does not exist on this cluster "
                          f"(sinfo lists: {', '.join(parts) or 'none'})",
                          "set slurm.partition (or --partition) to one of them")


def _doctor_checks(cfgs: list[JobConfig], backend: str, root: Path) -> None:
    """`ddpjob doctor`'s cheap checks (partition limits, GPUs vs tasks, signal routing, dataset,
    port window): a job that would fail on the nodes fails here, in one line, before anything
    is written. Warnings are printed and do not stop the submission."""
    from ddpjob.launch import doctor

    for cfg in cfgs:
        # the run dir itself is checked (with a more precise message) when it is created
        checks = [c for c in doctor.cheap_checks(cfg, backend=backend, runs_root=root.parent)
                  if c.name != "run dir"]
        doctor.raise_on_failures(checks)
    for c in checks:
        if c.status == doctor.WARN:
            console.warn(f"preflight '{c.name}': {c.detail}" + (f" (hint: {c.hint})" if c.hint else ""))


def submit_slurm(cfgs: list[JobConfig], run_dirs: list[Path], log_folder: Path,
                 command: list[str]) -> list[dict[str, Any]]:
    """One job, or one job array for a sweep. Returns the job.json records (one per run dir)."""
    import submitit
    from submitit.core.utils import FailedJobError

    cfg = cfgs[0]  # resources are the same for every point; a sweep varies the training
    ex = submitit.SlurmExecutor(folder=log_folder, max_num_timeout=cfg.slurm.max_requeues,
                                python=_python(cfg, log_folder))
    scriptsafe.run_dir(str(log_folder), submitit=True)
    ex.update_parameters(**slurm_parameters(cfg, log_folder, run_dirs=run_dirs))
    try:
        # submitit echoes sbatch's stderr on failure; we report it in our one line instead.
        with contextlib.redirect_stderr(io.StringIO()):
            if len(run_dirs) == 1:
                jobs = [ex.submit(NodeTask(run_dirs[0]))]
            else:
                jobs = ex.submit_array([NodeTask(d) for d in run_dirs])
    except FailedJobError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        why = " ".join((lines[-1] if lines else str(exc)).split()).removeprefix("sbatch: error: ")
        hint = ("check slurm.partition against `sinfo`" if "partition" in why.lower() else
                "check slurm.constraint against `sinfo -o '%N %f'`" if "feature" in why.lower() else
                "check the [slurm] section; `ddpjob submit --dry-run` prints the script")
        raise DDPJobError(f"sbatch refused the job: {why}", hint) from None
    script = Path(jobs[0].paths.submission_file).read_text()
    records = []
    for i, (job, d) in enumerate(zip(jobs, run_dirs)):
        rundir.write_text_atomic(d / "job.sbatch", script)
        rec = {"backend": "slurm", "job_id": job.job_id, "submitted_at": time.time(),
               "command": command, "log_folder": str(log_folder), "array": None}
        if len(run_dirs) > 1:
            rec["array"] = {"job_id": job.job_id.split("_")[0], "index": i, "count": len(run_dirs)}
        records.append(rec)
    return records


# ------------------------------------------------------------------ local backend
def submit_local(run_dirs: list[Path], log_dir: Path, command: list[str],
                 rank_command: str | None = None) -> list[dict[str, Any]]:
    """Start the supervisor in its own session (it outlives this command) and return.
    `rank_command` replaces `ddpjob run` (tests drive the supervisor with fake ranks)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ddpjob.launch.local", *[str(d.resolve()) for d in run_dirs]]
    if rank_command:
        argv += ["--rank-command", rank_command]
    with open(log_dir / "supervisor.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base, n = f"local-{proc.pid}", len(run_dirs)
    return [{"backend": "local", "job_id": base if n == 1 else f"{base}_{i}",
             "pid": proc.pid, "submitted_at": time.time(), "command": command,
             "supervisor_log": str(log_dir / "supervisor.log"),
             "array": None if n == 1 else {"job_id": base, "index": i, "count": n}}
            for i in range(n)]


# ------------------------------------------------------------------ views
def choose_backend(requested: str) -> str:
    if requested == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    if requested == "slurm" and shutil.which("sbatch") is None:
        raise DDPJobError("--backend slurm needs `sbatch`, which is not on PATH",
                          "run on a SLURM login node, or use --backend local")
    return requested


def rank_rows(cfg: JobConfig, backend: str, limit: int = 64) -> list[list[Any]]:
    """Per-rank view: where each rank runs and what batch it trains with (the first `limit`
    ranks and the last one: a table of a million ranks helps nobody)."""
    s, t = cfg.slurm, cfg.train
    accum = config.accumulation_for(cfg, s.world_size)
    master = ("127.0.0.1:<free port at start>" if backend == "local"
              else "<first node>:<15000 + job id % 15000>")
    rows = []
    shown = range(s.world_size) if s.world_size <= limit else [*range(limit - 1), s.world_size - 1]
    for rank in shown:
        node, local = divmod(rank, s.tasks_per_node)
        device = f"cuda:{local}" if s.gpus_per_node > 0 else "cpu"
        rows.append([rank, f"node {node}" if backend == "slurm" else "localhost", local, device,
                     master, t.batch_size, accum, t.batch_size * accum * s.world_size])
    return rows


RANK_COLUMNS = ["rank", "node", "local rank", "device", "MASTER_ADDR:PORT", "batch/rank",
                "accumulation", "global batch"]


def dry_run(cfgs: list[JobConfig], points: list[SweepPoint], backend: str, job: str,
            run_dir: str | None) -> int:
    cfg = cfgs[0]
    where = Path(run_dir or Path("runs") / f"{cfg.name}{'-sweep' if points else ''}-<time>").absolute()
    if backend == "slurm":  # the script first: a refused value prints nothing but its error
        text = sbatch_text(cfg, where / rundir.LOGS, [where / p.id for p in points])
        console.info(f"# sbatch script submitit would submit for {job} (nothing submitted)")
        console.info(text)
    else:
        console.info(f"# local backend: a supervisor would start {cfg.slurm.world_size} rank(s), each:")
        console.info(shlex.join([sys.executable, "-u", "-m", "ddpjob", "run", str(where)]))
    # what each rank then runs: a wrong script is the first thing to spot before submitting
    console.info(f"# train.entry: {entry.describe(cfg.train.entry)}; train.args: "
                 f"{shlex.join(cfg.train.args) or '(none)'}")
    console.table("per-rank view", RANK_COLUMNS, rank_rows(cfg, backend))
    if points:
        console.table("sweep points", ["point", "values"],
                      [[p.id, " ".join(p.overrides)] for p in points])
    return 0


def _make_root(path: Path, share_group: bool = False) -> Path | None:
    """Create the run (or sweep) dir; returns the topmost folder this created (removed again
    if the submission fails), None if the dir was there already (empty)."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DDPJobError(f"run directory '{path}' already exists and is not empty",
                          "pass a new --run-dir, or leave it out for a fresh one under runs/")
    top = None
    for p in [path.absolute(), *path.absolute().parents]:
        if p.exists():
            break
        top = p
    try:
        rundir.make_dir(path, share_group)  # 0700/0750: see rundir.dir_mode
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise DDPJobError(f"cannot create run directory '{path}' ({exc.strerror})",
                          "pass a writable --run-dir") from None
    return top


def _check_idle(run_dir: Path) -> None:
    """Two jobs must never train in one run dir: refuse while its job is queued or running."""
    from ddpjob.launch import control

    [info] = control.infos([(run_dir, "")])
    if info.state == "COMPLETING":  # just after scancel: SLURM is still ending it, seconds as a rule
        console.info(f"ddpjob: job {info.job_id} is COMPLETING; waiting up to {COMPLETING_WAIT_S:.0f} s for it to end")
        deadline = time.monotonic() + COMPLETING_WAIT_S
        while info.state == "COMPLETING" and time.monotonic() < deadline:
            sleep(POLL_S)
            [info] = control.infos([(run_dir, "")])
    if info.job_id and info.state not in control.TERMINAL and info.state not in ("UNKNOWN", "DAMAGED"):
        raise DDPJobError(f"run directory '{run_dir}' has job {info.job_id} still {info.state}, "
                          "expected a stopped run to resume",
                          f"wait for it, or `ddpjob cancel {run_dir}` first")
    runlock.refuse_busy(run_dir)  # whatever the records say: something trains there now
    if info.state == "DAMAGED":  # its records cannot tell whether a job still runs: as if busy
        raise DDPJobError(f"run directory '{run_dir}' is damaged ({info.reason}), so whether a job "
                          "still runs there cannot be told, expected readable records",
                          f"repair or remove the damaged file (`ddpjob status {run_dir}` names it), "
                          "or use a new --run-dir")


def cmd_submit(args: argparse.Namespace) -> int:
    from ddpjob.launch.sbatch import locate_job  # `smoke` and jobs/smoke.toml also name the bundled jobs

    job = locate_job(args.job)
    flags = config.cli_flags(args)
    points = expand_sweep(list(args.sweep))
    # Every point is validated before anything is written or submitted.
    cfgs = [config.resolve(job, [*args.overrides, *p.overrides], flags) for p in points] or \
        [config.resolve(job, args.overrides, flags)]
    if any(c.slurm != cfgs[0].slurm for c in cfgs):
        raise UsageError("the sweep varies [slurm] settings, but one job array shares one set of "
                         "resources", "sweep [train]/[data]/[checkpoint] keys; submit separate jobs "
                         "for different resources")
    for line in entrycheck.unused_overrides(cfgs[0], [*args.overrides, *(o for p in points for o in p.overrides)]):
        console.warn(line)
    backend = choose_backend(args.backend)
    if args.dry_run:
        return dry_run(cfgs, points, backend, str(job), args.run_dir)
    name = cfgs[0].name + ("-sweep" if points else "")
    root = Path(args.run_dir) if args.run_dir else rundir.new_run_dir("runs", name)
    return launch(cfgs, points, backend, root, _command(args, str(job), backend), str(job),
                  wait_for=args.wait)


def launch(cfgs: list[JobConfig], points: list[SweepPoint], backend: str, root: Path,
           command: list[str], job: str, *, wait_for: bool = False) -> int:
    """Validate, prepare the run dir(s) and submit (`ddpjob submit`, `ddpjob resume`)."""
    if backend == "slurm":
        preflight_slurm(cfgs[0])
        # the same checks as `ddpjob sbatch`, before anything is written
        scriptsafe.run_dir(str(root.absolute() / rundir.LOGS), submitit=True)
    # One run: a run dir of the same training is reused (elastic resume at other resources),
    # as `ddpjob sbatch` and `ddpjob run` do. A sweep's folder must be new.
    state = rundir.NEW if points else rundir.check_reuse(root, cfgs[0])
    if state != rundir.NEW:
        rundir.refuse_completed(root)
        _check_idle(root)
        console.info(f"ddpjob: {root}: " + ("the same job again" if state == rundir.SAME else
                     f"same training, new resources/length: {rundir.CONFIG} updated")
                     + "; it resumes from its newest checkpoint")
    _doctor_checks(cfgs, backend, root)
    share = cfgs[0].slurm.share_group
    rundir.private_umask(share)  # the pickle submitit writes and the job's SLURM_UMASK too
    created = _make_root(root, share) if state == rundir.NEW else None
    try:
        run_dirs = [root / p.id for p in points] if points else [root]
        earlier = rundir.read_record(root / rundir.JOB) if state != rundir.NEW else {}
        if earlier:  # the earlier job's supervisor state would read as this job's (its events stay)
            (root / local.LOCAL).unlink(missing_ok=True)
        for d, cfg in zip(run_dirs, cfgs):
            rundir.make_dir(d, share)
            rundir.make_dir(d / rundir.LOGS, share)
            if state != rundir.SAME:
                rundir.write_text_atomic(d / rundir.CONFIG, cfg.to_json())
            if not (d / freeze.RECORD).is_file():  # a resubmission keeps the code it was frozen with
                freeze.freeze(cfg, d)
        log_dir = root / rundir.LOGS
        records = (submit_slurm(cfgs, run_dirs, log_dir.resolve(), command) if backend == "slurm"
                   else submit_local(run_dirs, log_dir, command))
        if earlier:  # the run's earlier jobs stay in its chain (status --json: job_ids)
            chain = [str(j) for j in (earlier.get("job_ids") or [earlier.get("job_id")]) if j]
            records[0]["job_ids"] = [*chain, records[0]["job_id"]]
        for d, rec in zip(run_dirs, records):
            rundir.write_json_atomic(d / rundir.JOB, rec)
        if points:
            rundir.write_json_atomic(root / "sweep.json", {
                "job": str(job), "backend": backend,
                "job_id": (records[0]["array"] or records[0])["job_id"],
                "axes": {k: [p.values[k] for p in points] for k in points[0].values},
                "points": [{"id": p.id, "index": p.index, "values": p.values} for p in points]})
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    _print_submitted(cfgs[0], backend, run_dirs, records)
    if wait_for:
        return wait(run_dirs)
    return 0


def _command(args: argparse.Namespace, job: str, backend: str) -> list[str]:
    """The submit command line, for job.json (what to rerun to get the same job)."""
    cmd = ["ddpjob", "submit", job, "--backend", backend, *config.cli_flag_words(args)]
    for item in args.overrides:
        cmd += ["--set", item]
    for item in args.sweep:
        cmd += ["--sweep", item]
    return cmd


def _print_submitted(cfg: JobConfig, backend: str, run_dirs: list[Path], records: list[dict]) -> None:
    s = cfg.slurm
    rows = []
    for d, rec in zip(run_dirs, records):
        if backend == "slurm":
            logs = f"{rec['log_folder']}/{rec['job_id']}_<rank>_log.out"
        else:
            logs = f"{d / rundir.LOGS}/rank-<rank>.log"
        rows.append([rec["job_id"], str(d), logs, f"{s.nodes} x {s.tasks_per_node}",
                     s.partition or ("(default)" if backend == "slurm" else "-")])
    console.table(f"submitted ({backend})", ["job id", "run dir", "logs", "nodes x tasks", "partition"],
                  rows)


def wait(run_dirs: list[Path]) -> int:
    """--wait: stream rank 0's log of each run until it ends; 0 only if every run completed."""
    from ddpjob.launch import control

    ok = True
    for d in run_dirs:
        try:
            info = control.follow(d, rank=0)
        except KeyboardInterrupt:
            console.warn(f"stopped waiting; the job goes on (`ddpjob status {d}`, "
                         f"`ddpjob cancel {d}` to stop it)")
            return 130
        console.info(f"ddpjob: {d}: {info.state}" + (f" ({info.reason})" if info.reason else ""))
        ok = ok and info.state == "COMPLETED"
    return 0 if ok else 1

