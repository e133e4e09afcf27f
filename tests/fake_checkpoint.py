"""A committed checkpoint folder as the store writes it (files + manifest.json with sizes and
sha256), without torch: for tests of the views that read checkpoints (status, the ledger)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def committed(run_dir: Path, step: int, *, damaged: bool = False) -> Path:
    """RUN_DIR/checkpoints/step-N with one file; `damaged`: the file is truncated after the
    manifest was written (what a resume skips)."""
    d = run_dir / "checkpoints" / f"step-{step:09d}"
    d.mkdir(parents=True)
    data = f"weights of step {step}".encode()
    (d / "model.pt").write_bytes(data)
    files = {"model.pt": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "step": step, "files": files}))
    if damaged:
        (d / "model.pt").write_bytes(data[:5])
    return d
