"""Model plugins ("trainer_plugins:NAME") for the trainer tests; tests/ranks.py puts this folder
on the ranks' PYTHONPATH.

- `conv_nobn`: a small CNN without BatchNorm, so that K micro-batches of B and one batch of K*B
  give the same gradient up to float rounding (BN's batch statistics would differ).
- `signalling_cnn`: cnn_tiny (same state_dict keys) that sends itself SIGUSR2 at a chosen
  training forward call, so a test can stop a run mid-accumulation deterministically.
  DDPJOB_TEST_SIGNAL="RANK:CALL" (1-based count of training-mode forward calls, this process).
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from ddpjob.models import TinyCNN


def conv_nobn(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, num_classes))


class SignallingCNN(TinyCNN):
    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        # Test-only plumbing: the node-side package never reads the environment outside
        # cluster.py, but a test plugin may.
        spec = os.environ.get("DDPJOB_TEST_SIGNAL", "")
        rank, call = (spec.split(":") + ["", ""])[:2] if spec else ("", "")
        self._armed = spec != "" and rank == os.environ.get("RANK", "0")
        self._at = int(call) if call else 0
        self._calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self._calls += 1
            if self._armed and self._calls == self._at:
                os.kill(os.getpid(), signal.SIGUSR2)
        return super().forward(x)


def signalling_cnn(num_classes: int = 10) -> nn.Module:
    return SignallingCNN(num_classes)
