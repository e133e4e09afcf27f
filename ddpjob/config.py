"""The job's schema: frozen dataclasses (JobConfig and its sections) and the resume identity.

Every field of every section declares whether a resume must match it (Match / Free / MatchIfSet),
and JobConfig.hash() is built from those declarations alone. Reading a job file, `--set`
overrides, the resource flags and RUN_DIR/config.json into a validated JobConfig is jobfile.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from ddpjob.errors import UsageError


def field_key(f: dataclasses.Field) -> str:  # TOML key of a field ("async" is a Python keyword)
    return str(f.metadata.get("key", f.name))


# The resume identity, declared by every field of every section: a checkpoint resumes only under
# a config whose Match fields are all equal (JobConfig.hash: no list of keys to leave out). A
# field that declares nothing fails hash() and tests/unit/test_config.py (which pins jobs/*.toml's).
T = TypeVar("T")
MATCH, FREE, MATCH_IF_SET = "resume: match", "resume: free", "resume: match unless default"
Match = Annotated[T, MATCH]  # what is trained: model, data, optimisation, the entry
# how, how long, where: may change at a resume (which then continues the run close to, not
# always bit-equal to, the uninterrupted one, as an elastic resume does)
Free = Annotated[T, FREE]
# Match, for a field added after runs existed: at its default it is left out of the hash, which
# is then the one those runs had, so they still resume. Its default must therefore be what runs
# did before the field existed (and never change); another value is another training
MatchIfSet = Annotated[T, MATCH_IF_SET]


@dataclass(frozen=True)
class SlurmConfig:
    """Resources and SLURM behaviour (`[slurm]`)."""

    nodes: Free[int] = 1
    tasks_per_node: Free[int] = 1
    gpus_per_node: Free[int] = 0  # 0 = CPU job
    cpus_per_task: Free[int] = 1
    mem: Free[str] = ""  # e.g. "32G"; "" = the partition's default
    partition: Free[str] = ""
    account: Free[str] = ""
    qos: Free[str] = ""
    time: Free[str] = "01:00:00"
    constraint: Free[str] = ""
    signal: Free[str] = "USR2"  # sent to every task `signal_lead_s` before the time limit
    signal_lead_s: Free[int] = 120
    max_requeues: Free[int] = 20  # requeues after preemptions and time limits
    # crashes the cluster caused (a rank killed by a signal, a lost node, a peer gone, a stall)
    # retried inside the allocation from the newest in-memory snapshot, about 2 s each (bench P12).
    # 20, like max_requeues: a cap, not the guard. A retry that gets nowhere is stopped sooner by
    # max_no_progress and by the same SIGKILL at the same step twice (ledger/policy.py); the cap
    # bounds a job that keeps failing while it makes progress: at 20, one that loses a node every
    # hour still trains for a day in one submission. 0: a crash ends the run FAILED
    max_failures: Free[int] = 20
    # an exception in the user's own code is theirs: not retried, whatever max_failures says
    # (a passing I/O error of a shared file system is retried once); true retries it like a
    # crash the cluster caused
    retry_user_errors: Free[bool] = False
    # this many crashes in a row that got no further than the checkpoint they resumed from end
    # the job before max_failures is spent (a crash loop: the same step keeps failing)
    max_no_progress: Free[int] = 3
    # a host whose ranks died by a signal (kill -9, the OOM killer, a segfault) or that failed
    # this many times is left out of the next restart inside the allocation (0: never)
    exclude_after: Free[int] = 2
    # a node lost from the allocation: "requeue" (SLURM requeues the job, which resumes from its
    # checkpoint, wherever it starts next) or "continue" (sbatch --no-kill: the job keeps its
    # allocation, the ranks run again inside it on the nodes left, a spare taking the lost node's
    # place, else at the smaller world size; spends max_failures like a crash)
    on_node_loss: Free[str] = "requeue"
    spare_nodes: Free[int] = 0  # nodes allocated beyond `nodes`, unused until one replaces a lost node
    # a rank the straggler watch names (cause compute or data, [train] straggler_window): "off" (said
    # only), "exclude" (every rank stops at one step with a checkpoint and restarts inside the
    # allocation without its host: a spare takes its place, else fewer nodes carry on) or "requeue"
    # (the same stop, then the job is requeued with the host excluded through SLURM)
    on_straggler: Free[str] = "off"
    straggler_exclude_every: Free[int] = 1000  # steps of progress between two such actions at least
    # on CPUs, without a container, with max_failures > 0 or tasks_per_node > 1: one process per
    # node keeps torch imported and forks every attempt's ranks (node/warm.py), so a restart skips
    # torch's start-up and a node imports torch once, not once per rank (slurmopts.warm_start)
    warm_start: Free[bool] = True
    setup: Free[tuple[str, ...]] = ()  # shell lines before the job (module load ...), written verbatim
    sbatch_extra: Free[tuple[str, ...]] = ()  # extra "--option=value" sbatch arguments
    requeue: Free[bool] = True
    share_group: Free[bool] = False  # run dirs 0750 / files 0640 (group can read) instead of 0700 / 0600
    container: Free[str] = ""  # image the ranks run in ("" = none): pyxis image name or apptainer .sif/URI
    container_runtime: Free[str] = "pyxis"  # pyxis (srun --container-image) | apptainer | singularity
    container_mounts: Free[tuple[str, ...]] = ()  # extra "SRC" or "SRC:DST" (run dir, data, code: automatic)
    container_python: Free[str] = ""  # "" = the submitting interpreter (mounted); else e.g. "python3"

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class TrainConfig:
    """Model, optimisation and the training loop (`[train]`)."""

    model: Match[str] = "resnet18"  # torchvision name, built-in (cnn_tiny, resnet8) or "pkg.mod:fn"
    num_classes: Match[int] = 10
    cifar_stem: Match[bool] = True  # 3x3 stride-1 first conv, no max-pool (32x32 images)
    pretrained: Match[str] = ""  # local weights file
    freeze_backbone: Match[bool] = False
    epochs: Free[int] = 1
    max_steps: Free[int] = 0  # > 0: stop after this many optimizer steps (wins over epochs)
    batch_size: Free[int] = 128  # per rank, per micro-step
    global_batch_size: Match[int] = 0  # > 0: accumulation = global / (batch_size * world_size)
    accumulation_steps: Free[int] = 1
    optimizer: Match[str] = "sgd"  # sgd | adamw
    lr: Match[float] = 0.1
    momentum: Match[float] = 0.9
    nesterov: Match[bool] = True
    weight_decay: Match[float] = 5e-4
    warmup_steps: Match[int] = 0
    warmup_epochs: Match[float] = 0.0
    schedule: Match[str] = "cosine"  # cosine | step | constant
    lr_step_epochs: Match[int] = 30  # schedule = step
    lr_gamma: Match[float] = 0.1
    amp: Match[str] = "auto"  # auto (bf16 where supported) | bf16 | fp16 | off
    sync_batchnorm: Match[bool] = False
    channels_last: Match[bool] = True
    compile: Match[bool] = False
    # torch.compile's mode (train.compile = true): "auto" = "reduce-overhead" on GPUs (the step
    # recorded as CUDA graphs: one launch per graph instead of one per kernel; 1.9-2.3x a
    # launch-bound ResNet-18 step on an H200, bench P8) and "default" on CPUs; or any of those, or
    # "max-autotune-no-cudagraphs" / "max-autotune" (kernel variants timed while compiling)
    compile_mode: Free[str] = "auto"
    grad_clip: Match[float] = 0.0  # max grad norm; 0 = off
    label_smoothing: Match[float] = 0.0
    seed: Match[int] = 0
    eval_every: Free[int] = 0  # optimizer steps; 0 = end of each epoch (and always at the end)
    log_every: Free[int] = 10
    tensorboard: Free[bool] = False  # rank 0 also writes job.log() records to RUN_DIR/tb/ (extra: tensorboard)
    # "" = off; "PATH.prom": rank 0 keeps the run's series there for node_exporter's textfile
    # collector while it trains (docs/openmetrics.md; relative: under the run dir; extra: openmetrics)
    metrics_textfile: Free[str] = ""
    # experiment trackers rank 0 logs job.log()'s records to, one tracker run across requeues,
    # restarts and resumes (docs/trackers.md): "wandb", "mlflow" (extras: wandb, mlflow)
    trackers: Free[tuple[str, ...]] = ()
    tracker_project: Free[str] = ""  # the W&B project / MLflow experiment; "" = the job's name
    mlflow_uri: Free[str] = ""  # MLflow's tracking URI; "" = MLflow's own (MLFLOW_TRACKING_URI)
    backend: Free[str] = "auto"  # process group: auto | nccl | gloo
    threads: Free[int] = 0  # torch threads per rank; 0 = SLURM cpus_per_task, else 1
    dist_timeout_s: Free[int] = 300
    deterministic_reduce: Free[bool] = True  # >2 ranks: sum gradients in rank order (bit-exact resume)
    grad_compression: Free[str] = "none"  # none | bf16: DDP's gradient all-reduce sends bfloat16 (half the bytes)
    # GPUs: deterministic cuDNN/cuBLAS kernels, no cuDNN autotuning (bit-exact resume; maybe slower
    # convolutions); an operation without a deterministic kernel stops the run with one line.
    # false: cudnn.benchmark on. CPU: no measurable cost (node/determinism.py)
    deterministic: Free[bool] = True
    # ddp: every rank holds the whole model (DistributedDataParallel); fsdp: parameters, gradients
    # and optimizer state sharded over the ranks (FSDP2 fully_shard), checkpoints through DCP
    strategy: MatchIfSet[str] = "ddp"
    # overlap: the stop vote after step s travels while step s+1 runs and is read after it (a
    # stop lands one step later, nothing on the critical path); sync: read at once (one blocking
    # all-reduce per step, the stop one step sooner: for steps of minutes under a short GraceTime)
    stop_vote: Free[str] = "overlap"
    # a rank whose work per step (its arrival at the gradient all-reduce, less its waits for a
    # core) stays above the others' over straggler_window steps, step by step, by more than the
    # run's own variation allows (3 standard errors of the window's median difference) and by at
    # least this share of their median is named, with its host and the cause: compute or data; a
    # host whose ranks wait for a core is named instead of a rank (rank/straggler.py);
    # straggler_window = 0: off
    straggler_threshold: Free[float] = 0.15
    straggler_window: Free[int] = 20
    # the whole job slower than its own baseline (the median step over slowdown_window steps
    # after the warm-up, kept across requeues) by more than this share, for a window: one line
    # and a `slowdown` event saying what moved (rank/slowdown.py); slowdown_window = 0: off
    slowdown_threshold: Free[float] = 0.3
    slowdown_window: Free[int] = 50
    log_sample_ids: Free[bool] = False  # each rank logs its samples per step to RUN_DIR/samples/ (tests)
    entry: Match[str] = ""  # "" = the built-in trainer; "path/to/script.py" or "package.module:function"
    args: Match[tuple[str, ...]] = ()  # sys.argv[1:] of the entry
    # [user] keys that may change at a resume, as max_steps may for the trainer (a script's own
    # step budget, its log interval): left out of the hash. The list itself is part of the run's
    # identity once set (declared at submission); at its default () the hash is what runs had
    user_free: MatchIfSet[tuple[str, ...]] = ()
    # A plain command instead of an entry (docs/commands.md): each rank runs it as one child process,
    # no shell, with torchrun's variables; e.g. ["python", "train.py", "--out_dir", "out"]
    command: MatchIfSet[tuple[str, ...]] = ()
    command_signal: Free[str] = "TERM"  # what the command gets before the time limit and on preemption
    command_grace_s: Free[float] = 60.0  # then this long to save and exit, then SIGKILL
    command_requeue_exit: Free[int] = 3  # the command's exit status that means "requeue me"
    command_hang_s: Free[float] = 1800.0  # no output nor heartbeat this long: a hang (0: off)
    # the command's working directory ("": the directory the job was submitted from; relative:
    # to it); "{run_dir}" and "{attempt}" are filled in here and in `command`'s arguments
    command_cwd: Free[str] = ""
    # a file or folder the program writes as it gets on (its checkpoint, "out/"; relative to
    # command_cwd): the progress evidence of a program that logs no steps (a crash loop is a crash
    # that left it unchanged); "": the program's last line of output
    command_progress: Free[str] = ""


@dataclass(frozen=True)
class DataConfig:
    """Dataset (`[data]`)."""

    dataset: Match[str] = "synthetic"  # cifar10 | synthetic | "pkg.mod:fn" returning a Dataset
    root: Free[str] = "data"
    augment: Match[bool] = True
    num_workers: Free[int] = 0  # plugin datasets only (cifar10/synthetic live on the device)
    synthetic_train: Match[int] = 4096
    synthetic_test: Match[int] = 1024


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints and resume (`[checkpoint]`)."""

    every_steps: Free[int] = 0  # 0 = only when stopping and at the end
    every_minutes: Free[float] = 0.0
    keep_last: Free[int] = 3
    async_save: Free[bool] = field(default=False, metadata={"key": "async"})
    # > 0: every this many steps each rank's state also goes to node-local memory (/dev/shm) in
    # the background; a crash retried inside the allocation resumes from it (store/memsnap.py).
    # "auto": for a job that may restart (slurm.max_failures > 0), every as many steps as keep a
    # snapshot within 1% of the step time, measured at each start (store/snapauto.py); 0: never
    snapshot_every: Free[int | str] = "auto"
    # where they go: a node-local memory file system (tmpfs) for speed; each rank keeps at most
    # 2 there, fewer (or none) when its node's ranks would not fit in it or in the job's memory
    snapshot_dir: Free[str] = "/dev/shm"
    resume: Free[bool] = True
    # A fresh run (nothing to resume) starts from another run's checkpoint: "RUN_DIR" (its newest
    # valid one), "RUN_DIR/checkpoints/step-N", or a weights file ("model.pt": a state_dict).
    init_from: Free[str] = ""
    init_keys: Free[tuple[str, ...]] = ("model",)  # what to take from a checkpoint: + "optimizer", ...


