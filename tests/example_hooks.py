"""A test-only `train.entry` around the example scripts, so that the examples carry no test code.

    [train] entry = "example_hooks:main"
    [train] args = ["examples/charlm/train.py", ...the script's own args]

Two hooks, both from the environment:
  DDPJOB_TEST_STOP_AT="STEP[:RANKS]"  each listed rank (default: all) sends itself SIGUSR2 when
      `job.steps()` hands out STEP, in the first incarnation only: the stop request lands while
      that step runs, caused by the step and not by a timer. Only the rank process is signalled,
      never its group: the DataLoader workers would die of SIGUSR2.
  always: torchvision's CIFAR-10 md5 checks accept any existing file, because the fixture data
      (ddpjob.train.fixtures.write_cifar10_folder) has the official layout but not the official bytes.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from collections.abc import Iterator
from typing import Any

from ddpjob import api


def _stop_hook(spec: str) -> None:
    step_text, _, ranks_text = spec.partition(":")
    at = int(step_text)
    ranks = {int(r) for r in ranks_text.split(",")} if ranks_text else None
    steps = api.Job.steps

    def steps_with_signal(self: api.Job, state: dict[str, Any], total: int, **info: Any) -> Iterator[int]:
        for step in steps(self, state, total, **info):
            if step == at and self.restart == 0 and (ranks is None or self.rank in ranks):
                os.kill(os.getpid(), signal.SIGUSR2)  # handled by ddpjob's flag-only handler
            yield step

    api.Job.steps = steps_with_signal  # type: ignore[method-assign]


def _accept_fixture_cifar() -> None:
    from torchvision.datasets import cifar

    cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)  # used by _load_meta
    cifar.CIFAR10._check_integrity = lambda self: all(  # type: ignore[method-assign]
        os.path.isfile(os.path.join(self.root, self.base_folder, name))
        for name, _ in self.train_list + self.test_list)


def main() -> None:
    script, *args = sys.argv[1:]
    if os.environ.get("DDPJOB_TEST_STOP_AT"):
        _stop_hook(os.environ["DDPJOB_TEST_STOP_AT"])
    _accept_fixture_cifar()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would
    runpy.run_path(script, run_name="__main__")
