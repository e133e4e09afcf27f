"""The public API's examples (examples/charlm, examples/cifar10_resnet18) made small enough for
tests: their job files with tests/example_hooks.py as the entry, and their sample logs read back.
Shared by tests/ranks/test_examples_ranks.py, test_fsdp.py and the cluster tier's
test_examples_slurm.py and test_fsdp_slurm.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clirun import REPO

CHARLM = REPO / "examples" / "charlm"
CIFAR = REPO / "examples" / "cifar10_resnet18"
# charlm small enough for a few seconds of training on 2 CPU ranks: 1200-odd windows of 32
CHARLM_SMALL = {"context": 32, "stride": 32, "hidden": 32, "batch_size": 32, "max_steps": 12,
                "log_sample_ids": True, "print_every": 4, "sample_chars": 10}
CIFAR_SMALL = {"epochs": 2, "batch_size": 16, "num_workers": 2}  # 64 images: 4 steps/epoch


def hook_job(path: Path, script: Path, base: Path, **sections: dict[str, Any]) -> Path:
    """The example's own job file with `example_hooks:main` as the entry (the script its first
    argument) and `sections` ({"user": {...}}) replacing the values of those keys."""
    values = {"train": {"entry": "example_hooks:main", "args": [str(script)]}}
    for name, table in sections.items():
        values.setdefault(name, {}).update(table)
    lines, section = [], ""
    for line in base.read_text().splitlines():
        if line.startswith("["):
            section = line.split("]")[0].strip("[")
        key = line.split("=")[0].strip()
        if "=" in line and key in values.get(section, {}):
            line = f"{key} = {json.dumps(values[section][key])}"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def samples_by_step(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """step -> that step's records from the newest restart that ran it (replays win)."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {}).setdefault(rec["restart"], []).append(rec)
    return {step: runs[max(runs)] for step, runs in by_step.items()}
