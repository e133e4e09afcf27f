"""Job files: TOML -> frozen, validated dataclasses.

First step of the flow (CLI -> config -> render/submit -> nodes). The login node resolves the job
file plus `--set` overrides once and writes `RUN_DIR/config.json`; the nodes read only that, so
every rank and every restart trains with the same settings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

from ddpjob.errors import UsageError
from ddpjob.validate import ENTRY_SCRIPT, canonical_signal, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _key(f: dataclasses.Field) -> str:  # TOML key of a field ("async" is a Python keyword)
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
    max_failures: Free[int] = 0  # retries after crashes / node failures (0: a crash ends the run FAILED)
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
    # on CPUs, without a container, with max_failures > 0 or tasks_per_node > 1: one process per
    # node keeps torch imported and forks every attempt's ranks (node/warm.py), so a restart skips
    # torch's start-up and a node imports torch once, not once per rank (options.warm_start)
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
    # a rank whose work per step (its arrival at the gradient all-reduce) stays this much above
    # the ranks' median over straggler_window steps is named, with its host and the cause
    # (rank/straggler.py); straggler_window = 0: off
    straggler_threshold: Free[float] = 0.5
    straggler_window: Free[int] = 20
    log_sample_ids: Free[bool] = False  # each rank logs its samples per step to RUN_DIR/samples/ (tests)
    entry: Match[str] = ""  # "" = the built-in trainer; "path/to/script.py" or "package.module:function"
    args: Match[tuple[str, ...]] = ()  # sys.argv[1:] of the entry


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
    # snapshot within 1% of the step time, measured at each start (memsnap.AUTO); 0: never
    snapshot_every: Free[int | str] = "auto"
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
        return {_key(f): _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def hash(self) -> str:
        """What must match for a checkpoint to be resumed: the Match fields (resources may change:
        elastic resume). A section declared Match contributes its own fields' declarations."""
        return hashlib.sha256(json.dumps(_identity(self), sort_keys=True).encode()).hexdigest()[:16]


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
        out[_key(f)] = _to_plain(value) if nested is None else nested
    return out


SECTIONS: dict[str, type] = {
    "slurm": SlurmConfig, "train": TrainConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
}


def _to_plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {_key(f): _to_plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, Mapping):
        return {k: _to_plain(x) for k, x in v.items()}
    return v


_USER_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def _user_value(where: str, v: Any, depth: int = 0) -> Any:
    """[user] values: what TOML and JSON share (no dates), nested at most 4 deep."""
    if isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
        if isinstance(v, str) and len(v) > 4096:
            raise UsageError(f"{where} is a string of {len(v)} characters, expected at most 4096",
                             "keep long text in a file and put its path in [user]")
        return v
    if depth < 4 and isinstance(v, list) and len(v) <= 1000:
        return [_user_value(f"{where}[{i}]", x, depth + 1) for i, x in enumerate(v)]
    if depth < 4 and isinstance(v, Mapping) and len(v) <= 1000:
        return _user_table(where, v, depth + 1)
    raise UsageError(f"{where} is {v!r} ({type(v).__name__}), expected a string, number, boolean, "
                     "or a list or table of those", f"write e.g. {where.split('.')[-1]} = 0.1")


def _user_table(where: str, raw: Any, depth: int = 0) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise UsageError(f"'{where}' is {type(raw).__name__}, expected a table",
                         f"write it as a [{where}] section of key = value lines")
    out = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not _USER_KEY.fullmatch(k):
            raise UsageError(f"key {k!r} in [{where}] is not a plain name, expected letters, digits, "
                             "_ and - (at most 64)", "rename the key, e.g. lr or hidden_size")
        out[k] = _user_value(f"{where}.{k}", v, depth)
    return out


def _type_name(t: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            int | str: "an integer or a string"}.get(t, "a list of strings")


def _coerce(where: str, value: Any, t: Any) -> Any:
    """Check one value against a field's type; ints are accepted where floats are expected."""
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif t is str:
        ok = isinstance(value, str)
    elif t == int | str:  # a count or a word ("auto"): validate.py checks which
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
    else:  # tuple[str, ...]
        if isinstance(value, str):
            value = [value]
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        value = tuple(value) if ok else value
    if not ok:
        raise UsageError(f"{where} is {value!r} ({type(value).__name__}), expected {_type_name(t)}",
                         f"write e.g. {where.split('.')[-1]} = {_example(t)}")
    return value


def _example(t: Any) -> str:
    return {int: "4", float: "0.1", bool: "true", str: '"text"', int | str: "4"}.get(t, '["a", "b"]')


