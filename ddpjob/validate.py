"""validate(JobConfig): every value checked on the login node, before anything is built from it.

Called by jobfile.from_dict (job file, overrides, config.json alike). Sizes are bounded first,
so nothing later (a list of ranks, a rank table, SLURM's own limits) can grow without end; every
string that reaches a script goes through ddpjob.scriptsafe, the same rules the renderers apply.
A value the nodes would fail on (ZeroDivisionError, overflow, unknown model) fails here instead.
job_strings(cfg) is the one check of the strings that reach a script: validate() runs it, and the
renderers (launch/slurmopts.py) run it for a JobConfig built without validation; strings that
passed once are not checked again.
"""

from __future__ import annotations

import functools
import math
import re
from typing import TYPE_CHECKING

from ddpjob import scriptsafe
from ddpjob.errors import UsageError
from ddpjob.modelnames import model_problem

if TYPE_CHECKING:
    from ddpjob.config import JobConfig, TrainConfig

CONTAINER_RUNTIMES = ("pyxis", "apptainer", "singularity")  # launch/container.py
SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG", "XCPU", "QUIT", "ALRM")
# Names, partitions, accounts: what SLURM itself allows, and nothing a shell or a file pattern
# (%j) could interpret. fullmatch + ASCII: `$` would accept a final newline, \d other digits.
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", re.ASCII)
_CONSTRAINT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.,&|\[\]*:-]*", re.ASCII)
_MEM_RE = re.compile(r"[0-9]{1,12}[KMGT]?", re.ASCII)
# train.entry: a script path (no control characters) or an importable "package.module:function"
ENTRY_SCRIPT = re.compile(r"[^\x00-\x1f\x7f]{1,4000}\.py")
_ENTRY_FUNC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
MAX_TIME_S = 365 * 86400
# torch.compile's modes (train.compile_mode); bench P8 measures them on a GPU
TRACKERS = ("wandb", "mlflow")  # rank/trackers.py
COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
# Upper bounds (inclusive) for every size: far above any real job, far below anything that
# could exhaust memory on the login node or overflow a C int on the nodes.
LIMITS: dict[str, int] = {
    "slurm.nodes": 100_000, "slurm.tasks_per_node": 1024, "slurm.gpus_per_node": 64,
    "slurm.cpus_per_task": 4096, "slurm.max_requeues": 10_000, "slurm.max_no_progress": 10_000, "slurm.exclude_after": 10_000,
    "slurm.spare_nodes": 100_000, "slurm.straggler_exclude_every": 10**12,
    "train.num_classes": 1_000_000, "train.epochs": 1_000_000, "train.max_steps": 10**12,
    "train.batch_size": 1 << 20, "train.global_batch_size": 1 << 30,
    "train.accumulation_steps": 65_536, "train.warmup_steps": 10**12,
    "train.lr_step_epochs": 1_000_000, "train.seed": 2**32 - 1, "train.eval_every": 10**12,
    "train.log_every": 10**12, "train.threads": 1024, "train.dist_timeout_s": 7 * 86400,
    "data.num_workers": 256, "data.synthetic_train": 100_000_000,
    "data.synthetic_test": 100_000_000, "checkpoint.every_steps": 10**12,
    "checkpoint.keep_last": 10_000, "checkpoint.snapshot_every": 10**12, "train.straggler_window": 1_000_000,
    "train.slowdown_window": 1_000_000,
}
MAX_WORLD = 1 << 20
_POSITIVE = {"slurm.nodes", "slurm.max_no_progress", "slurm.straggler_exclude_every", "slurm.tasks_per_node", "slurm.cpus_per_task", "train.num_classes",
             "train.epochs", "train.batch_size", "train.accumulation_steps", "train.log_every",
             "train.dist_timeout_s", "train.lr_step_epochs", "data.synthetic_train",
             "data.synthetic_test", "checkpoint.keep_last"}


