"""`ddpjob verify JOB.toml`: does the user's own loop resume exactly? Login side.

Runs the job small on the local backend (`ddpjob submit`, `stop` and `resume` called in process,
each run in its own temporary run dir): once through (the reference), then once per
interruption kind, each caused at a drawn step by rank/probe.py (probeplan.py's DDPJOB_VERIFY), never by a
timer; a second uninterrupted run only where a difference comes before a resume.
launch/verifyfacts.py reads each run's facts and launch/verdict.py says why they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpjob import console, jobfile, probeplan, rundir
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch import resume, runs, stop, submit, verdict, verifyfacts
from ddpjob.launch.backends import TERMINAL
from ddpjob.launch.backends.local_procs import LocalBackend, pid_alive
from ddpjob.probeplan import Instruction

KINDS = {
    "signal": "SIGUSR2 to the supervisor (a preemption: checkpoint, restart)",
    "kill": "kill -9 of rank {rank}, restarted in place from an in-memory snapshot",
    "stop": "`ddpjob stop`, then `ddpjob resume`",
    "world": "`ddpjob stop`, then `ddpjob resume` at {other} rank(s)",
}
# [user] keys a custom loop's step budget is commonly read from (examples/charlm: max_steps)
STEP_KEYS = ("max_steps", "max_iters", "steps", "total_steps", "num_steps", "iterations")
RECORD = Instruction("record")
RUN_LIMIT_S = 1800.0
POLL_S = 0.05


@dataclass
class Plan:
    """What every run of one verify shares."""

    job: Path
    sets: list[str]  # --set overrides: the user's, then verify's
    world: int
    other: int  # the world size the "world" kind resumes at
    gpus: bool  # one GPU per rank (else CPU ranks)
    arithmetic: bool = False  # may two runs' arithmetic differ (GPUs without deterministic kernels)?
    keep: bool = False  # --keep: the run dirs stay (no "rerun with --keep" then)


def plan(job: Path, cfg: JobConfig, user_sets: list[str], steps: int) -> tuple[Plan, list[str]]:
    """The overrides that make the job small and restartable here, and notes on what they changed."""
    s, notes = cfg.slurm, []
    gpus = len(list(Path("/dev").glob("nvidia[0-9]*"))) if s.gpus_per_node else 0
    room = gpus if s.gpus_per_node and gpus else os.cpu_count() or 1
    world = s.world_size if s.world_size <= room else 2
    other = world // 2 if world > 1 else 2
    sets = [*user_sets, "slurm.nodes=1", f"slurm.tasks_per_node={world}", "slurm.max_requeues=3",
            "slurm.max_failures=0", "checkpoint.resume=true"]
    if s.gpus_per_node and not gpus:
        notes.append("no GPU here: the ranks run on the CPU")
    on_gpus = bool(s.gpus_per_node and gpus)
    sets.append(f"slurm.gpus_per_node={world if on_gpus else 0}")
    if not on_gpus:
        sets.append(f"slurm.cpus_per_task={max(1, min(s.cpus_per_task, room // max(world, other)))}")
    if world != s.world_size:
        notes.append(f"{world} ranks instead of the job's {s.world_size} (what fits this machine)")
    if not cfg.train.entry or cfg.train.entry.startswith("ddpjob.train."):  # the built-in trainer
        sets += [f"train.max_steps={steps}", "train.log_every=1"]
        if not cfg.train.global_batch_size:  # batch_size is per rank: the world kind keeps the global batch
            sets.append(f"train.global_batch_size={cfg.train.batch_size * max(world, other)}")
    else:
        key = next((k for k in STEP_KEYS if isinstance(cfg.user.get(k), int)), None)
        if key is not None:
            sets.append(f"user.{key}={steps}")
        else:
            notes.append(f"the step budget of {cfg.train.entry} is none of [user] {', '.join(STEP_KEYS)}: "
                         "it runs as configured")
    return Plan(job, sets, world, other, on_gpus, on_gpus and not cfg.train.deterministic), notes


@contextlib.contextmanager
def _instruction(instruction: Instruction) -> Iterator[None]:
    """DDPJOB_VERIFY for the supervisor started now (its ranks inherit it), and no other."""
    old = os.environ.get(probeplan.VARIABLE)
    os.environ[probeplan.VARIABLE] = instruction.text()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # submit's table, stop's and resume's lines
            yield
    finally:
        if old is None:
            os.environ.pop(probeplan.VARIABLE, None)
        else:
            os.environ[probeplan.VARIABLE] = old


def _namespace(**values: object) -> argparse.Namespace:
    return argparse.Namespace(**{flag: None for flag, _, _ in jobfile.CLI_FLAGS}, **values)


def _submit(p: Plan, run_dir: Path, instruction: Instruction, extra: tuple[str, ...] = ()) -> None:
    with _instruction(instruction):
        submit.cmd_submit(_namespace(job=str(p.job), backend="local", sweep=[], dry_run=False, wait=False,
                                     overrides=[*p.sets, *extra], run_dir=str(run_dir)))


def _wait(run_dir: Path, paused: bool = False) -> str:
    """The run's end state, or PAUSED once a rank paused for verify (rank/probe.py)."""
    backend, job = LocalBackend(), runs.job_record(run_dir)
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        while time.monotonic() < deadline:
            if paused and (run_dir / probeplan.FOLDER / probeplan.PAUSED).is_file():
                return "PAUSED"
            state = backend.state(run_dir, job, None).state
            if state in TERMINAL and not pid_alive(job.get("pid")):  # its lock is free: resume may follow
                return state
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # the supervisor is detached: it would train on in a removed folder
        backend.cancel(run_dir, job, "RUNNING")
        raise
    backend.cancel(run_dir, job, "RUNNING")
    raise DDPJobError(f"a verify run in '{run_dir}' did not end within {RUN_LIMIT_S:.0f} s",
                      "run the job once with `ddpjob submit --backend local --wait` to see why")


