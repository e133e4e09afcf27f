"""Lightning under ddpjob: a preemption, a time limit or `ddpjob stop` loses no step
(docs/integrations.md). Extra `ddpjob[lightning]`; `lightning.pytorch`, else `pytorch_lightning`.

    from ddpjob.integrations.lightning import DdpjobCallback
    trainer = Trainer(devices=2, ..., callbacks=[DdpjobCallback()])
    trainer.fit(model, data, ckpt_path="last")

Lightning's own SIGTERM handler broadcasts inside the handler and ends the fit with an exit 0
(a stop read as "done"); its auto-requeue is SLURMEnvironment's, not ddpjob's. This callback
keeps that handler out for the fit: the stop signal only sets a flag, the ranks combine it at
each training batch's end (one all-reduce), write `last.ckpt` where `ckpt_path="last"` finds it
(a temporary file, then a rename: a kill mid-save leaves the previous one), and exit with
ddpjob's "requeue me" status. Under ddpjob it makes sure Lightning takes its TorchElastic
environment (ranks from the variables) and says in one line when `Trainer(devices=...,
num_nodes=...)` disagrees with the job's ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer
else:
    try:  # the unified package; the standalone one where only that is installed
        from lightning.pytorch import Callback, LightningModule, Trainer
    except ImportError:
        from pytorch_lightning import Callback, LightningModule, Trainer

from ddpjob.errors import DDPJobError
from ddpjob.integrations._common import (Metrics, Settings, StopSignals, agree, barrier, leave,
                                         freeze_at_exit)

TMP_SUFFIX = ".ddpjob-tmp"  # not ".ckpt": `ckpt_path="last"` never picks a file being written


def elastic_environ(environ: MutableMapping[str, str]) -> None:
    """Under ddpjob, the variable by which Lightning knows an elastic launch (its
    TorchElasticEnvironment comes first; under SLURM it would otherwise take SLURMEnvironment,
    whose auto-requeue is not ddpjob's). The ranks' variables are rank/command.py's."""
    if environ.get("DDPJOB_RUN_DIR") and "RANK" in environ:
        environ.setdefault("TORCHELASTIC_RUN_ID", environ.get("SLURM_JOB_ID") or Path(environ["DDPJOB_RUN_DIR"]).name)


def layout_problem(devices: int, num_nodes: int, environ: Mapping[str, str]) -> DDPJobError | None:
    """What is wrong when `Trainer(devices, num_nodes)` is not the job's layout of ranks, or None."""
    if "WORLD_SIZE" not in environ:
        return None
    world = int(environ["WORLD_SIZE"])
    per_node = int(environ.get("LOCAL_WORLD_SIZE") or world)
    nodes = int(environ.get("GROUP_WORLD_SIZE") or max(1, world // max(1, per_node)))
    if (devices, num_nodes) == (per_node, nodes):
        return None
    return DDPJobError(
        f"Trainer(devices={devices}, num_nodes={num_nodes}) is {devices} rank(s) per node on {num_nodes} node(s), "
        f"the job runs {world}: {per_node} per node on {nodes} node(s)",
        f"Trainer(devices={per_node}, num_nodes={nodes}), or "
        "devices=int(os.environ['LOCAL_WORLD_SIZE']), num_nodes=int(os.environ['GROUP_WORLD_SIZE'])")


def last_path(trainer: Trainer) -> Path:
    """Where `ckpt_path="last"` looks: the first ModelCheckpoint's folder, its `last` name."""
    cb: Any  # a ModelCheckpoint (the type names a Checkpoint, which has no folder)
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "dirpath", None):
            name = cb.CHECKPOINT_NAME_LAST if "{" not in cb.CHECKPOINT_NAME_LAST else "last"
            return Path(cb.dirpath) / f"{name}{cb.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


class DdpjobCallback(Callback):
    """Stops every rank after the same training batch on the job's stop signal, saves `last.ckpt`,
    exits with the job's "requeue me" status (3); writes ddpjob's metrics lines. `settings`: for
    tests; by default read from the environment and run dir."""

    def __init__(self, settings: Settings | None = None) -> None:
        # Built before Trainer(...) runs: the environment is chosen there
        elastic_environ(os.environ)
        self.settings = settings or Settings.from_environ()
        self.signals = StopSignals(self.settings.signals)
        self.metrics = Metrics(self.settings)
        self.saved_step: int | None = None  # a ModelCheckpoint save seen, its line not yet written

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # A count that disagrees Lightning refuses itself at Trainer(...); fewer devices than the
        # node's ranks fails in its own set-up, before this hook. What reaches here trains (the
        # ranks come from the variables) but is not what the job file says: one line, no stop.
        if (self.settings.world_size > 1 or "DDPJOB_RUN_DIR" in os.environ) and trainer.is_global_zero:
            problem = layout_problem(trainer.num_devices, trainer.num_nodes, os.environ)
            if problem is not None:
                print(problem.line().replace("ddpjob: error:", "ddpjob: warning:", 1), flush=True)
        # Lightning registers its handler after this hook, each fit; keep it out of this one
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "register_signal_handlers"):
            connector.register_signal_handlers = lambda: None
        if not trainer.checkpoint_callbacks and trainer.is_global_zero:
            print(f"ddpjob: Trainer(enable_checkpointing=False): a stop saves {last_path(trainer)}, which "
                  "ckpt_path=\"last\" does not look for; pass that path to fit(ckpt_path=...)", flush=True)
        self.signals.install()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A ModelCheckpoint save, before its file is written: the line comes at the next batch
        self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._saved_line(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        self.metrics.step(trainer.global_step, lr=lr,
                          loss=float(loss.detach()) if loss is not None and hasattr(loss, "detach") else None)
        if agree(self.signals.requested()):
            self._stop(trainer)

    def _saved_line(self, trainer: Trainer) -> None:
        if self.saved_step is not None:
            where = next((getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
                          for cb in trainer.checkpoint_callbacks
                          if getattr(cb, "last_model_path", None) or getattr(cb, "best_model_path", None)), "")
            self.metrics.checkpoint(self.saved_step, where)
            self.saved_step = None

    def _stop(self, trainer: Trainer) -> None:
        """Every rank is here after the same batch: save (every rank takes part: a sharded
        strategy writes from each), rename on rank 0, then leave."""
        path = last_path(trainer)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
        barrier()
        trainer.save_checkpoint(str(tmp))
        if trainer.is_global_zero:
            os.replace(tmp, path)
            self.metrics.checkpoint(trainer.global_step, path)
            for logger in trainer.loggers:
                logger.save()
        barrier()
        self.signals.uninstall()
        leave(self.settings.requeue_exit,
              f"ddpjob: rank {trainer.global_rank}: stopped after step {trainer.global_step}, saved {path}; "
              f"exiting {self.settings.requeue_exit} (requeue me)")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saved_line(trainer)
        self.metrics.end(trainer.global_step)  # the fit ended by itself (a stop leaves through leave())
        freeze_at_exit()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.metrics.flush()
        self.signals.uninstall()
        # Lightning's own registration back for the trainer's later runs (test, predict)
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            vars(connector).pop("register_signal_handlers", None)