def _check(ok: bool, message: str, hint: str) -> None:
    if not ok:
        raise UsageError(message, hint)


def parse_time_s(value: str) -> int:
    """SLURM time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S -> seconds (ValueError if not)."""
    m = re.fullmatch(r"(?:([0-9]{1,4})-)?([0-9]{1,8})(?::([0-9]{1,8}))?(?::([0-9]{1,8}))?",
                     value, re.ASCII)
    if not m:
        raise ValueError(value)
    d, a, b, c = m.groups()
    if d is not None:  # D-H[:M[:S]]
        return int(d) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60  # M


def _sizes(cfg: JobConfig) -> None:
    sections = {"slurm": cfg.slurm, "train": cfg.train, "data": cfg.data,
                "checkpoint": cfg.checkpoint}
    for key, hi in LIMITS.items():
        section, field = key.split(".")
        v = getattr(sections[section], field)
        if isinstance(v, str):  # checkpoint.snapshot_every: a count or "auto"
            _check(v == "auto", f"{key} is {v!r}, expected a number of steps (0: never) or \"auto\"",
                   f'write {field} = "auto" or e.g. {field} = 20')
            continue
        lo = 1 if key in _POSITIVE else 0
        low = "a positive integer (>= 1)" if lo else ">= 0"
        _check(v >= lo, f"{key} is {v}, expected {low}", f"set {key} >= {lo}")
        _check(v <= hi, f"{key} is {v}, expected at most {hi}", f"set {key} to at most {hi}")
    s = cfg.slurm
    _check(s.world_size <= MAX_WORLD, f"slurm.nodes x tasks_per_node is {s.world_size} ranks, "
           f"expected at most {MAX_WORLD}", "use fewer nodes or tasks per node")
    t, c = cfg.train, cfg.checkpoint
    floats = {"train.lr": t.lr, "train.momentum": t.momentum, "train.weight_decay": t.weight_decay,
              "train.warmup_epochs": t.warmup_epochs, "train.lr_gamma": t.lr_gamma,
              "train.grad_clip": t.grad_clip, "train.label_smoothing": t.label_smoothing,
              "checkpoint.every_minutes": c.every_minutes, "train.straggler_threshold": t.straggler_threshold,
              "train.slowdown_threshold": t.slowdown_threshold}
    for key, v in floats.items():
        _check(not v < 0, f"{key} is {v}, expected >= 0", f"set {key} = 0 to disable")
        _check(math.isfinite(v) and v <= 1e6, f"{key} is {v}, expected a finite number at most "
               "1e6", f"e.g. {key.split('.')[1]} = 0.1")
    _check(t.lr > 0, f"train.lr is {t.lr}, expected > 0", "e.g. lr = 0.1")
    _check(0 < t.lr_gamma <= 1, f"train.lr_gamma is {t.lr_gamma}, expected 0 < gamma <= 1 (the "
           "factor the step schedule multiplies the rate by)", "e.g. lr_gamma = 0.1")
    _check(t.label_smoothing < 1, f"train.label_smoothing is {t.label_smoothing}, expected < 1",
           "typical: 0.1")
    _check(len(s.setup) <= 1000 and len(s.sbatch_extra) <= 1000 and len(t.args) <= 10_000,
           f"slurm.setup/sbatch_extra/train.args have {len(s.setup)}/{len(s.sbatch_extra)}/"
           f"{len(t.args)} entries, expected at most 1000/1000/10000", "move them into a script")