def _ended(run_dir: Path, state: str, expected: str = "COMPLETED", keep: bool = False) -> str | None:
    """None if the run ended as expected, else why not (one line)."""
    if state == expected:
        return None
    why = runs.run_info(run_dir).extra.get("last_event", "")
    where = f"read {run_dir / 'logs'}" if keep else "rerun with --keep and read its logs/"
    return f"the run ended {state}, expected {expected} ({why}); {where}"


def run_kind(p: Plan, kind: str, at: int, run_dir: Path) -> str | None:
    """One interrupted run to its end; None, or why it did not complete."""
    if kind == "kill":
        _submit(p, run_dir, Instruction("kill", at, p.world - 1),
                ("slurm.max_failures=1", f"checkpoint.snapshot_every={max(1, at - 2)}"))
        # the snapshot of step at - 2 (written in the background, done by the kill) is the newest
        # for at > 4: two steps replayed; the line says the step it resumed from (events.jsonl)
        return _ended(run_dir, _wait(run_dir), keep=p.keep)
    _submit(p, run_dir, Instruction("pause", at, 0))
    state = _wait(run_dir, paused=True)
    if state != "PAUSED":
        return _ended(run_dir, state, "PAUSED", p.keep)
    if kind == "signal":  # what SLURM's warning does to a local run: USR2 to the supervisor
        os.kill(int(runs.job_record(run_dir)["pid"]), signal.SIGUSR2)
        return _ended(run_dir, _wait(run_dir), keep=p.keep)
    with _instruction(RECORD):
        stop.cmd_stop(_namespace(run=str(run_dir)))
    why = _ended(run_dir, _wait(run_dir), "STOPPED", p.keep)
    if why:
        return why
    extra = [f"slurm.tasks_per_node={p.other}", f"slurm.gpus_per_node={p.other if p.gpus else 0}"] \
        if kind == "world" else []
    with _instruction(RECORD):
        resume.cmd_resume(_namespace(run=str(run_dir), wait=False, allow_code_change=False, overrides=extra))
    return _ended(run_dir, _wait(run_dir), keep=p.keep)


