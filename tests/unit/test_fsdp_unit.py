"""`[train] strategy = "fsdp"`: examples/charlm sharded with FSDP2, checkpoints through DCP.

Local ranks (tests/ranks.py); stops caused at a given step by tests/example_hooks.py, never by a
timer. Same world size: the resumed run equals the uninterrupted one bit for bit. 4 ranks -> 2:
every sample once per epoch, and the final loss within 1e-5 of the uninterrupted run at the
original world size (4 ranks) - with dropout 0: dropout masks come from each rank's own RNG, so
another rank count draws other masks and no tolerance would hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest



# ------------------------------------------------------------------ config and the metadata reader
@pytest.mark.parametrize("sets, found", [
    (["train.strategy=\"zero\""], "train.strategy is 'zero', expected one of ddp, fsdp"),
    (["train.strategy=\"fsdp\"", "train.sync_batchnorm=true"], "with train.sync_batchnorm"),
    (["train.strategy=\"fsdp\"", "train.compile=true"], "with train.compile"),
    (["train.strategy=\"fsdp\"", "train.amp=\"fp16\""], "with train.amp = \"fp16\""),
])
def test_config_refuses_what_fsdp_cannot_do_in_one_line(sets: list[str], found: str) -> None:
    from ddpjob import jobfile
    from ddpjob.errors import UsageError
    from ranks import REPO

    with pytest.raises(UsageError) as err:
        jobfile.resolve(REPO / "jobs" / "smoke.toml", sets)
    line = err.value.line()
    assert found in line and "Hint: " in line and "\n" not in line


def test_strategy_ddp_keeps_the_config_hash_fsdp_changes_it() -> None:
    """Runs started before the key existed still resume (ddp is the default); a run cannot
    switch strategy (its checkpoints are another layout)."""
    from ddpjob import jobfile

    plain = jobfile.from_dict({})
    assert jobfile.from_dict({"train": {"strategy": "ddp"}}).hash() == plain.hash()
    assert jobfile.from_dict({"train": {"strategy": "fsdp"}}).hash() != plain.hash()
    d = plain.to_dict()
    del d["train"]["strategy"]  # a config.json written by an older ddpjob
    assert jobfile.from_dict(d).hash() == plain.hash()


def test_dcp_metadata_reader_builds_only_dcp_classes(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle: ddpjob's reader refuses anything but DCP's own classes, and
    file names outside the checkpoint folder."""
    import os
    import pickle

    from ddpjob.errors import DDPJobError
    from ddpjob.store import dcpio, sharded

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(DDPJobError, match="posix.system is not part of DCP's metadata|system is not part"):
        dcpio.read_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    md = Metadata({}, storage_data={MetadataIndex("x"): _StorageInfo("../../etc/passwd", 0, 1)})
    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(DDPJobError, match="names files outside its checkpoint"):
        dcpio.read_metadata(tmp_path)
    md.storage_data = {MetadataIndex("x"): _StorageInfo("__0_0.distcp", 0, 1)}
    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(md))
    assert dcpio.read_metadata(tmp_path).storage_data[MetadataIndex("x")].relative_path == "__0_0.distcp"
