"""`ddpjob doctor [JOB.toml]`: catch on the login node what would otherwise fail after the queue.

Sits between the job file (jobfile.resolve) and submission: asks SLURM (scontrol, sacct:
slurmchecks.py; with --srun one tiny real job step, here) whether the cluster can run the job as
configured, and checks the file systems, the dataset, the MASTER_PORT window, the warning signal
(signalchecks.py) and what a restart in place needs (room for the in-memory snapshots, a private
/dev/shm, the memory limit: restartchecks.py). `ddpjob submit` runs `cheap_checks` and stops on
the first failure (`raise_on_failures`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

from ddpjob import console, slurm
from ddpjob.config import JobConfig
from ddpjob.jobfile import resolve
from ddpjob.errors import UsageError
from ddpjob.node import cluster
from ddpjob.launch import entrycheck
from ddpjob.launch.checks import FAIL, PASS, WARN, Check, one_cell, output, raise_on_failures
from ddpjob.launch.restartchecks import restart_checks
from ddpjob.launch.signalchecks import measured_checkpoint_s, raw_signal_routing, signal_checks
from ddpjob.launch.slurmchecks import cluster_checks, command_grace, partition_checks

__all__ = ["FAIL", "PASS", "WARN", "Check", "cheap_checks", "cmd_doctor", "code_checks", "command_grace",
           "raise_on_failures", "run_checks", "srun_check"]  # command_grace: as before the split


def run_dir_check(path: Path) -> Check:
    """Can run dirs be created in `path` (or where it would be created)? A real file, not
    os.access: root, ACLs and read-only mounts all answer differently."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    hint = "use --run-dir on a writable filesystem that the compute nodes share"
    if not p.is_dir():
        return Check("run dir", FAIL, f"{p} exists and is not a folder", hint)
    try:
        fd, name = tempfile.mkstemp(prefix=".ddpjob-doctor-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return Check("run dir", FAIL, f"cannot create files in {p} ({exc.strerror})", hint)
    return Check("run dir", PASS, f"{path.absolute()} writable")


def _data_check(cfg: JobConfig, full: bool) -> Check:
    d = cfg.data
    if d.dataset == "synthetic":
        return Check("dataset", PASS, "synthetic (generated on the nodes, no files)")
    if d.dataset == "cifar10":
        from ddpjob.launch.dataprep import _hint, cifar10_problem

        root = Path(d.root).absolute()
        problem = cifar10_problem(root, full=full)
        return (Check("dataset", PASS, f"CIFAR-10 complete in {root}") if problem is None else
                Check("dataset", FAIL, f"CIFAR-10 not ready: {problem}", _hint(Path(d.root))))
    module = d.dataset.split(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return (Check("dataset", PASS, f"plugin module {module} importable") if found else
            Check("dataset", WARN, f"plugin module {module} is not importable here",
                  "install it in the environment the job uses (or fix data.dataset)"))


def port_check() -> Check:
    lo_w, hi_w = cluster.PORT_BASE, cluster.PORT_BASE + cluster.PORT_SPAN - 1
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return Check("port window", PASS, f"MASTER_PORT {lo_w}-{hi_w} (ephemeral range unknown)")
    if hi < lo_w or lo > hi_w:
        return Check("port window", PASS, f"MASTER_PORT {lo_w}-{hi_w}, outside the ephemeral "
                     f"range {lo}-{hi}")
    return Check("port window", WARN, f"MASTER_PORT window {lo_w}-{hi_w} overlaps this host's "
                 f"ephemeral range {lo}-{hi}: another socket can take the port at random",
                 "export MASTER_PORT=<free port outside the range> in slurm.setup")


def cheap_checks(cfg: JobConfig, *, on_slurm: bool = True, runs_root: str | Path = "runs",
                 full: bool = False, measured_s: float | None = None) -> list[Check]:
    """The job's own checks, a few scontrol calls and no job step: what submit runs first.
    Off SLURM (the local backend), only what matters on this machine (files, dataset)."""
    out = [run_dir_check(Path(runs_root)), _data_check(cfg, full), *code_checks(cfg)]
    if not on_slurm:
        return out
    s = cfg.slurm
    if s.gpus_per_node and s.tasks_per_node > s.gpus_per_node:
        out.append(Check("tasks per gpu", FAIL, f"slurm.tasks_per_node = {s.tasks_per_node} > "
                         f"gpus_per_node = {s.gpus_per_node}: ranks would share a GPU",
                         f"set tasks_per_node = gpus_per_node = {s.gpus_per_node} (one rank per GPU)"))
    elif s.gpus_per_node and s.tasks_per_node < s.gpus_per_node:
        out.append(Check("tasks per gpu", WARN, f"{s.tasks_per_node} task(s) for {s.gpus_per_node} "
                         "GPUs per node: ddpjob runs one rank per GPU, the rest stay idle",
                         f"set tasks_per_node = {s.gpus_per_node}"))
    else:
        out.append(Check("tasks per gpu", PASS, "one rank per GPU" if s.gpus_per_node
                         else f"CPU job, {s.tasks_per_node} rank(s) per node"))
    out += [container_check(cfg)] if cfg.slurm.container else []
    return out + partition_checks(cfg) + signal_checks(cfg, measured_s) + [port_check()]


def code_checks(cfg: JobConfig) -> list[Check]:
    """train.entry and checkpoint.init_from, as the login node can see them (launch/entrycheck.py)."""
    init_from = entrycheck.init_from_check(cfg)
    return [entrycheck.entry_check(cfg)] + ([init_from] if init_from else [])


def container_check(cfg: JobConfig) -> Check:
    """[slurm] container: the runtime is there (on this node: sites install it cluster-wide)."""
    s = cfg.slurm
    if s.container_runtime == "pyxis":
        res = slurm.run(["srun", "--help"], timeout=20)
        if "--container-image" in res.stdout + res.stderr:
            return Check("container", PASS, f"pyxis: srun takes --container-image ({s.container})")
        return Check("container", FAIL, "slurm.container_runtime = pyxis, but `srun --help` lists no "
                     "--container-image (the pyxis plugin is not installed)",
                     "ask your admins for pyxis/enroot, or use container_runtime = \"apptainer\"")
    found = shutil.which(s.container_runtime)
    if found:
        return Check("container", PASS, f"{s.container_runtime} at {found} ({s.container})")
    return Check("container", FAIL, f"slurm.container_runtime = {s.container_runtime}, but it is not on PATH",
                 f"module load {s.container_runtime} in slurm.setup, or install it")


# ------------------------------------------------------------------ srun and the command
def srun_check(cfg: JobConfig, runs_root: Path, timeout_s: float = 120,
               data: bool = True) -> Check:
    """One real job step: are the run dir and the data visible (and writable) on a compute node?"""
    return node_step(cfg, runs_root, timeout_s, data)[0]


def node_step(cfg: JobConfig, runs_root: Path, timeout_s: float = 120,
              data: bool = True) -> tuple[Check, tuple[int | None, str] | None]:
    """srun_check's job step, which also measures the free room in checkpoint.snapshot_dir on
    the node: (its check, (bytes free, "on NODE") or None when the step did not run)."""
    s = cfg.slurm
    run_root = runs_root.absolute()
    while not run_root.exists():
        run_root = run_root.parent
    wanted = [f"w:{run_root}"]
    if data and cfg.data.dataset == "cifar10":
        wanted.append(f"r:{Path(cfg.data.root).absolute() / 'cifar-10-batches-py' / 'test_batch'}")
    # Paths travel as arguments, never inside the script text.
    script = ('for a; do p=${a#?:}; case $a in w:*) test -d "$p" && test -w "$p" || echo "missing:$p";; '
              'd:*) while [ ! -e "$p" ]; do p=$(dirname "$p"); done; '
              'echo "room:$(df -Pk "$p" | awk \'NR==2{print $4}\')";; '
              '*) test -r "$p" || echo "missing:$p";; esac; done; echo "node:${SLURMD_NODENAME:-$(hostname)}"')
    # --immediate: give up (a warning, not a failure) if no node frees up in time.
    cmd = ["srun", "-N1", "-n1", "--time=1", f"--immediate={max(10, int(timeout_s) - 20)}",
           "-J", "ddpjob-doctor", "--quiet"]
    cmd += [f"--{k}={getattr(s, k)}" for k in ("partition", "account", "qos") if getattr(s, k)]
    t0 = time.monotonic()
    res = slurm.run([*cmd, "sh", "-c", script, "sh", *wanted, f"d:{cfg.checkpoint.snapshot_dir}"],
                    timeout=timeout_s)
    text = output(res)
    lines = text.splitlines()
    missing = [x.removeprefix("missing:") for x in lines if x.startswith("missing:")]
    node = next((x.removeprefix("node:") for x in lines if x.startswith("node:")), "?")
    kib = next((x.removeprefix("room:") for x in lines if x.startswith("room:")), "")
    room = (int(kib) << 10 if kib.isdigit() else None, f"on {node}") if res.ok else None
    if res.ok and not missing:
        seen = " and ".join(("writable " if w[0] == "w" else "readable ") + w[2:] for w in wanted)
        return Check("compute node", PASS, f"on {node}: {seen} (srun took "
                     f"{time.monotonic() - t0:.1f} s)"), room
    if missing:
        return Check("compute node", FAIL, f"not visible/writable from compute node {node}: "
                     f"{', '.join(missing)}", "put the run dir and data.root on a filesystem "
                     "shared with the nodes (not /tmp or a local disk)"), room
    return Check("compute node", WARN, f"srun did not run ({one_cell(text) or res.rc})",
                 "the partition may be busy; try again, or run `srun -N1 true` yourself"), None


def run_checks(args: argparse.Namespace) -> list[Check]:
    """All checks for `ddpjob doctor [JOB] [--srun]`; without a job file, the cluster-level ones."""
    flags = {k: getattr(args, k, None) for k in ("nodes", "tasks_per_node", "gpus_per_node",
                                                  "partition", "account", "qos", "time", "name")}
    runs_root = Path(args.run_dir) if getattr(args, "run_dir", None) else Path("runs")
    checks: list[Check] = []
    cfg = None
    if args.job:
        try:  # a job file SLURM would reject is a failed check here, not a crash
            cfg = resolve(args.job, args.overrides, flags)
            s = cfg.slurm
            checks.append(Check("job file", PASS, f"{args.job}: {s.nodes} node(s) x "
                                f"{s.tasks_per_node} task(s), {s.gpus_per_node} GPU(s)/node, {s.time}"))
        except UsageError as exc:
            checks.append(Check("job file", FAIL, exc.message, exc.hint))
            routing = raw_signal_routing(args.job, args.overrides)
            checks += [routing] if routing else []
    checks += cluster_checks()
    slurm_ok = all(c.status != FAIL for c in checks if c.name in ("slurm commands", "controller"))
    if cfg is None:
        return checks + [run_dir_check(runs_root), port_check()]
    checks += cheap_checks(cfg, on_slurm=slurm_ok, runs_root=runs_root,
                           full=True, measured_s=measured_checkpoint_s(cfg, runs_root))
    room = None
    if args.srun and slurm_ok:
        blocking = [c.name for c in checks if c.status == FAIL and c.name in _STEP_NEEDS]
        if blocking:
            checks.append(Check("compute node", WARN, f"srun skipped: fix '{blocking[0]}' first"))
        else:
            step, room = node_step(cfg, runs_root, data=not any(
                c.name == "dataset" and c.status == FAIL for c in checks))
            checks.append(step)
    return checks + (restart_checks(cfg, runs_root, room) if slurm_ok else [])


# A job step cannot start while one of these fails.
_STEP_NEEDS = ("partition", "nodes", "time limit", "gpus", "cpus")


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    rows = [(c.name, c.status, c.detail, c.hint) for c in checks]
    console.table("ddpjob doctor", ("check", "result", "detail", "hint"), rows)
    n = {k: sum(c.status == k for c in checks) for k in (PASS, WARN, FAIL)}
    console.info(f"{n[PASS]} passed, {n[WARN]} warning(s), {n[FAIL]} failed")
    return 1 if n[FAIL] else 0