def judge(p: Plan, kind: str, at: int, ref: Path, got: Path,
          twin: Callable[[], verdict.Twin]) -> tuple[verdict.Verdict, int | None]:
    """The verdict on one interrupted run, and the step it resumed from. `twin` runs a second
    uninterrupted run (once per verify) when a difference comes before the resume."""
    f = verdict.Facts(at=at, resumed=verifyfacts.resumed_step(got), ref=verifyfacts.scalars(ref),
                      got=verifyfacts.scalars(got), ref_views=verifyfacts.views(ref),
                      got_views=verifyfacts.views(got), arithmetic=p.arithmetic)
    if kind == "world":
        return verdict.close(f, verifyfacts.parameter_distance(ref, got)), f.resumed
    verdict.split_files(verifyfacts.tensor_differences(ref, got), f)
    verdict.digest_facts(f, verifyfacts.digests(ref), verifyfacts.digests(got))
    if verdict.needs_twin(f):
        f.twin = twin()
    return verdict.diagnose(f), f.resumed


def _twin(p: Plan, ref: Path, run_dir: Path, cache: list[verdict.Twin]) -> verdict.Twin:
    """A second uninterrupted run, compared with the first (made once, kept for every kind)."""
    if not cache:
        _submit(p, run_dir, RECORD)
        why = _ended(run_dir, _wait(run_dir), keep=p.keep)
        if why:
            raise DDPJobError(f"the second uninterrupted run failed: {why}",
                              f"run the job twice with `ddpjob submit {p.job} --backend local --wait`")
        cache.append(verdict.twin(verifyfacts.scalars(ref), verifyfacts.scalars(run_dir),
                                  verifyfacts.views(ref), verifyfacts.views(run_dir)))
    return cache[0]


def _late_change(ref: Path, total: int, resumed: list[int]) -> str | None:
    """The hint for kinds that all resumed before a late event: a logged value other than the
    loss that changes at few steps (an lr annealed at an epoch's end, an epoch index), the last
    time after every resume verify made. A mistake there shows only in a resume after it."""
    values = verifyfacts.scalars(ref)
    if not resumed:
        return None
    late: list[tuple[int, str, object, object]] = []
    for name in sorted({n for v in values.values() for n in v if n != "loss"}):
        seq = [(s, values[s][name]) for s in sorted(values) if name in values[s]]
        changes = [(s, name, a, b) for (_, a), (s, b) in zip(seq, seq[1:]) if a != b]
        if changes and len(changes) <= max(1, len(seq) // 4) and changes[-1][0] > max(resumed) + 1:
            late.append(changes[-1])
    if not late:
        return None
    step, name, a, b = max(late, key=lambda c: c[0])  # a resume after the last change carries every earlier one
    at = min(step + 1, total - 3)  # a kill's snapshot is a step or two older than its step
    return (f"verify: every kind resumed before step {step}, where `{name}` changes ({verdict.shown(a, b)}): "
            f"a value outside `state` shows only in a resume after it. Hint: rerun with --at {at}")


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"--kinds {text!r} names {', '.join(bad) or 'nothing'}, expected a comma-separated "
                         f"list of {', '.join(KINDS)}", "e.g. --kinds signal,stop")
    return list(dict.fromkeys(kinds))


CANCEL_WAIT_S = 60.0


def _cancel_live(root: Path) -> None:
    """Cancel every run under `root` whose supervisor still lives."""
    backend = LocalBackend()
    live = [(f.parent, job) for f in root.glob("*/job.json") if pid_alive((job := runs.job_record(f.parent)).get("pid"))]
    for run_dir, job in live:
        backend.cancel(run_dir, job, "RUNNING")
    deadline = time.monotonic() + CANCEL_WAIT_S  # their ranks stop and the supervisors end before the folders go
    while any(pid_alive(job.get("pid")) for _, job in live) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # _wait cancels the run it waits on, the finally removes the folders


