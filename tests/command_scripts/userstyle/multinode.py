"""A multi-node DDP script of the kind users already have, written in the style of the PyTorch
DDP tutorial series (pytorch/examples, distributed/ddp-tutorial-series/multinode.py), knowing
nothing of ddpjob:

- it imports its sibling module (`from datautils import ...`): `python multinode.py` must put the
  script's folder on sys.path;
- it logs nothing to ddpjob (no DDPJOB_METRICS lines): only its own prints;
- it has no SIGTERM handler (--on_sigterm save_exit0: a handler that saves and exits 0, the
  habit of Lightning's);
- rank 0 saves a snapshot every --save_every epochs with a plain torch.save (not atomic) to a
  path relative to the working directory, and resumes from it with range(epochs_run, ...).

The test hooks (testhook.py, read from USERSTYLE_AT) act at an epoch's end, never on a timer.
"""

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datautils import SyntheticDataset
import testhook


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.epoch = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epochs_run: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epochs_run}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epochs_run - 1} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)
        total = 0.0
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        return total / len(self.train_data)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self.epoch = epoch
            loss = self._run_epoch(epoch)
            print(f"[rank{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)} | loss {loss:.4f}",
                  flush=True)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)
            testhook.at_epoch_end(epoch, self.global_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--on_sigterm", choices=["none", "save_exit0"], default="none")
    args = parser.parse_args()

    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = SyntheticDataset(512)
    train_data = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path)
    if args.on_sigterm == "save_exit0":
        def on_sigterm(signum: int, frame: object) -> None:
            # Lightning's habit: save in the handler, then leave with status 0
            if trainer.global_rank == 0:
                trainer._save_snapshot(trainer.epoch)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_sigterm)
    trainer.train(args.total_epochs)
    destroy_process_group()
    print("Training finished", flush=True)


if __name__ == "__main__":
    main()
