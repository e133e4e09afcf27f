"""DCP's file formats as ddpjob uses them (store/sharded.py): the writer (one file per rank,
fsync'd, the metadata under a visible name), the save planner, and the reading side, where
nothing is unpickled freely: the metadata goes through an unpickler that knows DCP's few
metadata classes and plain values through torch.load(weights_only=True). Its own module
because torch.distributed.checkpoint is heavy to import: only a sharded save or load does.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ddpjob.errors import DDPJobError
from ddpjob.store import manifest
from ddpjob.store.manifest import DCP_METADATA as METADATA

_DCP_METADATA = ".metadata"  # what FileSystemWriter writes (torch 2.4 - 2.14 at least)


class _Writer(FileSystemWriter):
    """DCP's writer (one file per rank, fsync'd) whose metadata file gets a visible name."""

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:  # rank 0 only
        super().finish(metadata, results)
        os.replace(Path(self.path) / _DCP_METADATA, Path(self.path) / METADATA)


def writer(staging: Path) -> Any:
    return _Writer(staging, single_file_per_rank=True, sync_files=True, thread_count=1)


def planner() -> Any:
    """Values every rank holds alike (buffers, Adam's step count, hyperparameters) are written by
    rank 0, as the `<key>.pt` files are: DCP's default picks the rank with the least to write."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata is a pickle (torch has no weights_only reader for it): this unpickler
    builds only DCP's metadata dataclasses, dtypes and sizes, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(path: Path) -> Metadata:
    try:
        with open(path / METADATA, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise DDPJobError(f"refusing to load {path / METADATA}: it is not DCP metadata ({err})",
                          "load only checkpoints ddpjob wrote; delete this one to resume from an "
                          "older checkpoint") from None
    stored = getattr(md, "storage_data", None)
    bad = [] if isinstance(md, Metadata) and isinstance(stored, dict) else ["(no storage table)"]
    for info in (stored or {}).values() if not bad else ():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and manifest.FILE_NAME.fullmatch(name)):
            bad.append(repr(name))  # only files of this folder: never "../elsewhere"
    if bad:
        raise DDPJobError(f"refusing to load {path / METADATA}: it names files outside its "
                          f"checkpoint or none ({', '.join(bad[:3])})",
                          "load only checkpoints ddpjob wrote")
    return md


class Reader(FileSystemReader):
    """DCP's reader with the metadata read once, through _MetadataUnpickler (read_metadata)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._metadata = read_metadata(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: ddpjob never writes those
            raise FileNotFoundError(f"{self.path}: no per-rank metadata")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but plain values (hyperparameters, names) load with weights_only=True
    (DCP's own load_bytes unpickles anything)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise DDPJobError(f"refusing to load '{read_item.dest_index.fqn}' of a sharded checkpoint: "
                              f"it holds more than tensors and plain values ({str(err).splitlines()[0]})",
                              "load only checkpoints you trust") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