def _slurm_strings(cfg: JobConfig) -> None:
    s = cfg.slurm
    _check(bool(NAME_RE.fullmatch(cfg.name)) and len(cfg.name) <= 100,
           f"name {cfg.name!r} has characters SLURM or a shell would interpret, expected letters, "
           "digits and _ . + - (not first), at most 100", "e.g. name = \"cifar10-resnet18\"")
    for key in DIRECTIVE_KEYS:
        scriptsafe.one_line(getattr(s, key), f"slurm.{key}", f"remove the line break from slurm.{key}",
                            limit=200)
    job_strings(cfg)  # the strings that reach a script: the renderers' rule, checked here once
    for key in ("partition", "account", "qos", "constraint"):
        v = getattr(s, key)
        ok = v == "" or bool((_CONSTRAINT_RE if key == "constraint" else NAME_RE).fullmatch(v))
        _check(ok, f"slurm.{key} {v!r} is not a valid SLURM name, expected letters, digits and _ . -",
               f"check `sinfo`/`sacctmgr` for the {key} names of your cluster")
    _check(s.mem == "" or bool(_MEM_RE.fullmatch(s.mem)),
           f"slurm.mem {s.mem!r} is not a SLURM memory size, expected e.g. 32G or 4000M",
           "write mem = \"32G\"")
    try:
        secs = parse_time_s(s.time)
    except ValueError:
        secs = -1
    _check(0 < secs <= MAX_TIME_S, f"slurm.time {s.time!r} is not a SLURM time limit, expected "
           "minutes, HH:MM:SS or D-HH:MM:SS, at most 365 days", "e.g. time = \"04:00:00\"")
    _check(canonical_signal(s.signal) in SIGNALS,
           f"slurm.signal {s.signal!r} is not a signal ddpjob handles, expected one of "
           f"{', '.join(SIGNALS)}", "use USR2 (the default; NCCL may own USR1). "
           "Do not write B: - ddpjob routes the signal to the tasks itself")
    _check(0 <= s.signal_lead_s < 65535, f"slurm.signal_lead_s is {s.signal_lead_s}, expected "
           "0..65534 seconds", "typical: 120")
    _check(s.signal_lead_s < secs, f"slurm.signal_lead_s {s.signal_lead_s} is not below the "
           f"time limit {s.time}, expected fewer than {secs} seconds",
           "lower signal_lead_s or raise slurm.time")
    _container(cfg)
    _node_loss(cfg)


def _container(cfg: JobConfig) -> None:
    s = cfg.slurm
    _check(s.container_runtime in CONTAINER_RUNTIMES, f"slurm.container_runtime is {s.container_runtime!r}, "
           f"expected one of {', '.join(CONTAINER_RUNTIMES)}", "e.g. container_runtime = \"apptainer\"")
    for key in ("container", "container_python"):
        v = getattr(s, key)
        scriptsafe.one_line(v, f"slurm.{key}", f"remove the line break from slurm.{key}", limit=500)
        _check(not any(c.isspace() or c == "," for c in v), f"slurm.{key} {v!r} has a space or a comma, "
               "expected one image name or path", "rename or link the image to a plain path")
        # srun and apptainer would take it as one of their own options (--epilog=..., --fakeroot)
        _check(not v.startswith("-"), f"slurm.{key} {v!r} starts with '-', expected an image name or path",
               f"write ./{v} for a file of that name")
    _check(len(s.container_mounts) <= 100, f"slurm.container_mounts has {len(s.container_mounts)} "
           "entries, expected at most 100", "mount a common parent folder")
    for m in s.container_mounts:
        scriptsafe.path_text(m, "slurm.container_mounts entry", "give \"SRC\" or \"SRC:DST\"")
        parts = m.split(":")
        _check(len(parts) <= 2 and all(p.startswith("/") for p in parts) and "," not in m,
               f"slurm.container_mounts entry {m!r} is not \"SRC\" or \"SRC:DST\" with absolute "
               "paths, expected no comma and at most one colon", "e.g. \"/scratch/data:/data\"")


