"""`ddpjob doctor`'s questions to SLURM itself (launch/doctor.py runs them): the cluster's (tools,
controller, accounting, requeue policy) and the job's partition (state, nodes, time limit, GPUs,
CPUs, preemption, the [train] command's grace against GraceTime and KillWait). Login side: only
scontrol and sacct, through ddpjob.slurm.
"""

from __future__ import annotations

import re
import shutil

from ddpjob import slurm
from ddpjob.config import JobConfig
from ddpjob.launch.checks import FAIL, PASS, WARN, Check, one_cell, output, records
from ddpjob.validate import parse_time_s

TOOLS = ("sbatch", "srun", "scontrol", "sacct")


def limit_s(value: str) -> int | None:  # MaxTime: "UNLIMITED" / "INFINITE" or a SLURM time
    try:
        return parse_time_s(value)
    except ValueError:
        return None


def gres_gpus(gres: str) -> int:
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
def partition_checks(cfg: JobConfig) -> list[Check]:
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
    want, max_s = parse_time_s(s.time), limit_s(part.get("MaxTime", "UNLIMITED"))
    out.append(Check("time limit", PASS, f"{s.time} within MaxTime {part.get('MaxTime')}")
               if max_s is None or want <= max_s else
               Check("time limit", FAIL, f"slurm.time = {s.time}, above '{name}' MaxTime "
                     f"{part.get('MaxTime')}", f"set slurm.time <= {part.get('MaxTime')}: "
                     "the job checkpoints and requeues itself at the limit anyway"))
    ntext = output(slurm.run(["scontrol", "show", "node", "-o"], timeout=20))
    nodes = [n for n in records(ntext) if name in n.get("Partitions", "").split(",")]
    gres = {n.get("NodeName", "?"): gres_gpus(n.get("Gres", "")) for n in nodes}
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
    out.append(preemption_check(cfg, name, part))
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


def preemption_check(cfg: JobConfig, name: str, part: dict[str, str]) -> Check:
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