def _build_section(name: str, cls: type, raw: Mapping[str, Any], source: str) -> Any:
    hints = typing.get_type_hints(cls)
    by_key = {_key(f): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in by_key:
            raise UsageError(f"unknown key '{name}.{k}' in {source}, expected one of: "
                             f"{', '.join(sorted(by_key))}", _did_you_mean(k, list(by_key)))
        f = by_key[k]
        kwargs[f.name] = _coerce(f"{name}.{k}", v, hints[f.name])
    return cls(**kwargs)


def _did_you_mean(key: str, valid: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(valid), n=1)
    return f"did you mean '{close[0]}'?" if close else "check the spelling against the list"


def from_dict(raw: Mapping[str, Any], source: str = "the job file") -> JobConfig:
    """Build and validate a JobConfig from parsed TOML/JSON."""
    if not isinstance(raw, Mapping):
        raise UsageError(f"{source} holds {type(raw).__name__} {str(raw)[:40]!r}, expected a table "
                         "of sections (name, slurm, train, ...)",
                         "the run dir is damaged; resubmit" if source.endswith(".json")
                         else "start from jobs/smoke.toml")
    unknown = set(raw) - set(SECTIONS) - {"name", "user"}
    if unknown:
        k = sorted(unknown)[0]
        raise UsageError(f"unknown key '{k}' in {source}, expected one of: name, "
                         f"{', '.join(SECTIONS)}, user", _did_you_mean(k, ["name", *SECTIONS, "user"]))
    sections = {}
    for name, cls in SECTIONS.items():
        sec = raw.get(name, {})
        if not isinstance(sec, Mapping):
            raise UsageError(f"'{name}' in {source} is {type(sec).__name__}, expected a table",
                             f"write it as a [{name}] section")
        sections[name] = _build_section(name, cls, sec, source)
    name = _coerce("name", raw.get("name", "ddpjob"), str)
    cfg = JobConfig(name=name, user=_user_table("user", raw.get("user", {})), **sections)
    validate(cfg)
    return dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, signal=canonical_signal(cfg.slurm.signal)))


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`train.lr=0.05` -> raw['train']['lr'] = 0.05; values are TOML literals, bare words strings."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    # The job file's [user] table lists the script's settings: --set changes them, and a key it
    # lacks is a typo (user.lrr) unless there is no table to check against (ddpjob.init() alone)
    known_user = set(out["user"]) if isinstance(out.get("user"), Mapping) and out["user"] else None
    for item in overrides:
        path, value = parse_override(item)
        if len(path) == 1:
            out[path[0]] = value
        else:
            out.setdefault(path[0], {})
            if not isinstance(out[path[0]], dict):
                raise UsageError(f"override '{item}' targets '{path[0]}', which is not a section, "
                                 "expected section.key=value",
                                 "use --set section.key=value")
            old = out[path[0]].get(path[1])
            if path[0] == "user" and known_user is not None and path[1] not in known_user:
                raise UsageError(f"override '{item}' names user.{path[1]}, which the job file's [user] table "
                                 f"does not have, expected one of: {', '.join(sorted(known_user))}",
                                 _did_you_mean(path[1], sorted(known_user)) + " (a new setting goes into "
                                 "the job file's [user] table first)")
            if path[0] == "user" and isinstance(old, float) and type(value) is int:
                value = float(value)  # lr = 0.1 in the file, --set user.lr=1: still a float
            if path[0] == "user" and old is not None and not _same_kind(old, value):
                raise UsageError(f"override '{item}' gives user.{path[1]} a {type(value).__name__}, but "
                                 f"the job file has {old!r} ({type(old).__name__}), expected the same type",
                                 f"e.g. --set user.{path[1]}={json.dumps(old)}")
            out[path[0]][path[1]] = value
    return out


def _same_kind(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, int):  # max_steps = 300 stays an integer: 300.5 is a mistake
        return type(new) is int
    if isinstance(old, float):
        return isinstance(new, float)
    return type(old) is type(new)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise UsageError(f"override '{item}' has no '=', expected section.key=value",
                         "e.g. --set train.lr=0.05")
    key, text = item.split("=", 1)
    path = key.strip().split(".")
    if not (len(path) == 2 and (path[0] in SECTIONS or path[0] == "user") or path == ["name"]) \
            or not all(path):
        raise UsageError(f"override key '{key}' is not section.key, expected a section among "
                         f"{', '.join(SECTIONS)}, user (or 'name')", "e.g. --set train.lr=0.05")
    return path, parse_value(text)


def _too_big(where: str, exc: Exception) -> UsageError:
    """tomllib's own limits: an integer of more than 4300 digits (ValueError), lists or tables
    nested deeper than the interpreter recurses (RecursionError). Nothing is that large."""
    what = "an integer too long to read" if isinstance(exc, ValueError) else "values nested too deeply to read"
    return UsageError(f"{where} holds {what}, expected values of a sensible size",
                      "shorten the number or flatten the list")


