"""`ddpjob data cifar10 --root DIR`: fetch, verify and extract a dataset once, on the login node.

Runs before any job (downloading inside a distributed job races between ranks). Archive (URL or
--from FILE) -> md5 -> safe extraction into a hidden temp folder inside the root -> validation
with the trainer's own reader (data.load_cifar10) -> one rename to `root/cifar-10-batches-py`.
doctor.py reuses `cifar10_problem` to tell whether a data root is ready.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import re
import shlex
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path

from ddpjob import console
from ddpjob.errors import DDPJobError, UsageError

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
FOLDER = "cifar-10-batches-py"
FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch", "batches.meta")
# The real archive unpacks to ~178 MB; a member list adding up to more than this is not
# CIFAR-10 (or is a decompression bomb) and is refused before anything is written.
MAX_EXTRACTED_BYTES = 1 << 30
CHUNK = 1 << 20


def _hint(root: Path) -> str:
    return f"run `ddpjob data cifar10 --root {shlex.quote(str(root))}` on the login node"


# --------------------------------------------------------------------------- is it there?
def cifar10_problem(root: str | Path, full: bool = True) -> str | None:
    """None when `root/cifar-10-batches-py` holds a complete CIFAR-10 set, else what is wrong.

    `full=False` is the cheap form (file presence and each pickle's final STOP opcode, which a
    truncated file lacks); `full=True` also reads every file with the trainer's reader.
    """
    folder = Path(root) / FOLDER
    if not folder.is_dir():
        return f"{folder} does not exist"
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        return f"{folder} lacks {', '.join(missing)}"
    for name in FILES:
        try:
            with open(folder / name, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return f"{folder / name} is empty"
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b".":  # every pickle ends with STOP
                    return f"{folder / name} is truncated (no pickle end marker)"
        except OSError as exc:
            return f"cannot read {folder / name} ({exc.strerror})"
    if full:
        from ddpjob.train.data import load_cifar10  # imports torch: only for the full check

        try:
            load_cifar10(folder, train=True)
            load_cifar10(folder, train=False)
        except DDPJobError as exc:
            return exc.message
    return None


# --------------------------------------------------------------------------- fetch
def md5_of(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _reporter(total: int | None, label: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(advance(n), close()): a rich bar on a terminal, a plain line per 10 % otherwise."""
    if console.is_terminal():
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        bar = Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn())
        task = bar.add_task(label, total=total)
        bar.start()
        return (lambda n: bar.advance(task, n)), bar.stop
    done, shown = [0], [-1]

    def advance(n: int) -> None:
        done[0] += n
        # a line per 10 %, or per 16 MB when the server sends no Content-Length
        mark = done[0] * 10 // total if total else done[0] >> 24
        if mark > shown[0]:
            shown[0] = mark
            of = f" of {total / 1e6:.1f} MB ({mark * 10}%)" if total else " MB so far"
            console.info(f"{label}: {done[0] / 1e6:.1f}{of}")

    return advance, lambda: None


