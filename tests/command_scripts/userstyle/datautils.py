"""The sibling module of multinode.py: a small synthetic regression dataset (the script's own
data, made from a fixed seed), imported as `from datautils import ...` the way the PyTorch DDP
tutorial's script imports its own."""

import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    def __init__(self, size: int, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, dim, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]