def cmd_verify(args: argparse.Namespace) -> int:
    started = time.monotonic()
    from ddpjob.launch.sbatch import locate_job  # `smoke` also names the bundled job

    kinds = _kinds(args.kinds)
    if args.steps < 6:
        raise UsageError(f"--steps {args.steps} is too few, expected at least 6", "e.g. --steps 30")
    if args.at is not None and not 0 < args.at < args.steps - 2:
        raise UsageError(f"--at {args.at} is outside the run, expected 1..{args.steps - 3}", "e.g. --at 10")
    job = locate_job(args.job)
    cfg = jobfile.resolve(job, list(args.overrides))
    if cfg.train.command:  # refused before anything runs: nothing of the user's is touched
        raise UsageError(f"{job} runs the command {' '.join(cfg.train.command)[:80]!r}, expected a loop on "
                         "ddpjob's API (train.entry): verify compares the state ddpjob checkpoints, and a "
                         "command's checkpoint is its own program's",
                         "try the program's own resume with `ddpjob stop RUN` + `ddpjob resume RUN` "
                         "(docs/commands.md), or port its loop (docs/api.md)")
    # `ddpjob verify` ended by a signal (a batch job's time, a kill) ends its runs too: their
    # supervisors are detached and would train on in a folder about to be removed (_wait)
    signal.signal(signal.SIGTERM, _interrupted)
    p, notes = plan(job, cfg, list(args.overrides), args.steps)
    p.keep = bool(args.keep)
    for note in notes:
        console.info(f"verify: {note}")
    root = Path(tempfile.mkdtemp(prefix=f"ddpjob-verify-{cfg.name}-"))
    rundir.make_dir(root)
    failed = 0
    try:
        ref = root / "reference"
        _submit(p, ref, RECORD)
        why = _ended(ref, _wait(ref), keep=p.keep)
        if why:
            raise DDPJobError(f"the uninterrupted reference run failed: {why}", "fix the job first: `ddpjob "
                              f"submit {args.job} --backend local --wait`")
        losses = verifyfacts.losses(ref)
        if not losses:
            raise DDPJobError(f"the job logged no `loss` in {rundir.METRICS}, expected one per step",
                              "log it in the loop: job.log(step + 1, loss=loss)")
        total = max(losses)
        if total < 6:
            raise DDPJobError(f"the job ran {total} steps, expected at least 6 to interrupt",
                              "give it more steps ([user] max_steps, or --steps)")
        draw = random.Random(args.seed)
        console.info(f"verify: {cfg.name}, {total} steps on {p.world} rank(s), reference run: "
                     f"{time.monotonic() - started:.0f} s")
        twins: list[verdict.Twin] = []
        passed: list[int] = []
        for kind in kinds:
            at = args.at if args.at is not None else draw.randint(max(1, total // 4), max(1, total // 2))
            if not 0 < at < total - 2:
                raise UsageError(f"--at {at} is outside the run, expected 1..{total - 3}", "e.g. --at 10")
            what = KINDS[kind].format(rank=p.world - 1, other=p.other)
            got = root / kind
            why = run_kind(p, kind, at, got)
            result, resumed = (verdict.Verdict(False, why), None) if why else \
                judge(p, kind, at, ref, got, lambda: _twin(p, ref, root / "twin", twins))
            failed += not result.ok
            if result.ok and resumed is not None:
                passed.append(resumed)
            source = "in-memory snapshot" if kind == "kill" else "checkpoint"
            where = f"interrupted at step {at}" + (f", resumed from the {source} of step {resumed}"
                                                   if resumed is not None else "")
            console.info(f"{kind:<6} {what}, {where}: {result.line}")
        late = _late_change(ref, total, passed) if passed and args.at is None else None
        if late:
            console.info(late)
    finally:
        _cancel_live(root)  # any run of ours still alive (verify stopped, or one of its steps failed)
        if args.keep:
            console.info(f"verify: the run dirs are kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    console.info(f"verify: {len(kinds) - failed} of {len(kinds)} kind(s) passed (exact; world: close), "
                 f"{time.monotonic() - started:.0f} s in all")
    return 1 if failed else 0