@dataclass(frozen=True)
class JobConfig:
    name: Free[str] = "ddpjob"
    slurm: Free[SlurmConfig] = field(default_factory=SlurmConfig)  # resources: elastic resume
    train: Match[TrainConfig] = field(default_factory=TrainConfig)  # as each of its fields says
    data: Match[DataConfig] = field(default_factory=DataConfig)  # as each of its fields says
    checkpoint: Free[CheckpointConfig] = field(default_factory=CheckpointConfig)
    # The job file's free-form [user] table: the entry script's own settings (job.user).
    user: Match[Mapping[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {field_key(f): _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def hash(self) -> str:
        """What must match for a checkpoint to be resumed: the Match fields (resources may change:
        elastic resume). A section declared Match contributes its own fields' declarations."""
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]

    def identity(self) -> dict[str, Any]:
        """What hash() is taken of: the Match fields, less the [user] keys train.user_free names."""
        out = _identity(self)
        if self.train.user_free:
            out["user"] = {k: v for k, v in out["user"].items() if k not in self.train.user_free}
        return out


def differences(old: JobConfig, new: JobConfig) -> list[str]:
    """Each key of the resume identity whose value differs, "train.lr 0.1 -> 0.2" (a key one
    side lacks shows as "(unset)"), for the lines that refuse another job's run dir or checkpoint."""
    return identity_differences(old.identity(), new.identity())


def identity_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """differences() of two identity() trees (a checkpoint's manifest keeps its run's)."""
    def flat(tree: Mapping[str, Any], at: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            if isinstance(v, Mapping) and v:
                out.update(flat(v, f"{at}{k}."))
            else:
                out[f"{at}{k}"] = v
        return out

    a, b = flat(old), flat(new)
    unset = "(unset)"
    return [f"{k} {json.dumps(a.get(k, unset))} -> {json.dumps(b.get(k, unset))}"
            for k in sorted(set(a) | set(b)) if a.get(k, unset) != b.get(k, unset)]


@functools.cache  # a class's annotations do not change; hash() is taken at every save
def resume_rule(cls: type, name: str) -> str | None:
    """MATCH, FREE or MATCH_IF_SET, as field `name` of `cls` declares it; None if it declares nothing."""
    meta = getattr(typing.get_type_hints(cls, include_extras=True)[name], "__metadata__", ())
    return next((m for m in meta if m in (MATCH, FREE, MATCH_IF_SET)), None)


def _identity(obj: Any, free: bool = False) -> dict[str, Any]:
    """The fields of `obj` that a resume must match, as plain values. Every field of the tree is
    looked at: one that declares nothing, or says Match inside a Free section (which would ignore
    it), is ddpjob's mistake, caught by the tests."""
    out, cls = {}, obj.__class__
    for f in dataclasses.fields(obj):
        rule, value = resume_rule(cls, f.name), getattr(obj, f.name)
        if rule is None:
            raise AssertionError(f"{cls.__name__}.{f.name} declares no resume rule")
        if free and rule != FREE:
            raise AssertionError(f"{cls.__name__}.{f.name} says '{rule}' inside a Free section")
        nested = _identity(value, free or rule == FREE) if dataclasses.is_dataclass(value) else None
        if free or rule == FREE or (rule == MATCH_IF_SET and value == f.default):
            continue
        out[field_key(f)] = _to_plain(value) if nested is None else nested
    return out


SECTIONS: dict[str, type] = {
    "slurm": SlurmConfig, "train": TrainConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
}


def _to_plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {field_key(f): _to_plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, Mapping):
        return {k: _to_plain(x) for k, x in v.items()}
    return v


def accumulation_for(cfg: JobConfig, world_size: int) -> int:
    """Micro-steps per optimizer step at this world size (global batch wins when set)."""
    t = cfg.train
    if not t.global_batch_size:
        return t.accumulation_steps
    per_step = t.batch_size * world_size
    if t.global_batch_size % per_step:
        raise UsageError(f"global batch {t.global_batch_size} cannot be split over {world_size} "
                         f"ranks x batch_size {t.batch_size}, expected a multiple of {per_step}",
                         "choose a world size or batch_size that divides the global batch")
    return t.global_batch_size // per_step