def download(url: str, dest: Path, timeout_s: float = 60.0) -> str:
    """Stream `url` into `dest` (created); returns the md5 of what arrived."""
    h = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            advance, close = _reporter(total, f"downloading {url.rsplit('/', 1)[-1]}")
            got = 0
            try:
                with open(dest, "wb") as out:
                    while chunk := resp.read(CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        got += len(chunk)
                        advance(len(chunk))
            finally:
                close()
    except urllib.error.HTTPError as exc:
        raise DDPJobError(f"downloading {url} failed: HTTP {exc.code} {exc.reason}",
                          "check the address, or fetch the archive by other means and pass "
                          "--from FILE") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise DDPJobError(f"downloading {url} failed ({why})",
                          "no internet on this machine? fetch cifar-10-python.tar.gz elsewhere, "
                          "copy it here and pass --from FILE") from None
    if total is not None and got != total:
        raise DDPJobError(f"download of {url} ended after {got} of {total} bytes",
                          "the connection dropped: run the same command again")
    return h.hexdigest()


# --------------------------------------------------------------------------- extract
def _bad_member(archive: Path, name: str, why: str) -> DDPJobError:
    return DDPJobError(f"archive {archive} holds member {name!r}, which {why}; refusing to "
                       "extract it", "use the official cifar-10-python.tar.gz; this one is "
                       "damaged or was built to write outside the data root")


def _members(tar: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    """The members under cifar-10-batches-py/, after refusing anything unsafe in the archive."""
    keep, total = [], 0
    for m in tar.getmembers():  # reads (decompresses) the whole archive: truncation shows here
        parts = m.name.replace("\\", "/").split("/")
        if m.name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", m.name):
            raise _bad_member(archive, m.name, "is an absolute path")
        if ".." in parts:
            raise _bad_member(archive, m.name, "climbs out with '..'")
        if not (m.isfile() or m.isdir()):
            raise _bad_member(archive, m.name, "is a link or special file, not a plain file")
        total += m.size
        if total > MAX_EXTRACTED_BYTES:
            raise DDPJobError(f"archive {archive} unpacks to more than "
                              f"{MAX_EXTRACTED_BYTES >> 20} MB, expected about 180 MB",
                              "this is not the CIFAR-10 python archive")
        if parts[0] == FOLDER:
            keep.append(m)
    if not keep:
        raise DDPJobError(f"archive {archive} has no {FOLDER}/ folder",
                          "expected the python version, cifar-10-python.tar.gz (not the binary "
                          "or matlab one)")
    return keep


def extract_cifar10(archive: Path, root: Path) -> None:
    """Extract, validate, then rename into place: `root/cifar-10-batches-py` is all or nothing."""
    tmp = Path(tempfile.mkdtemp(prefix=".cifar-10-extract-", dir=root))
    try:
        try:
            # gzip's CRC-32 sits at the very end, which tarfile never reads (it stops at the tar
            # end marker): decompress it all once, so a flipped bit fails even with --no-verify.
            with gzip.open(archive, "rb") as gz:
                while gz.read(CHUNK):
                    pass
            with tarfile.open(archive, "r:gz") as tar:
                members = _members(tar, archive)
                if hasattr(tarfile, "data_filter"):  # 3.10.12+/3.11.4+: a second line of defence
                    tar.extractall(tmp, members=members, filter="data")
                else:  # pragma: no cover - _members already refused everything unsafe
                    tar.extractall(tmp, members=members)
        except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as exc:
            if isinstance(exc, OSError) and exc.errno is not None and exc.filename:
                raise DDPJobError(f"cannot write {exc.filename} ({exc.strerror})",
                                  "check free space and permissions of the data root") from None
            raise DDPJobError(f"archive {archive} is corrupt or truncated "
                              f"({type(exc).__name__}: {' '.join(str(exc).split()) or 'unexpected end'})",
                              "download it again (the official md5 is " + CIFAR10_MD5 + ")") from None
        problem = cifar10_problem(tmp)
        if problem is not None:
            problem = problem.replace(str(tmp), "<archive>")
            raise DDPJobError(f"archive {archive} does not hold a complete CIFAR-10 set: {problem}",
                              "download it again; expected the python version, cifar-10-python.tar.gz")
        _install(tmp / FOLDER, root / FOLDER, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(new: Path, dest: Path, root: Path) -> None:
    """Rename the validated folder into place; a broken old copy is swapped out, not merged."""
    if dest.exists():
        if cifar10_problem(root) is None:  # another `ddpjob data` finished first: keep it
            return
        trash = Path(tempfile.mkdtemp(prefix=".cifar-10-old-", dir=root))
        os.rename(dest, trash / FOLDER)
        try:
            os.rename(new, dest)
        except OSError:
            os.rename(trash / FOLDER, dest)  # put the old one back rather than leave nothing
            raise
        finally:
            shutil.rmtree(trash, ignore_errors=True)
        return
    try:
        os.rename(new, dest)
    except OSError:
        if cifar10_problem(root) is not None:  # not a lost race: a real failure
            raise


# --------------------------------------------------------------------------- the command
def prepare_cifar10(root: str | Path, *, from_file: str | Path | None = None,
                    url: str = CIFAR10_URL, md5: str | None = CIFAR10_MD5) -> str:
    """Make `root/cifar-10-batches-py` complete; returns what was done (one line).

    md5=None skips the checksum (a custom archive); the contents are still validated.
    """
    root = Path(root).absolute()
    if cifar10_problem(root) is None:
        return f"CIFAR-10 is already present and complete in {root / FOLDER}: nothing to do"
    created = [p for p in (root, *root.parents) if not p.exists()]  # removed again on failure
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DDPJobError(f"cannot create the data root {root} ({exc.strerror})",
                          "choose a --root you can write to (on a filesystem the compute nodes see)") from None
    part: Path | None = None
    try:
        if from_file is not None:
            archive = Path(from_file)
            if not archive.is_file():
                raise DDPJobError(f"archive {archive} not found", "check the --from path")
            digest = md5_of(archive) if md5 else ""
        else:
            fd, name = tempfile.mkstemp(prefix=".cifar-10-python.", suffix=".tar.gz.part", dir=root)
            os.close(fd)
            part = archive = Path(name)
            digest = download(url, archive)
        if md5 and digest != md5:
            raise DDPJobError(f"archive {from_file or url} has md5 {digest}, expected {md5}: it is "
                              "truncated, corrupt or not the official file",
                              "download it again; for a custom archive you trust, pass its --md5 "
                              "or --no-verify")
        extract_cifar10(archive, root)
        created = []
    finally:
        if part is not None:
            part.unlink(missing_ok=True)
        for p in created:  # innermost first; a folder someone else filled meanwhile stays
            try:
                p.rmdir()
            except OSError:
                break
    return f"CIFAR-10 ready in {root / FOLDER} (from {from_file or url}" + \
        (", md5 verified)" if md5 else ", md5 not checked: --no-verify)")


def cmd_data(args: argparse.Namespace) -> int:
    if args.dataset != "cifar10":  # argparse choices already say so; kept for direct callers
        raise UsageError(f"dataset {args.dataset!r} is not known, expected cifar10", "ddpjob data cifar10 --root DIR")
    md5 = getattr(args, "md5", None)
    if md5 is not None and not re.fullmatch(r"[0-9a-fA-F]{32}", md5):
        raise UsageError(f"--md5 {md5!r} is not an md5 checksum, expected 32 hex digits",
                         "compute it with `md5sum ARCHIVE`")
    if args.from_file and args.url:
        raise UsageError("--from and --url given together, expected one source",
                         "--from FILE for an archive you have, --url URL to download")
    if getattr(args, "no_verify", False):
        if md5 is not None:
            raise UsageError("--md5 and --no-verify given together, expected one of them",
                             "drop --no-verify to check against --md5")
        expected = None
    else:
        expected = (md5 or CIFAR10_MD5).lower()
    message = prepare_cifar10(args.root, from_file=args.from_file, url=args.url or CIFAR10_URL,
                              md5=expected)
    console.info(message)
    return 0