def _command(t: TrainConfig) -> None:
    """[train] command: argv of a program run without a shell (no quoting: each entry is one
    argument as it is), instead of an entry; its signal, grace, requeue status and hang watch."""
    if not t.command:
        unused = [k for k in ("command_cwd", "command_progress") if getattr(t, k)]
        _check(not unused, f"train.{unused[0] if unused else ''} is set but train.command is not, expected it "
               "only with a command entry", f"drop train.{unused[0] if unused else ''}, or set train.command")
        return
    _check(t.entry == "" and not t.args, f"train.command and train.entry {t.entry or '(args)'!r} are both set, "
           "expected one of them", "drop train.entry/train.args (a command carries its own arguments)")
    _check(t.command[0] != "", "train.command's first entry is empty, expected the program to run",
           'e.g. command = ["python", "train.py"]')
    for arg in t.command:
        scriptsafe.one_line(arg, "train.command entry", "split it into several list entries")
    # a string is read as a one-entry list; no shell splits it, so "python train.py" names no program
    _check(len(t.command) > 1 or not re.search(r"\s", t.command[0]), f"train.command is the one string "
           f"{t.command[0][:80]!r}, expected a list of arguments (it runs without a shell, nothing splits it)",
           "write it as a list: command = " + str(t.command[0].split()[:4]).replace("'", '"'))
    _check(canonical_signal(t.command_signal) in SIGNALS, f"train.command_signal {t.command_signal!r} is "
           f"not a signal ddpjob sends, expected one of {', '.join(SIGNALS)}", 'e.g. command_signal = "TERM"')
    _check(0 <= t.command_grace_s <= 86400, f"train.command_grace_s is {t.command_grace_s}, expected "
           "0 to 86400 seconds", "e.g. command_grace_s = 60")
    _check(0 <= t.command_hang_s <= 7 * 86400, f"train.command_hang_s is {t.command_hang_s}, expected "
           "0 (off) to 604800 seconds", "e.g. command_hang_s = 1800")
    for key in ("command_cwd", "command_progress"):
        value = getattr(t, key)
        if value:
            scriptsafe.one_line(value, f"train.{key}", "give one path")
    _check(2 <= t.command_requeue_exit <= 125 and t.command_requeue_exit != 1,
           f"train.command_requeue_exit is {t.command_requeue_exit}, expected an exit status from 2 to "
           "125 (0 means done, 1 is Python's error exit, 126+ the shell's and signals')",
           "e.g. command_requeue_exit = 3")


def canonical_signal(name: str) -> str:
    """'sigusr2' -> 'USR2': how [slurm] signal is stored once validated (jobfile.from_dict), and
    so how sbatch, submitit and the ranks get it."""
    return name.upper().removeprefix("SIG")


