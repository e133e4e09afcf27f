"""A plain torchrun-style training script that knows nothing of ddpjob's API, written like
nanoGPT's train.py with init_from = 'resume': torch.distributed from env://, its own checkpoint
(OUT_DIR/ckpt.pt) resumed when it exists, SIGTERM caught to save and exit with the requeue status
(docs/commands.md), or with --no_handler not caught at all, as in nanoGPT. What it takes from ddpjob is only the environment: DDPJOB_METRICS (JSON lines
for status/plot), DDPJOB_HEARTBEAT (touched each step) and DDPJOB_ATTEMPT.

Test hooks (never a timer): DDPJOB_TEST_AT="RANK:STEP:ATTEMPT:HOW[,...]" (RANK "*" = every rank,
ATTEMPT "" = any; a rank takes the first spec that names it) acts after step STEP: HOW = "pause" prints "paused at step N" and waits until
the stop signal came (the test signals the supervisor on that line); "kill" SIGKILLs this
process; "killwrapper" SIGKILLs its parent (`ddpjob run`, the rank's process: no crash record
from it), then exits; "raise" raises a ValueError (a bug of the script's own); "hang" stops for good, silent,
deaf to the stop signal (ddpjob's hang watch ends it).
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", required=True)
parser.add_argument("--max_steps", type=int, default=30)
parser.add_argument("--save_every", type=int, default=5)
parser.add_argument("--requeue_exit", type=int, default=3)
parser.add_argument("--no_handler", action="store_true", help="like nanoGPT: no SIGTERM handler, dies of it")
args = parser.parse_args()

stop: list[int] = []
if not args.no_handler:
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("DDPJOB_ATTEMPT", "0"))
os.makedirs(args.out_dir, exist_ok=True)
ckpt_path = os.path.join(args.out_dir, "ckpt.pt")

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
step = 0
if os.path.exists(ckpt_path):  # init_from = 'resume'
    state = torch.load(ckpt_path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
    print(f"resumed from {ckpt_path} at step {step}", flush=True)
model = torch.nn.parallel.DistributedDataParallel(model)


def end() -> None:
    """Let go of the group before the interpreter ends: DDP holds it, and its gloo threads met
    the interpreter's finalization now and then ("terminate called without an active exception",
    SIGABRT after the last step, seen under load)."""
    global model
    del model
    import gc

    gc.collect()
    dist.destroy_process_group()

# this rank's hook: the first of the comma-separated specs that names it
specs = [(spec + ":::").split(":")[:4] for spec in os.environ.get("DDPJOB_TEST_AT", "").split(",")]
rank_at, step_at, attempt_at, how = next((s for s in specs if s[0] in ("*", str(rank)) and s[2] in ("", str(attempt))),
                                         ["", "0", "", ""])
armed = bool(how)


def save() -> None:
    if rank == 0:
        tmp = ckpt_path + ".tmp"
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, ckpt_path)
    dist.barrier()


def log(loss: float) -> None:
    if rank == 0 and os.environ.get("DDPJOB_METRICS"):
        with open(os.environ["DDPJOB_METRICS"], "a") as f:
            f.write(json.dumps({"kind": "train", "step": step, "restart": attempt, "time": time.time(),
                                "loss": loss}) + "\n")
    beat = os.environ.get("DDPJOB_HEARTBEAT")
    if beat:
        with open(beat, "a"):
            os.utime(beat)


while step < args.max_steps:
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(16, 8, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    log(loss.item())
    if armed and step == int(step_at):
        if how == "pause":
            print(f"paused at step {step}", flush=True)
            for _ in range(2400):
                if stop:
                    break
                time.sleep(0.05)
        elif how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "killwrapper":
            parent = os.getppid()
            os.kill(parent, signal.SIGKILL)
            while os.getppid() == parent:  # the kernel hands this process on: its output goes nowhere
                time.sleep(0.01)
            os._exit(1)  # as a program whose stdout pipe broke (proctrack/linuxproc no longer sees it)
        elif how == "raise":
            raise ValueError(f"a bug at step {step}")
        elif how == "hang":
            while True:
                time.sleep(0.5)
    # every rank stops at the same step: a signal seen by any rank counts for all
    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        save()
        print(f"stopping at step {step} for a requeue", flush=True)
        end()
        sys.exit(args.requeue_exit)
    if step % args.save_every == 0:
        save()

save()
print(f"done at step {step}", flush=True)
end()
