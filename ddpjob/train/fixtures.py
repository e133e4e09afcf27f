"""CIFAR-10-format files without the download: for tests, benchmarks and offline demos.

Writes the same layout as the official `cifar-10-python.tar.gz` (`cifar-10-batches-py/` with
`data_batch_1..5`, `test_batch`, `batches.meta`), so `data.load_cifar10` and the dataset-prep
command can be exercised on a machine that cannot reach the internet.
"""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

FOLDER = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer",
               "dog", "frog", "horse", "ship", "truck")


def _py2_pickle(obj: Any) -> bytes:
    """Pickle `obj` the way Python 2's cPickle wrote the official archive (protocol 2).

    Why: Python 3 cannot produce Python-2 `str` opcodes (SHORT_BINSTRING/BINSTRING) or the
    `numpy.core.multiarray` name, yet those are exactly what readers of the real files meet.
    Supports dict, list, int, bytes (as a py2 str) and 2-D uint8 numpy arrays.
    """
    out = bytearray(b"\x80\x02")

    def s(b: bytes) -> None:  # a py2 str
        out.extend(b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b)

    def i(v: int) -> None:
        if 0 <= v < 256:
            out.extend(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            out.extend(b"M" + struct.pack("<H", v))
        else:
            out.extend(b"J" + struct.pack("<i", v))

    def put(o: Any) -> None:
        if isinstance(o, dict):
            out.extend(b"}(")
            for k, v in o.items():
                put(k)
                put(v)
            out.extend(b"u")
        elif isinstance(o, list):
            out.extend(b"](")
            for v in o:
                put(v)
            out.extend(b"e")
        elif isinstance(o, bytes):
            s(o)
        elif isinstance(o, (int, np.integer)):
            i(int(o))
        elif isinstance(o, np.ndarray) and o.dtype == np.uint8 and o.ndim == 2:
            # numpy's __reduce__: _reconstruct(ndarray, (0,), 'b'), then BUILD with the state
            # (version, shape, dtype, fortran_order, raw bytes).
            out.extend(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85")
            s(b"b")
            out.extend(b"\x87R(K\x01(")
            i(o.shape[0])
            i(o.shape[1])
            out.extend(b"tcnumpy\ndtype\n")
            s(b"u1")
            out.extend(b"K\x00K\x01\x87R(K\x03")
            s(b"|")
            out.extend(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89")
            s(np.ascontiguousarray(o).tobytes())
            out.extend(b"tb")
        else:
            raise TypeError(f"_py2_pickle cannot write {type(o).__name__}")

    put(obj)
    out.extend(b".")
    return bytes(out)


def _images(n: int, seed: int, split: str, learnable: bool) -> tuple[np.ndarray, list[int]]:
    if learnable:
        from ddpjob.train.data import make_synthetic  # lazy: data imports torch

        ds = make_synthetic(n, seed, split=split)
        return ds.images.reshape(n, 3072).numpy(), [int(v) for v in ds.labels]
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    return (rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            [int(v) for v in rng.integers(0, 10, n)])


def write_cifar10_folder(root: str | Path, n_train: int = 500, n_test: int = 100, seed: int = 0,
                         learnable: bool = True, str_keys: bool = False) -> Path:
    """Write `root/cifar-10-batches-py/` and return that folder.

    `str_keys=False` (default) writes Python-2-style pickles with byte-string keys, like the
    official archive; `str_keys=True` writes ordinary Python 3 pickles with str keys (what a
    re-pickled copy looks like). `learnable` uses `make_synthetic` images, else uniform noise.
    """
    folder = Path(root) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, obj: dict[bytes, Any]) -> None:
        if str_keys:
            plain = {k.decode(): ([v.decode() for v in o] if k == b"label_names" else o)
                     for k, o in obj.items()}
            data = pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            data = _py2_pickle(obj)
        (folder / name).write_bytes(data)

    train_x, train_y = _images(n_train, seed, "train", learnable)
    bounds = np.linspace(0, n_train, 6).astype(int)  # five batches, as even as possible
    for b in range(5):
        lo, hi = bounds[b], bounds[b + 1]
        dump(f"data_batch_{b + 1}", {
            b"batch_label": f"training batch {b + 1} of 5".encode(),
            b"labels": train_y[lo:hi],
            b"data": train_x[lo:hi],
            b"filenames": [f"img_{k:05d}.png".encode() for k in range(lo, hi)],
        })
    test_x, test_y = _images(n_test, seed, "test", learnable)
    dump("test_batch", {b"batch_label": b"testing batch 1 of 1", b"labels": test_y, b"data": test_x,
                        b"filenames": [f"test_{k:05d}.png".encode() for k in range(n_test)]})
    dump("batches.meta", {b"num_cases_per_batch": int(bounds[1] - bounds[0]),
                          b"label_names": [n.encode() for n in LABEL_NAMES], b"num_vis": 3072})
    (folder / "readme.html").write_text("<html>ddpjob test fixture in CIFAR-10 format</html>\n")
    return folder


def write_cifar10_archive(path: str | Path, n_train: int = 500, n_test: int = 100, seed: int = 0,
                          learnable: bool = True, str_keys: bool = False) -> Path:
    """Write a `cifar-10-python.tar.gz` (members `cifar-10-batches-py/...`) and return its path.

    `path` is the archive file, or an existing folder to put `cifar-10-python.tar.gz` in.
    """
    import tempfile

    target = Path(path)
    if target.is_dir():
        target = target / ARCHIVE
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_cifar10_folder(tmp, n_train, n_test, seed, learnable, str_keys)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(folder, arcname=FOLDER)
        target.write_bytes(buf.getvalue())
    return target