def _train_data(cfg: JobConfig) -> None:
    s, t, d = cfg.slurm, cfg.train, cfg.data
    for key, options in (("optimizer", ("sgd", "adamw")), ("schedule", ("cosine", "step", "constant")),
                         ("amp", ("auto", "bf16", "fp16", "off")), ("backend", ("auto", "nccl", "gloo")),
                         ("stop_vote", ("overlap", "sync")), ("grad_compression", ("none", "bf16")),
                         ("strategy", ("ddp", "fsdp")),
                         ("compile_mode", COMPILE_MODES)):
        v = getattr(t, key)
        _check(v in options, f"train.{key} is {v!r}, expected one of {', '.join(options)}",
               f"e.g. {key} = \"{options[0]}\"")
    _fsdp(cfg)
    scriptsafe.one_line(t.model, "train.model", "e.g. model = \"resnet18\"", limit=200)
    problem = model_problem(t.model)
    _check(problem is None, f"train.model {t.model!r} is not a model the nodes can build, expected "
           "a built-in, a torchvision classification model or \"package.module:function\"",
           problem or "")
    if t.global_batch_size:
        per_step = t.batch_size * s.world_size
        _check(t.global_batch_size % per_step == 0,
               f"train.global_batch_size {t.global_batch_size} is not a multiple of batch_size x "
               f"ranks = {t.batch_size} x {s.world_size}, expected a multiple of {per_step}",
               "change batch_size or global_batch_size")
    _check(t.entry == "" or bool(ENTRY_SCRIPT.fullmatch(t.entry) or _ENTRY_FUNC.fullmatch(t.entry)),
           f"train.entry {t.entry!r} is neither a Python script nor a function, expected "
           "\"path/to/script.py\" or \"package.module:function\" (or \"\" for the built-in trainer)",
           "e.g. entry = \"examples/charlm/train.py\"")
    if ENTRY_SCRIPT.fullmatch(t.entry):
        scriptsafe.path_text(t.entry, "train.entry", "e.g. entry = \"examples/charlm/train.py\"")
    for arg in t.args:
        scriptsafe.one_line(arg, "train.args entry", "split it into several list entries")
    _check(set(t.trackers) <= set(TRACKERS) and len(set(t.trackers)) == len(t.trackers),
           f"train.trackers is {list(t.trackers)!r}, expected each of {', '.join(TRACKERS)} at most once",
           'e.g. trackers = ["wandb"]')
    scriptsafe.one_line(t.tracker_project, "train.tracker_project", 'e.g. tracker_project = "cifar10"', limit=128)
    scriptsafe.one_line(t.mlflow_uri, "train.mlflow_uri", 'e.g. mlflow_uri = "http://mlflow.lab:5000"', limit=4000)
    if t.metrics_textfile:  # node_exporter's textfile collector reads *.prom files only
        _check(bool(re.fullmatch(r"(?s).*[^/]\.prom", t.metrics_textfile)),
               f"train.metrics_textfile {t.metrics_textfile!r} is not a .prom file, expected a file name "
               "node_exporter's textfile collector reads (*.prom)",
               "e.g. metrics_textfile = \"/var/lib/node_exporter/textfile/myrun.prom\"")
    _command(t)
    for key, v in (("train.pretrained", t.pretrained), ("data.root", d.root),
                   ("train.metrics_textfile", t.metrics_textfile), ("checkpoint.init_from", cfg.checkpoint.init_from)):
        scriptsafe.path_text(v, key, f"set {key} to a plain path")
    snap_dir = cfg.checkpoint.snapshot_dir
    _check(snap_dir.startswith("/"), f"checkpoint.snapshot_dir is {snap_dir!r}, expected an absolute "
           "path on the nodes", 'e.g. snapshot_dir = "/dev/shm" (node-local memory)')
    scriptsafe.path_text(snap_dir, "checkpoint.snapshot_dir", 'e.g. snapshot_dir = "/dev/shm"')
    unknown = [k for k in t.user_free if k not in cfg.user]
    _check(len(t.user_free) <= 100 and not unknown,
           f"train.user_free names {unknown or list(t.user_free)[:3]}, expected at most 100 keys of the "
           f"[user] table (it has: {', '.join(sorted(cfg.user)[:20]) or 'nothing'})",
           "list the [user] keys that may change at a resume, e.g. user_free = [\"max_iters\"]")
    keys = cfg.checkpoint.init_keys
    _check(0 < len(keys) <= 100 and all(bool(_STATE_KEY.fullmatch(k)) for k in keys),
           f"checkpoint.init_keys is {list(keys)!r}, expected 1..100 state keys (letters, digits, _)",
           "e.g. init_keys = [\"model\"] (weights only) or [\"model\", \"optimizer\"]")
    _check(d.dataset in ("cifar10", "synthetic") or ":" in d.dataset,
           f"data.dataset is {d.dataset!r}, expected cifar10, synthetic or \"package.module:function\"",
           "e.g. dataset = \"cifar10\"")
    scriptsafe.one_line(d.dataset, "data.dataset", "e.g. dataset = \"cifar10\"", limit=200)