def parse_value(text: str) -> Any:
    """A TOML literal (0.05, true, [1, 2], "x"); anything else is taken as a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        # A bare word is a string; but something that starts like a list, table or quoted
        # string and does not parse is a typo (a missing ] or quote), never a string.
        if text.lstrip()[:1] in ('[', '{', '"', "'"):
            raise UsageError(f"value {text[:80]!r} starts like a TOML list, table or string but "
                             f"does not parse ({exc}), expected a complete TOML literal",
                             "close the brackets and quotes, e.g. "
                             "--set 'slurm.setup=[\"echo a\", \"echo b\"]'") from None
        return text
    except (RecursionError, ValueError) as exc:  # after TOMLDecodeError, itself a ValueError
        raise _too_big(f"value {text[:40]!r}", exc) from None


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


# The resource flags of submit, sbatch, run, resume and doctor (--nodes, ...): (flag, its type,
# its help). Each sets the [slurm] key of its name, but --name the job's name. The parser, the
# mapping below and the command line recorded in job.json all read this one list.
CLI_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("nodes", int, "[slurm] nodes"),
    ("tasks_per_node", int, "[slurm] tasks_per_node (one rank each)"),
    ("gpus_per_node", int, "[slurm] gpus_per_node (0 = CPU job)"),
    ("partition", str, "[slurm] partition"),
    ("account", str, "[slurm] account"),
    ("qos", str, "[slurm] qos"),
    ("time", str, "[slurm] time limit, e.g. 04:00:00 or 1-00:00:00"),
    ("name", str, "job name"),
)


def cli_flags(args: Any) -> dict[str, Any]:
    """The resource flags as parsed (None = not given)."""
    return {flag: getattr(args, flag, None) for flag, _, _ in CLI_FLAGS}


def cli_flag_words(args: Any) -> list[str]:
    """The flags that were given, as command-line words again (for job.json)."""
    words = []
    for flag, value in cli_flags(args).items():
        if value is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    return words


def with_cli_flags(cfg_raw: dict[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """Map --nodes/--partition/... onto the raw dict before validation (None = not given)."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in cfg_raw.items()}
    for flag, _, _ in CLI_FLAGS:
        if flags.get(flag) is None:
            continue
        if flag == "name":
            out["name"] = flags[flag]
        else:
            out.setdefault("slurm", {})[flag] = flags[flag]
    return out


def resolve(job: str | Path, overrides: Sequence[str] = (), flags: Mapping[str, Any] | None = None
            ) -> JobConfig:
    """Job file + `--set` overrides + CLI flags -> validated config (flags win)."""
    from ddpjob import scriptsafe

    p = Path(scriptsafe.path_text(str(job), "job file", "pass a shorter path"))
    if not p.is_file():
        raise UsageError(f"job file '{job}' not found, expected a TOML file",
                         "the examples are in jobs/ (e.g. jobs/smoke.toml)")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"job file '{job}' is not valid TOML ({exc}), expected key = value lines "
                         "under [section] headers",
                         "check quotes and brackets near the position shown") from None
    except (RecursionError, ValueError) as exc:
        raise _too_big(f"job file '{job}'", exc) from None
    except OSError as exc:
        raise UsageError(f"cannot read job file '{job}' ({exc.strerror}), expected a readable file",
                         "check the path and its permissions") from None
    raw = apply_overrides(raw, overrides)
    raw = with_cli_flags(raw, flags or {})
    cfg = from_dict(raw, f"'{job}'")
    return _absolute_entry(cfg, p)


def _absolute_entry(cfg: JobConfig, job: Path) -> JobConfig:
    """A script entry is found relative to the working directory (like `python script.py`),
    then relative to the job file; the nodes get its absolute path."""
    entry = cfg.train.entry
    if not ENTRY_SCRIPT.fullmatch(entry):
        return cfg
    for base in (Path.cwd(), job.resolve().parent):
        script = base / entry
        if script.is_file():
            return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, entry=str(script.resolve())))
    raise UsageError(f"train.entry script '{entry}' not found (looked in {Path.cwd()} and "
                     f"{job.resolve().parent}), expected an existing Python file",
                     "give the path relative to where you run ddpjob, or to the job file")


def from_json(text: str, source: str = "config.json") -> JobConfig:
    return from_dict(json.loads(text), source)


def read_run_config(run_dir: str | Path) -> JobConfig:
    p = Path(run_dir) / "config.json"
    try:
        return from_json(p.read_text(encoding="utf-8"), str(p))
    except FileNotFoundError:
        raise UsageError(f"'{run_dir}' has no config.json, expected a ddpjob run directory",
                         "pass a job file (TOML) or a run dir made by `ddpjob submit`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{p} is not valid JSON ({exc}), expected the config written by ddpjob",
                         "the run dir is damaged; resubmit") from None
    except OSError as exc:
        raise UsageError(f"cannot read {p} ({exc.strerror}), expected a readable config.json",
                         "check the run dir's permissions") from None
