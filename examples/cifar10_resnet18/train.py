"""ResNet-18 on CIFAR-10 with DDP, twice: train_plain.py is plain PyTorch, train.py the same
script on ddpjob (20 changed lines: `diff -u train_plain.py train.py`).

    torchrun --nproc-per-node 2 examples/cifar10_resnet18/train_plain.py --data_root data
    ddpjob submit examples/cifar10_resnet18/job.toml --backend local --wait

Preempted, the plain script starts again from step 0; train.py stops at a step boundary with a
checkpoint, is requeued and continues: bit for bit the model of an uninterrupted run.
"""

import argparse
import os

import ddpjob
import torch
import torch.nn as nn
import torchvision
import torchvision.transforms as transforms
from torch.utils.data import DataLoader

parser = argparse.ArgumentParser()
parser.add_argument("--data_root", default="data")  # the folder that holds cifar-10-batches-py/
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--batch_size", type=int, default=256)  # global: split over the ranks
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--weight_decay", type=float, default=5e-4)
parser.add_argument("--num_workers", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        correct += (model(images).argmax(1) == labels).sum().item()
        total += labels.size(0)
    model.train()
    return correct / total


# ---- distributed setup: one process per device, torchrun's environment variables
job = ddpjob.init(os.path.join(os.path.dirname(__file__), "job.toml"))  # under `ddpjob run`: its job file
rank, device = job.rank, job.device
parser.set_defaults(**job.user)  # the job file's [user] table; --flags (train.args) still win
args = parser.parse_args()
torch.manual_seed(args.seed)  # every rank builds the same initial weights

# ---- model and optimizer
net = torchvision.models.resnet18(num_classes=10)
model = job.wrap(net)  # to the device, DDP
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                            weight_decay=args.weight_decay)
loss_fn = nn.CrossEntropyLoss()

# ---- data: PIL images, random crops and flips, each rank a different share of every epoch
normalize = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), normalize])
test_tf = transforms.Compose([transforms.ToTensor(), normalize])
train_set = torchvision.datasets.CIFAR10(args.data_root, train=True, transform=train_tf, download=False)
test_set = torchvision.datasets.CIFAR10(args.data_root, train=False, transform=test_tf, download=False)
sampler = ddpjob.StepSampler(len(train_set), args.batch_size, args.seed)  # order = f(seed, step)
loader = DataLoader(train_set, batch_sampler=sampler, num_workers=args.num_workers)
test_loader = DataLoader(test_set, batch_size=256)
steps_per_epoch = len(train_set) // args.batch_size
total_steps = args.epochs * steps_per_epoch
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

# ---- training: one optimizer step per batch
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
job.resume(state)  # last before the loop: the newest checkpoint (if any) into state and RNGs
batches = iter(loader)
for step in job.steps(state, total_steps):  # stops (checkpoint, requeue) when SLURM warns
    images, labels = next(batches)
    images, labels = images.to(device), labels.to(device)
    loss = loss_fn(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    job.log(step + 1, average=["loss"], loss=loss, lr=scheduler.get_last_lr()[0])
    if rank == 0:
        print(f"step {step + 1}/{total_steps} loss {loss.item():.4f}", flush=True)
    if (step + 1) % steps_per_epoch == 0:  # the end of an epoch
        if rank == 0:
            print(f"epoch {step // steps_per_epoch}: test accuracy {evaluate(net, test_loader, device):.4f}")
job.finish(net)  # RUN_DIR/final/model.pt and the COMPLETED marker
