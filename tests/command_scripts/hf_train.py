"""A Hugging Face Trainer script as users write it (a 2-layer GPT-2 built from its config,
vocabulary 256, token data made here: no download), run under `[train] command`: checkpoints
every --save_every steps, resumed with `get_last_checkpoint` as the transformers examples do.
--callback adds ddpjob's two lines (docs/integrations.md): `callbacks=[DdpjobCallback()]` and
`resume_from_checkpoint=last_checkpoint(...)`.

Test hooks (never a timer): DDPJOB_TEST_AT="RANK:STEP:ATTEMPT:HOW[,...]" (as plain_train.py)
acts after optimizer step STEP: "pause" prints "paused at step N" and waits until the stop signal
came (with the callback: its flag; without, the signal ends the process); "kill" SIGKILLs this
process; "raise" raises a ValueError; "abortatexit" (any STEP) ends the process after training with
SIGABRT and libstdc++'s line, as torch's teardown does now and then; "exitatexit" (any STEP)
exits 0 after training without the interpreter's teardown. Each start prints "training from
step N".
"""

import argparse
import os
import signal
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", required=True)
parser.add_argument("--max_steps", type=int, default=300)
parser.add_argument("--save_every", type=int, default=50)
parser.add_argument("--callback", action="store_true", help="ddpjob.integrations.hf.DdpjobCallback")
args = parser.parse_args()

rank, attempt = int(os.environ.get("RANK", "0")), os.environ.get("DDPJOB_ATTEMPT", "0")
specs = [(spec + ":::").split(":")[:4] for spec in os.environ.get("DDPJOB_TEST_AT", "").split(",")]
_, step_at, _, how = next((s for s in specs if s[0] in ("*", str(rank)) and s[2] in ("", attempt)), ["", "0", "", ""])


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, each a function of its index."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class TestHook(TrainerCallback):
    def __init__(self) -> None:
        self.ddpjob = None  # the DdpjobCallback, whose flag "pause" waits for

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"training from step {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if how and state.global_step == int(step_at):
            if how == "pause":
                print(f"paused at step {state.global_step}", flush=True)
                for _ in range(4800):
                    if self.ddpjob is not None and self.ddpjob.signals.requested():
                        break
                    time.sleep(0.05)
            elif how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "raise":
                raise ValueError(f"a bug at step {state.global_step}")


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=32))
training_args = TrainingArguments(
    output_dir=args.out_dir, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
    save_strategy="steps", save_steps=args.save_every, logging_steps=10, report_to="none", use_cpu=True,
    disable_tqdm=True, dataloader_num_workers=0, seed=0, ddp_backend="gloo")
hook = TestHook()
callbacks = [hook]
if args.callback:
    from ddpjob.integrations.hf import DdpjobCallback, last_checkpoint

    hook.ddpjob = DdpjobCallback()
    callbacks.append(hook.ddpjob)
trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(), callbacks=callbacks)
if args.callback:
    resume = last_checkpoint(args.out_dir)
else:
    resume = get_last_checkpoint(args.out_dir) if os.path.isdir(args.out_dir) else None
if resume:
    print(f"resuming from {resume}", flush=True)
trainer.train(resume_from_checkpoint=resume)
print(f"done at step {trainer.state.global_step}", flush=True)
if how == "abortatexit":
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()
if how == "exitatexit":  # exits 0 by itself every time: torch's own teardown abort cannot come
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
