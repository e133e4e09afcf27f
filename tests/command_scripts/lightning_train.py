"""A Lightning script as users write it (a tiny linear model, data made here), run under
`[train] command`: ModelCheckpoint(save_last=True) every --save_every steps, `fit(ckpt_path=
"last")`. --callback adds ddpjob's line (docs/integrations.md): `callbacks=[DdpjobCallback()]`.

Test hooks (never a timer): DDPJOB_TEST_AT="RANK:STEP:ATTEMPT:HOW[,...]" (as plain_train.py)
acts after optimizer step STEP: "pause" prints "paused at step N" and waits until the stop signal
came (with the callback: its flag; without, Lightning's own handler); "kill" SIGKILLs this
process; "raise" raises a ValueError; "abortatexit" (any STEP) ends the process after training
with SIGABRT and libstdc++'s line, as torch's teardown does now and then; "exitatexit" (any
STEP) exits 0 after training without the interpreter's teardown. Each start prints "training
from step N".
"""

import argparse
import os
import signal
import sys
import time

import torch

try:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:
    import pytorch_lightning as L
    from pytorch_lightning.callbacks import ModelCheckpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", required=True)
parser.add_argument("--max_steps", type=int, default=300)
parser.add_argument("--save_every", type=int, default=50)
parser.add_argument("--callback", action="store_true", help="ddpjob.integrations.lightning.DdpjobCallback")
parser.add_argument("--devices", type=int, default=0, help="Trainer(devices=...); 0: LOCAL_WORLD_SIZE")
parser.add_argument("--num_nodes", type=int, default=0, help="Trainer(num_nodes=...); 0: GROUP_WORLD_SIZE")
args = parser.parse_args()

rank, attempt = int(os.environ.get("RANK", "0")), os.environ.get("DDPJOB_ATTEMPT", "0")
specs = [(spec + ":::").split(":")[:4] for spec in os.environ.get("DDPJOB_TEST_AT", "").split(",")]
_, step_at, _, how = next((s for s in specs if s[0] in ("*", str(rank)) and s[2] in ("", attempt)), ["", "0", "", ""])


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class TestHook(L.Callback):
    def __init__(self) -> None:
        self.ddpjob = None

    def on_train_start(self, trainer, pl_module):
        print(f"training from step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if how and trainer.global_step == int(step_at):
            if how == "pause":
                print(f"paused at step {trainer.global_step}", flush=True)
                for _ in range(4800):
                    if self.ddpjob is not None and self.ddpjob.signals.requested():
                        break
                    time.sleep(0.05)
            elif how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "raise":
                raise ValueError(f"a bug at step {trainer.global_step}")


g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 16, generator=g)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
hook = TestHook()
callbacks = [hook, ModelCheckpoint(dirpath=os.path.join(args.out_dir, "checkpoints"),
                                   every_n_train_steps=args.save_every, save_last=True)]
if args.callback:
    from ddpjob.integrations.lightning import DdpjobCallback

    hook.ddpjob = DdpjobCallback()
    callbacks.append(hook.ddpjob)
trainer = L.Trainer(accelerator="cpu", devices=args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    num_nodes=args.num_nodes or int(os.environ.get("GROUP_WORLD_SIZE", "1")), strategy="ddp", max_steps=args.max_steps,
                    callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=args.out_dir)
torch.manual_seed(0)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8, shuffle=True), ckpt_path="last")
print(f"done at step {trainer.global_step}", flush=True)
if how == "abortatexit":
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()
if how == "exitatexit":  # exits 0 by itself every time: torch's own teardown abort cannot come
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
