"""Hugging Face Trainer under ddpjob: a preemption, a time limit or `ddpjob stop` loses no step
(docs/integrations.md). Extra `ddpjob[hf]`.

    from ddpjob.integrations.hf import DdpjobCallback, last_checkpoint
    trainer = Trainer(..., callbacks=[DdpjobCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

The stop signal only sets a flag; at each optimizer step's end the ranks combine it (one
all-reduce), so every rank stops after the same step; the Trainer's own save writes
`checkpoint-N` (what `resume_from_checkpoint` loads); the process exits with ddpjob's "requeue
me" status. Each save gets a manifest written last: `last_checkpoint` (and the callback, before
`resume_from_checkpoint=True` looks) passes over a checkpoint that a kill left half-written.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ddpjob.integrations._common import (Metrics, Settings, StopSignals, agree, barrier, leave,
                                         freeze_at_exit)

MANIFEST = "ddpjob-manifest.json"  # written last into each checkpoint-N: its files and sizes
SET_ASIDE = "incomplete-"  # a damaged checkpoint-N is renamed incomplete-checkpoint-N
_NAME = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-([0-9]+)")
# one of these is the model's weights (whole, sharded, or a PEFT adapter)
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
            "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the Trainer's `checkpoint-N` folder at `path` cannot be resumed, or None when it can.
    With ddpjob's manifest: every file it lists, at its size. Without (saved before the callback
    was added): trainer_state.json, which the Trainer writes after the weights, optimizer and
    scheduler, readable and at step N, and a weights file."""
    path = Path(path)
    m = _NAME.fullmatch(path.name)
    if m is None or not path.is_dir():
        return f"{path} is not a {PREFIX_CHECKPOINT_DIR}-N folder"
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"its manifest cannot be read ({exc})"
        for name, size in files.items():
            try:
                found = (path / name).stat().st_size
            except OSError:
                return f"{name} is missing"
            if found != size:
                return f"{name} has {found} bytes, the manifest says {size}"
        return None
    try:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "it has no trainer_state.json (the save did not finish)"
    except (OSError, ValueError) as exc:
        return f"its trainer_state.json cannot be read ({exc})"
    if state.get("global_step") != int(m.group(1)):
        return f"its trainer_state.json is at step {state.get('global_step')}, not {m.group(1)}"
    if not any((path / w).is_file() for w in _WEIGHTS):
        return "it holds no model weights"
    return None


def _checkpoints(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` folders of `output_dir`, newest (highest N) first."""
    try:
        found = [p for p in Path(output_dir).iterdir() if _NAME.fullmatch(p.name) and p.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(found, key=lambda p: int(p.name.rsplit("-", 1)[1]), reverse=True)


def last_checkpoint(output_dir: str | Path) -> str | None:
    """The newest `checkpoint-N` of `output_dir` that can be resumed, for
    `trainer.train(resume_from_checkpoint=...)`; None where there is none (the first start), so
    the same line serves every start. `transformers.trainer_utils.get_last_checkpoint` takes the
    highest N even when a kill left it half-written, and the resume then fails."""
    for path in _checkpoints(output_dir):
        if checkpoint_problem(path) is None:
            return str(path)
    return None


def set_aside(output_dir: str | Path) -> list[str]:
    """Rename each damaged `checkpoint-N` to `incomplete-checkpoint-N` (kept, never deleted), so
    that `get_last_checkpoint` and `resume_from_checkpoint=True` no longer choose it, and the
    Trainer's rotation no longer counts it. One line per folder; the lines."""
    lines = []
    for path in _checkpoints(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            continue
        target, n = path.with_name(SET_ASIDE + path.name), 1
        while target.exists():
            target, n = path.with_name(f"{SET_ASIDE}{path.name}.{n}"), n + 1
        os.rename(path, target)
        lines.append(f"ddpjob: {path} cannot be resumed: {problem}; renamed to {target.name}")
    return lines


def write_manifest(path: str | Path) -> None:
    """Record every file of a finished checkpoint-N with its size, atomically, last."""
    path = Path(path)
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    tmp = path / f".{MANIFEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


class DdpjobCallback(TrainerCallback):
    """Stops every rank after the same step on the job's stop signal, saves `checkpoint-N` with
    the Trainer's own save, exits with the job's "requeue me" status (3); writes ddpjob's
    metrics lines. `settings`: for tests; by default read from the environment and run dir."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_environ()
        self.signals = StopSignals(self.settings.signals)
        self.metrics = Metrics(self.settings)
        self.stopping = False

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # Before train() resolves resume_from_checkpoint=True through get_last_checkpoint
        if state.is_world_process_zero and args.output_dir:
            for line in set_aside(args.output_dir):
                print(line, flush=True)
        barrier()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        # Replaces what was there (the Trainer's own JIT-checkpoint handler, SIG_DFL) until the end
        self.signals.install()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        scheduler = kwargs.get("lr_scheduler")
        lr = scheduler.get_last_lr()[0] if scheduler is not None and hasattr(scheduler, "get_last_lr") else None
        self.metrics.step(state.global_step, lr=lr)
        if agree(self.signals.requested()):
            # The Trainer saves checkpoint-N right after this hook, on every rank, then on_save
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        self.metrics.add(state.global_step, loss=logs.get("loss"), grad_norm=logs.get("grad_norm"))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        path = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        barrier()  # every rank's part written (each its own rng_state_R.pth)
        if state.is_world_process_zero and path.is_dir():
            write_manifest(path)
            self.metrics.checkpoint(state.global_step, path)
        if self.stopping:
            barrier()
            self.signals.uninstall()
            leave(self.settings.requeue_exit,
                  f"ddpjob: rank {self.settings.rank}: stopped after step {state.global_step}, saved {path}; "
                  f"exiting {self.settings.requeue_exit} (requeue me)")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.metrics.end(state.global_step)  # the run ended by itself (a stop leaves through leave())
        self.signals.uninstall()
        freeze_at_exit()