def _fsdp(cfg: JobConfig) -> None:
    """What sharded training cannot do (Job.wrap, docs/api.md). train.deterministic_reduce
    is DDP's comm hook and simply does not apply: FSDP's reduce-scatter has a fixed layout, so
    the same world size sums in the same order on every run."""
    t = cfg.train
    if t.strategy != "fsdp":
        return
    for on, why, fix in (
            (t.sync_batchnorm, "train.sync_batchnorm (its statistics all-reduce runs inside the "
             "forward, which FSDP already drives with its own all-gathers)", "sync_batchnorm = false"),
            (t.compile, "train.compile (torch.compile of a fully_shard model is not supported by "
             "ddpjob yet)", "compile = false"),
            (t.amp == "fp16", "train.amp = \"fp16\" (GradScaler's overflow check would see only "
             "this rank's shard of the gradients)", "amp = \"bf16\" or \"off\""),
            (t.grad_compression != "none", f"train.grad_compression = \"{t.grad_compression}\" (a "
             "hook of DDP's all-reduce; FSDP reduce-scatters the gradients itself, in float32)",
             "grad_compression = \"none\"")):
        _check(not on, f"train.strategy = \"fsdp\" with {why}, expected a setting sharded "
               "training supports", f"set {fix}, or strategy = \"ddp\"")


_STATE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # as store/state.py's keys


def _node_loss(cfg: JobConfig) -> None:
    s = cfg.slurm
    _check(s.on_node_loss in ("requeue", "continue"), f"slurm.on_node_loss is {s.on_node_loss!r}, expected "
           "requeue or continue", "e.g. on_node_loss = \"continue\"")
    _check(s.on_node_loss == "requeue" or s.max_failures >= 1, "slurm.on_node_loss = \"continue\" with "
           "max_failures = 0: a lost node would end the job all the same, expected max_failures >= 1",
           "set slurm.max_failures = 1 (each lost node spends one)")
    _check(s.spare_nodes == 0 or s.on_node_loss == "continue", f"slurm.spare_nodes = {s.spare_nodes} with "
           "on_node_loss = \"requeue\": a requeued job gets a new allocation, expected on_node_loss = "
           "\"continue\"", "set slurm.on_node_loss = \"continue\" and slurm.max_failures >= 1")
    _check(s.on_straggler in ("off", "exclude", "requeue"), f"slurm.on_straggler is {s.on_straggler!r}, expected "
           "off, exclude or requeue", "e.g. on_straggler = \"exclude\" (with a spare node: spare_nodes = 1)")


def validate(cfg: JobConfig) -> None:
    """Reject values SLURM or the trainer would fail on later, far from the cause."""
    _sizes(cfg)
    _slurm_strings(cfg)
    _train_data(cfg)


def job_strings(cfg: JobConfig) -> None:
    """Every job-file string that reaches either script (the name and the other #SBATCH values,
    slurm.setup, slurm.sbatch_extra), by scriptsafe's rules: the one place they are checked.
    validate() calls it at load; the renderers (launch/slurmopts.py) call it too, since a frozen
    JobConfig can be built without validation, and strings that passed once are not checked again."""
    s = cfg.slurm
    _script_strings(cfg.name, tuple(getattr(s, key) for key in DIRECTIVE_KEYS), tuple(s.setup),
                    tuple(s.sbatch_extra))


DIRECTIVE_KEYS = ("partition", "account", "qos", "constraint", "mem", "time", "signal")


@functools.lru_cache(maxsize=256)  # pure; an exception is never cached, so a failure fails again
def _script_strings(name: str, values: tuple[str, ...], setup: tuple[str, ...], extra: tuple[str, ...]) -> None:
    scriptsafe.directive_value(name, "name", "choose another name")
    for key, value in zip(DIRECTIVE_KEYS, values):
        scriptsafe.directive_value(value, f"slurm.{key}", f"choose another slurm.{key}")
    scriptsafe.setup_lines(setup)
    for arg in extra:
        scriptsafe.sbatch_extra(arg)
