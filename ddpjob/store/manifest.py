"""What makes a committed checkpoint valid, without torch: `step-N/manifest.json` (written last)
names every file with its size and sha256. The store (commit.py) writes and verifies with it;
the login side (`ddpjob status`, `ls`) and the batch shell's crash decision read the newest
valid checkpoint through it, so they never show or count a folder a resume would skip.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DCP_METADATA = "dcp.metadata"  # a sharded checkpoint's DCP metadata, under a visible name (dcpio.py)
STEP_DIR = re.compile(r"step-(\d+)", re.ASCII)
# a plain name in the checkpoint's own folder (never "..", never a path); a leading "_" for the
# shard files DCP names itself (`__<rank>_0.distcp`, store/sharded.py)
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", re.ASCII)


MANIFEST_LIMIT = 16 << 20  # bytes: a manifest lists a few files (a DCP one a shard per rank)

def read(folder: Path) -> dict[str, Any]:
    """The parsed manifest; {} when missing, unparsable or not an object."""
    from ddpjob.fileio import read_bounded

    try:
        manifest = json.loads(read_bounded(folder / MANIFEST, MANIFEST_LIMIT))
    except (OSError, ValueError, RecursionError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def committed(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under root, newest first (not verified).
    Names starting with a dot are saves in flight or deletions: never listed. An unreadable
    root raises OSError: "cannot tell" must not read as "no checkpoint"."""
    entries = list(root.iterdir()) if root.is_dir() else []
    found = [(int(m.group(1)), p) for p in entries if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found, key=lambda sp: sp[0], reverse=True)


def verify(folder: Path, step: int, config_hash: str = "", *, hashes: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else a one-line reason. hashes=False:
    every check but the sha256 of the files (cheap: what pruning uses)."""
    from ddpjob.fileio import RecordError, read_bounded

    try:
        manifest = json.loads(read_bounded(folder / MANIFEST, MANIFEST_LIMIT))
    except FileNotFoundError:
        return "missing manifest.json (the save never finished)"
    except RecordError as err:
        return f"unreadable manifest.json ({err})"
    except (OSError, ValueError, RecursionError) as err:
        return f"unparsable manifest.json ({type(err).__name__})"
    if not isinstance(manifest, dict):
        return "unparsable manifest.json (not a JSON object)"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format version {manifest.get('format_version')!r} unknown (this ddpjob reads {FORMAT_VERSION})"
    if manifest.get("step") != step:
        return f"manifest says step {manifest.get('step')!r} but the folder is step-{step}"
    if config_hash and manifest.get("config_hash") != config_hash:
        return (f"checkpoint was written by a different job config "
                f"(config hash {manifest.get('config_hash')!r}, this job has {config_hash!r})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest.json lists no files"
    try:
        return _check_files(folder, files, hashes)
    except OSError as err:  # e.g. pruned by another process while we read it
        return f"unreadable ({err.strerror or err})"


def newest_valid(root: Path) -> tuple[int, Path] | None:
    """The checkpoint a resume would pick (config hash aside): newest first, hashing each.
    None also when root cannot be read (for views: status, the crash ledger)."""
    try:
        return next(((s, p) for s, p in committed(root) if verify(p, s) is None), None)
    except OSError:
        return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_files(folder: Path, files: dict[str, Any], hashes: bool) -> str | None:
    """Cheap checks on every file (name, presence, size) before any hashing."""
    for name, entry in files.items():
        if not (isinstance(name, str) and FILE_NAME.fullmatch(name) and isinstance(entry, dict)):
            return f"manifest.json has a malformed entry {name!r}"  # also stops "../x" paths
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"file {name} missing"
        if size != entry.get("size"):
            return f"{name} is {size} bytes, manifest says {entry.get('size')} (truncated or overwritten)"
    extra = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST and p.name not in files)
    if extra:
        return f"files not listed in manifest.json: {', '.join(extra)}"
    for name, entry in files.items() if hashes else ():
        if sha256(folder / name) != entry.get("sha256"):
            return f"{name} sha256 mismatch (corrupted on disk)"
    return None
