"""`ddpjob doctor [JOB.toml]`: catch on the login node what would otherwise fail after the queue.

Sits between the job file (jobfile.resolve) and submission: asks SLURM (scontrol, sacct, and with
--srun one tiny real job step) whether the cluster can run the job as configured, and checks the
file systems, the dataset and the MASTER_PORT window, and what a restart in place needs (room for
the in-memory snapshots, a private /dev/shm, the memory limit: `restart_checks`). `ddpjob submit`
runs `cheap_checks` and stops on the first failure (`raise_on_failures`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ddpjob import console, slurm
from ddpjob.config import JobConfig
from ddpjob.jobfile import resolve
from ddpjob.validate import parse_time_s
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.node import cluster
from ddpjob.launch import entrycheck
from ddpjob.launch.checks import FAIL, PASS, WARN, Check, one_cell, output, raise_on_failures, records
from ddpjob.launch.restartchecks import restart_checks

MIN_LEAD_S = 30  # below this, a checkpoint of anything but a tiny model may not finish in time
TOOLS = ("sbatch", "srun", "scontrol", "sacct")


def _limit_s(value: str) -> int | None:  # MaxTime: "UNLIMITED" / "INFINITE" or a SLURM time
    try:
        return parse_time_s(value)
    except ValueError:
        return None


def _gpus(gres: str) -> int:
    """GPUs in a node's Gres ("gpu:4", "gpu:a100:4(S:0-1)", "gpu:a:2,gpu:b:2", "(null)")."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


