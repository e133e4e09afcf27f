"""What a restart in place needs, checked on the login node (`ddpjob doctor`): room for the
in-memory snapshots in checkpoint.snapshot_dir on the partition's nodes, whether SLURM gives each
job its own /dev/shm, and the job's memory limit (or, where SLURM tracks no memory, the nodes'
memory) against its ranks plus their snapshots. The sizes come from an earlier run's checkpoint,
or for the built-in trainer from its model; the ranks apply the same rule at their first
snapshot (store/snaproom.py: keep 2, 1 or none).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddpjob import modelnames, slurm
from ddpjob.config import JobConfig
from ddpjob.launch.checks import FAIL, PASS, WARN, Check, output, records
from ddpjob.store import manifest, memsnap, snaproom

# A rank's host memory before its model and data: torch 2.14.1 (the CUDA build) + ddpjob's rank
# layer peaked at 636 MiB RSS on the 2-core test VM (/usr/bin/time -v); CUDA's host side adds
# about 2 GiB more (an estimate: its libraries and context). Activations are not counted.
RANK_BASE = {"cpu": 650 << 20, "gpu": 3 << 30}
OPTIMIZER_SLOTS = {"sgd": 1, "adamw": 2}  # fp32 values per parameter: momentum; Adam's two moments
RNG_BYTES = 64 << 10  # a rank's RNG file and the plain values, rounded up
IMAGE_BYTES = 3 * 32 * 32  # a CIFAR-format image as uint8, on the device


def _slurm_mem(text: str) -> int | None:
    """A SLURM memory size ("4000" MB, "32G", "4000M", "UNLIMITED", "0") in bytes, or None."""
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not m or int(m.group(1)) == 0:
        return None
    return int(m.group(1)) << {"K": 10, "": 20, "M": 20, "G": 30, "T": 40}[m.group(2)]


def state_estimate(cfg: JobConfig, runs_root: Path) -> tuple[int | None, str]:
    """(bytes of one rank's snapshot, how that was found). Measured from the newest checkpoint of
    an earlier run of this job (its files, with the RNG file twice: each snapshot keeps a peer's
    too); else, for the built-in trainer, estimated from the model's parameter count (fp32
    weights + the optimizer's per-parameter state + the RNG); else unknown."""
    manifests = sorted(runs_root.glob(f"{cfg.name}-*/checkpoints/step-*/manifest.json"),
                       key=lambda p: p.stat().st_mtime)
    for m in reversed(manifests[-5:]):
        files = manifest.read(m.parent).get("files", {})
        sizes = {n: int(f.get("size", 0)) for n, f in files.items() if isinstance(f, dict)}
        ranks = [v for n, v in sizes.items() if re.fullmatch(r"rank-\d+\.pt", n)]
        if sizes:
            total = sum(v for n, v in sizes.items() if not re.fullmatch(r"rank-\d+\.pt", n))
            return total + 2 * max(ranks, default=0), f"measured from {m.parent}"
    t = cfg.train
    params = modelnames.PARAMS.get(t.model)
    if t.entry or params is None:
        return None, ("unknown (a train.entry of your own and no earlier run of this job to measure): "
                      "the ranks measure it at their first snapshot")
    slots = 0 if t.optimizer == "sgd" and t.momentum == 0 else OPTIMIZER_SLOTS.get(t.optimizer, 2)
    return (params * 4 * (1 + slots) + RNG_BYTES,
            f"estimated: {t.model} has {params / 1e6:.2f} M parameters x 4 bytes x (weights + "
            f"{slots} {t.optimizer} slot(s)) + RNG")


def rank_use(cfg: JobConfig, state: int | None) -> int:
    """One rank's expected host memory without snapshots: RANK_BASE, and on CPUs the model
    (weights, gradients, optimizer state: state + gradients ~ state + weights) and the data set."""
    if cfg.slurm.gpus_per_node:
        return RANK_BASE["gpu"]
    d = cfg.data
    images = {"cifar10": 60_000, "synthetic": d.synthetic_train + d.synthetic_test}.get(d.dataset, 0)
    params = modelnames.PARAMS.get(cfg.train.model, 0) if not cfg.train.entry else 0
    return RANK_BASE["cpu"] + (state or 0) + params * 4 + images * IMAGE_BYTES


def _snapshots_on(cfg: JobConfig) -> bool:  # as the ranks decide (memsnap.for_rank, StateStore)
    return memsnap.interval(cfg) != 0 and cfg.train.strategy != "fsdp"


def snapshot_room_check(cfg: JobConfig, state: tuple[int | None, str], room: int | None,
                        where: str) -> Check:
    """The folder's free `room` (measured `where`) against the node's ranks x kept snapshots x
    state: snaproom.keep_for, the rule the ranks apply at their first snapshot."""
    folder = cfg.checkpoint.snapshot_dir
    if not _snapshots_on(cfg):
        why = ("strategy = \"fsdp\"" if cfg.train.strategy == "fsdp" else "snapshot_every = 0"
               if cfg.checkpoint.snapshot_every != "auto" else
               "snapshot_every = \"auto\" with slurm.max_failures = 0: no restart in place")
        return Check("snapshot room", PASS, f"no in-memory snapshots ({why}): nothing is kept in {folder}")
    size, how = state
    if size is None:
        return Check("snapshot room", PASS, f"snapshot size {how}; {snaproom.size_text(room or 0)} free in {folder} {where}")
    ranks = cfg.slurm.tasks_per_node
    full = snaproom.need(size, ranks)
    sums = f"{ranks} rank(s) x {snaproom.KEEP + 1} x {snaproom.size_text(size)} = {snaproom.size_text(full)} ({how})"
    if room is None:
        return Check("snapshot room", WARN, f"{sums}; {folder} could not be measured {where}",
                     "check that checkpoint.snapshot_dir exists on the nodes (df)")
    keep = snaproom.keep_for(size, ranks, room, None)
    if keep == snaproom.KEEP:
        return Check("snapshot room", PASS, f"{sums} fits: {snaproom.size_text(room)} free in {folder} {where}")
    hint = (f"free room in {folder}, or point checkpoint.snapshot_dir at a larger node-local tmpfs, "
            "or fewer tasks_per_node")
    if keep:
        return Check("snapshot room", WARN, f"{sums}, {snaproom.size_text(room)} free in {folder} {where}: the ranks "
                     "will keep 1 snapshot instead of 2", hint)
    return Check("snapshot room", FAIL, f"{sums}, only {snaproom.size_text(room)} free in {folder} {where}: the "
                 "ranks will take no snapshots, a restart in place resumes from the last checkpoint", hint)


def shm_privacy_check(config_text: str, folder: str) -> Check:
    """Whether SLURM gives each job its own /dev/shm (job_container/tmpfs, namespace/tmpfs): the
    snapshots then end with the job, which in-place restarts (same job) do not mind."""
    m = re.search(r"\bJobContainerType\s*=\s*(\S+)", config_text)
    if not m:
        return Check("private /dev/shm", WARN, "JobContainerType not found in `scontrol show config`",
                     "check `scontrol show config | grep JobContainerType`")
    kind, where = m.group(1), folder.rstrip("/") + "/"
    if kind.endswith("/tmpfs") and where.startswith(("/dev/shm/", "/tmp/")):  # what the plugin mounts
        return Check("private /dev/shm", PASS, f"{folder} is private to each job ({kind}): a snapshot "
                     "lives as long as the job, so it serves a restart inside the allocation, never a requeue")
    return Check("private /dev/shm", PASS, f"{folder} is shared by the node's jobs (JobContainerType="
                 f"{kind}): the job's snapshots are its user's only (0700) and removed at its end")


@dataclass(frozen=True)
class MemoryLimit:
    """What a node's ranks may use: `size` bytes (None: nothing known), where that comes from,
    and whether SLURM holds the job to it (a limit it reserves and enforces), or it is only the
    nodes' memory as SLURM is told it, which a cluster that tracks no memory neither reserves
    for the job nor enforces."""

    size: int | None
    source: str
    enforced: bool = True


def memory_limit(cfg: JobConfig, part: dict[str, str], config: dict[str, str],
                 nodes: Sequence[dict[str, str]]) -> MemoryLimit:
    """slurm.mem, else the partition's (then the cluster's) DefMemPerNode / DefMemPerCPU x CPUs,
    capped by MaxMemPerNode; else the nodes' RealMemory: the job's whole share where SLURM tracks
    memory, and the most there is where it does not. Never the nodes' FreeMem: it leaves out the
    page cache the kernel gives back on demand, so it says how busy a node's files were, not what
    the ranks can have (a good job FAILed against 437 MiB "free" on a host with 23 GB available)."""
    s = cfg.slurm
    cpus = s.cpus_per_task * s.tasks_per_node
    limit, src = (_slurm_mem(s.mem), f"slurm.mem = {s.mem}") if s.mem else (None, "")
    for rec in (part, config):
        if limit is None and _slurm_mem(rec.get("DefMemPerNode", "")):
            limit, src = _slurm_mem(rec["DefMemPerNode"]), f"DefMemPerNode={rec['DefMemPerNode']}"
        if limit is None and _slurm_mem(rec.get("DefMemPerCPU", "")):
            limit = (_slurm_mem(rec["DefMemPerCPU"]) or 0) * cpus
            src = f"DefMemPerCPU={rec['DefMemPerCPU']} x {cpus} CPU(s)"
    cap = next((_slurm_mem(r["MaxMemPerNode"]) for r in (part, config) if _slurm_mem(r.get("MaxMemPerNode", ""))), None)
    if cap is not None and (limit is None or cap < limit):
        limit, src = cap, f"MaxMemPerNode={snaproom.size_text(cap)}"
    if limit is not None:
        return MemoryLimit(limit, src)
    known = [v for v in (_slurm_mem(n.get("RealMemory", "")) for n in nodes) if v]
    if not known:
        return MemoryLimit(None, "no memory limit found")
    if "MEMORY" in config.get("SelectTypeParameters", "").upper():
        return MemoryLimit(min(known), "the nodes' RealMemory: no --mem, no DefMem")
    return MemoryLimit(min(known), "the nodes' RealMemory; SLURM tracks no memory here, "
                       f"SelectTypeParameters={config.get('SelectTypeParameters', '?')}", enforced=False)


def memory_check(cfg: JobConfig, state: int | None, limit: MemoryLimit) -> Check:
    """The node's ranks' expected use plus their snapshots (tmpfs pages count against the job's
    memory cgroup, and each rank holds one copy in its snapshot pool) against the job's limit.
    Past a limit SLURM enforces: FAIL (the ranks alone) or WARN (fewer snapshots). Past the
    nodes' memory on a cluster that tracks none: WARN only, since nothing is reserved or enforced
    and the estimate (RANK_BASE) is a guess; what other jobs on the node use is not known."""
    mem, src = limit.size, limit.source
    s = cfg.slurm
    ranks = s.tasks_per_node
    use = ranks * rank_use(cfg, state)
    snaps = 0 if not _snapshots_on(cfg) or state is None else ranks * state + snaproom.need(state, ranks)
    sums = f"{ranks} rank(s) ~ {snaproom.size_text(use)}" + (f" + snapshots {snaproom.size_text(snaps)}" if snaps else "")
    if mem is None:
        return Check("memory limit", WARN, f"{sums}; {src}", "set slurm.mem (e.g. \"16G\")")
    if not limit.enforced and use + snaps > mem:
        return Check("memory limit", WARN, f"{sums} per node, more than {snaproom.size_text(mem)} ({src}): "
                     "nothing reserves memory for the job, and a node that runs short ends a rank "
                     "(the kernel's OOM killer)", "fewer tasks_per_node" + (
                         ", or checkpoint.snapshot_every = 0 (no in-memory snapshots)" if snaps else "")
                     + "; only a warning: SLURM enforces no limit here and the estimate is rough")
    if use > mem:
        return Check("memory limit", FAIL, f"{sums} per node, above the limit {snaproom.size_text(mem)} ({src}): "
                     "the ranks would be killed for memory", "raise slurm.mem, or fewer tasks_per_node")
    if use + snaps > mem:
        keep = snaproom.keep_for(state or 0, ranks, None, mem - use - ranks * (state or 0))
        return Check("memory limit", WARN, f"{sums} per node, above the limit {snaproom.size_text(mem)} ({src}): the "
                     f"ranks will keep {'1 snapshot instead of 2' if keep else 'no snapshots'}",
                     "raise slurm.mem to restart in place from a snapshot")
    return Check("memory limit", PASS, f"{sums} per node, within {snaproom.size_text(mem)} ({src})")


def restart_checks(cfg: JobConfig, runs_root: Path, node_room: tuple[int | None, str] | None = None) -> list[Check]:
    """What a restart in place needs: room for the snapshots (`node_room`: measured on a node by
    srun_check, else here), /dev/shm private or not, the memory limit. One line each."""
    state = state_estimate(cfg, runs_root)
    if node_room is None:
        node_room = (snaproom.free(Path(cfg.checkpoint.snapshot_dir)),
                     "here (`--srun` measures it on a node)")
    config_text = output(slurm.run(["scontrol", "show", "config"], timeout=20))
    config = dict(re.findall(r"^(\w+)\s*=\s*(\S+)", config_text, re.M))
    name = cfg.slurm.partition
    parts = records(output(slurm.run(["scontrol", "show", "partition", "-o"], timeout=20)))
    part = next((p for p in parts if (p.get("PartitionName") == name if name else p.get("Default") == "YES")), {})
    nodes = [n for n in records(output(slurm.run(["scontrol", "show", "node", "-o"], timeout=20)))
             if part.get("PartitionName", "") in n.get("Partitions", "").split(",")]
    return [snapshot_room_check(cfg, state, *node_room),
            shm_privacy_check(config_text, cfg.checkpoint.snapshot_dir),
            memory_check(cfg, state[0], memory_limit(cfg, part, config, nodes))]