# ------------------------------------------------------------------ cluster-level checks
def cluster_checks() -> list[Check]:
    """Tools, controller, accounting, requeue policy: what holds for every job."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return [Check("slurm commands", FAIL, f"{', '.join(missing)} not found on PATH",
                      "run doctor on the cluster's login node (or load its slurm module); "
                      "without SLURM, use `ddpjob submit --backend local`")]
    out = [Check("slurm commands", PASS, " ".join(TOOLS) + " found")]
    res = slurm.run(["scontrol", "ping"], timeout=20)
    text = output(res)
    if not res.ok or " UP" not in text:
        return out + [Check("controller", FAIL, f"`scontrol ping`: {one_cell(text) or res.rc}",
                            "slurmctld is down or unreachable; ask the cluster admins")]
    out.append(Check("controller", PASS, one_cell(text)))
    res = slurm.run(["sacct", "-n", "-X", "-S", "now"], timeout=20)
    text = output(res)
    out.append(Check("accounting", PASS, "sacct answers (finished and requeued jobs are visible)")
               if res.ok else
               Check("accounting", WARN, f"sacct fails: {one_cell(text)}",
                     "ask the admins for accounting (slurmdbd); `ddpjob status` then only "
                     "knows what the run dir records"))
    text = output(slurm.run(["scontrol", "show", "config"], timeout=20))
    m = re.search(r"\bJobRequeue\s*=\s*(\d)", text)
    if m and m.group(1) == "1":
        out.append(Check("requeue policy", PASS, "JobRequeue=1: batch jobs may be requeued"))
    elif m:
        out.append(Check("requeue policy", WARN, "JobRequeue=0: jobs are not requeueable by default",
                         "ddpjob submits with --requeue, which overrides it; if requeues "
                         "still fail, ask the admins"))
    else:
        out.append(Check("requeue policy", WARN, "JobRequeue not found in `scontrol show config`",
                         "check `scontrol show config | grep JobRequeue`"))
    return out


# ------------------------------------------------------------------ job-level checks
def _partition_checks(cfg: JobConfig) -> list[Check]:
    s = cfg.slurm
    text = output(slurm.run(["scontrol", "show", "partition", "-o"], timeout=20))
    parts = records(text)
    found = [p for p in parts if (p.get("PartitionName") == s.partition if s.partition
                                  else p.get("Default") == "YES")]
    if not found:
        names = ", ".join(p.get("PartitionName", "?") for p in parts) or "none"
        what = f"partition '{s.partition}' does not exist" if s.partition else \
            "no partition given and the cluster has no default"
        return [Check("partition", FAIL, f"{what} (this cluster has: {names})",
                      "set slurm.partition (or --partition) to one of those")]
    part = found[0]
    name = part["PartitionName"]
    out = []
    state = part.get("State", "?")
    out.append(Check("partition", PASS, f"'{name}' is UP (nodes {part.get('Nodes')})")
               if state == "UP" else
               Check("partition", FAIL, f"partition '{name}' is {state}, expected UP",
                     "choose another partition (`sinfo -s`) or wait for it to come back"))
    total = int(part.get("TotalNodes", "0") or 0)
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    limit = min(total, int(max_nodes)) if max_nodes.isdigit() else total
    out.append(Check("nodes", PASS, f"{s.nodes} of at most {limit} in '{name}'")
               if s.nodes <= limit else
               Check("nodes", FAIL, f"slurm.nodes = {s.nodes}, but '{name}' allows at most "
                     f"{limit} (TotalNodes={total}, MaxNodes={max_nodes})",
                     f"set slurm.nodes <= {limit} or use a bigger partition"))
    want, max_s = parse_time_s(s.time), _limit_s(part.get("MaxTime", "UNLIMITED"))
    out.append(Check("time limit", PASS, f"{s.time} within MaxTime {part.get('MaxTime')}")
               if max_s is None or want <= max_s else
               Check("time limit", FAIL, f"slurm.time = {s.time}, above '{name}' MaxTime "
                     f"{part.get('MaxTime')}", f"set slurm.time <= {part.get('MaxTime')}: "
                     "the job checkpoints and requeues itself at the limit anyway"))
    ntext = output(slurm.run(["scontrol", "show", "node", "-o"], timeout=20))
    nodes = [n for n in records(ntext) if name in n.get("Partitions", "").split(",")]
    gres = {n.get("NodeName", "?"): _gpus(n.get("Gres", "")) for n in nodes}
    if s.gpus_per_node:
        fit = [n for n, g in gres.items() if g >= s.gpus_per_node]
        if not any(gres.values()):
            out.append(Check("gpus", FAIL, f"slurm.gpus_per_node = {s.gpus_per_node}, but the "
                             f"nodes of '{name}' ({', '.join(gres) or 'none'}) have no GPUs in their Gres",
                             "use a GPU partition (`sinfo -o '%P %G'`) or set slurm.gpus_per_node = 0"))
        elif len(fit) < s.nodes:
            out.append(Check("gpus", FAIL, f"{s.nodes} node(s) x {s.gpus_per_node} GPUs wanted, "
                             f"'{name}' has {len(fit)} node(s) with that many (most: "
                             f"{max(gres.values())})", "lower slurm.gpus_per_node or slurm.nodes"))
        else:
            out.append(Check("gpus", PASS, f"{len(fit)} node(s) in '{name}' have "
                             f">= {s.gpus_per_node} GPUs"))
    cpus = s.cpus_per_task * s.tasks_per_node
    most = max([int(n.get("CPUTot", "0") or 0) for n in nodes] or [0])
    if nodes and cpus > most:
        out.append(Check("cpus", FAIL, f"{s.tasks_per_node} tasks x {s.cpus_per_task} CPUs = "
                         f"{cpus} per node, but nodes of '{name}' have at most {most}",
                         "lower slurm.tasks_per_node or slurm.cpus_per_task"))
    elif nodes:
        out.append(Check("cpus", PASS, f"{cpus} per node, nodes have up to {most}"))
    out.append(_preemption_check(cfg, name, part))
    if cfg.train.command:
        kill = re.search(r"\bKillWait\s*=\s*(\d+)", output(slurm.run(["scontrol", "show", "config"], timeout=20)))
        out.append(command_grace(cfg, name, part.get("GraceTime", ""), int(kill.group(1)) if kill else None))
    return out


def command_grace(cfg: JobConfig, name: str, grace_time: str, kill_wait: int | None) -> Check:
    """[train] command_grace_s against what SLURM leaves a signalled program before SIGKILL: on a
    preemption GraceTime, before the time limit signal_lead_s + KillWait (docs/commands.md)."""
    t, s = cfg.train, cfg.slurm
    windows = {f"GraceTime {grace_time} s of '{name}' (preemption)": int(grace_time)} if grace_time.isdigit() \
        and int(grace_time) > 0 else {}
    if kill_wait is not None:
        windows[f"slurm.signal_lead_s {s.signal_lead_s} + KillWait {kill_wait} s (time limit)"] = \
            s.signal_lead_s + kill_wait
    short = [f"{what}" for what, secs in windows.items() if t.command_grace_s > secs]
    if short:
        return Check("command grace", WARN, f"train.command_grace_s = {t.command_grace_s:g} s is longer than "
                     f"{' and '.join(short)}: SLURM's SIGKILL comes first", "lower train.command_grace_s to "
                     f"{min(windows.values())} s or less, and make the program save within it")
    return Check("command grace", PASS, f"train.command_grace_s = {t.command_grace_s:g} s fits "
                 + (", ".join(windows) or "(no SLURM window known)"))


def _preemption_check(cfg: JobConfig, name: str, part: dict[str, str]) -> Check:
    mode, grace = part.get("PreemptMode", "OFF").upper(), part.get("GraceTime", "0")
    if not cfg.slurm.requeue:
        return Check("preemption", WARN, "slurm.requeue = false: after a time limit or a "
                     "preemption the job stops for good", "set slurm.requeue = true to come back")
    if "REQUEUE" in mode:
        lost = "" if grace.isdigit() and int(grace) > 0 else \
            " at once (GraceTime=0): the work since the last periodic checkpoint is lost"
        return Check("preemption", WARN if lost else PASS,
                     f"'{name}' requeues preempted jobs{lost or f' after SIGTERM + GraceTime {grace}s'}",
                     "set checkpoint.every_minutes (e.g. 10)" if lost else "")
    if "CANCEL" in mode:
        return Check("preemption", WARN, f"'{name}' cancels preempted jobs (PreemptMode={mode})",
                     "resubmit the same run dir to resume, or use a partition with "
                     "PreemptMode=REQUEUE")
    return Check("preemption", PASS, f"PreemptMode={mode} in '{name}'")


def measured_checkpoint_s(cfg: JobConfig, runs_root: Path) -> float | None:
    """How long this job's recent checkpoints took to write, from the files' times: ranks write
    their files, then rank 0 writes manifest.json last. None when no earlier run has one."""
    manifests = [*runs_root.glob(f"{cfg.name}-*/checkpoints/step-*/manifest.json"),
                 *runs_root.glob("checkpoints/step-*/manifest.json")]  # --run-dir of an old run
    worst = None
    for m in sorted(manifests, key=lambda p: p.stat().st_mtime)[-5:]:
        try:
            firsts = [p.stat().st_mtime for p in m.parent.iterdir() if p.is_file() and p != m]
            took = m.stat().st_mtime - min(firsts)
        except (OSError, ValueError):
            continue
        worst = max(worst or 0.0, took)
    return worst


def signal_routing(signal: str, sbatch_extra: Sequence[str], lead_s: object = "?") -> Check:
    """Where the warning signal goes. Takes raw values: config validation rejects a B: signal
    at load time, and doctor still explains why it would break the job."""
    sig = str(signal).upper().removeprefix("SIG")
    from ddpjob.scriptsafe import reserved_by_prefix, split_extra

    # sbatch expands abbreviations (--sig=B:USR2@60 is --signal): look at what sbatch would see.
    culprits = ([f"slurm.signal = {signal!r}"] if "B:" in sig else []) + [
        f"slurm.sbatch_extra '{a}'" for a in sbatch_extra
        if str(a).startswith("--") and split_extra(str(a))[0]
        and reserved_by_prefix(split_extra(str(a))[0]) == "signal"
        and "B:" in str(split_extra(str(a))[1] or "").upper()]
    if culprits:
        return Check("signal routing", FAIL, f"{culprits[0]} would signal only the batch shell, and "
                     "srun does not pass signals on to the training tasks: they would be killed "
                     "at the limit without a checkpoint", "drop the B: and any --signal in "
                     "sbatch_extra: ddpjob sends slurm.signal (USR2) to every task "
                     "slurm.signal_lead_s before the limit")
    return Check("signal routing", PASS, f"SIG{sig} reaches every task {lead_s} s before the "
                 f"limit (--signal={sig}@{lead_s}, no B:)")


def _raw_signal_routing(job: str, overrides: Sequence[str]) -> Check | None:
    """After a failed resolve: the routing check on the job file's raw values, if readable."""
    from ddpjob.jobfile import apply_overrides, tomllib

    try:
        raw = apply_overrides(tomllib.loads(Path(job).read_text(encoding="utf-8")), overrides)
        s = raw.get("slurm", {})
        extra = s.get("sbatch_extra", [])
        check = signal_routing(str(s.get("signal", "USR2")),
                               [extra] if isinstance(extra, str) else list(extra))
    except (OSError, ValueError, UsageError, AttributeError, TypeError):
        return None
    return check if check.status == FAIL else None


def _signal_checks(cfg: JobConfig, measured_s: float | None = None) -> list[Check]:
    s = cfg.slurm
    out = [signal_routing(s.signal, s.sbatch_extra, s.signal_lead_s)]
    lead = s.signal_lead_s
    took = f"; this job's last checkpoints took up to {measured_s:.1f} s" if measured_s else ""
    if lead < MIN_LEAD_S:
        out.append(Check("signal lead", WARN, f"slurm.signal_lead_s = {lead}: under {MIN_LEAD_S} s "
                         f"a checkpoint may not be written before SLURM kills the job{took}",
                         "set slurm.signal_lead_s to 120 or more"))
    elif measured_s and lead < 3 * measured_s:  # slow filesystems vary: keep a 3x margin
        out.append(Check("signal lead", WARN, f"slurm.signal_lead_s = {lead}{took}: little margin",
                         f"set slurm.signal_lead_s to at least {int(3 * measured_s) + 1}"))
    else:
        out.append(Check("signal lead", PASS, f"{lead} s to checkpoint before the kill{took}"))
    return out


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
    return out + _partition_checks(cfg) + _signal_checks(cfg, measured_s) + [port_check()]


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
            routing = _raw_signal_routing(args.job, args.overrides)
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
