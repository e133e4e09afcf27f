"""`train.compile`'s caches (ddpjob/node/compilecache.py), in-process: they go into the run dir,
unless the user chose a place (TORCHINDUCTOR_CACHE_DIR wins). The compiled run across a stop is
tests/ranks/test_compile_ranks.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpjob.node import compilecache
from ddpjob.node.cluster import ClusterEnv


def test_the_caches_go_into_the_run_dir_unless_the_user_chose_a_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores whatever was there before
        monkeypatch.delenv(name)
    compilecache.use_run_dir(tmp_path / "a", ClusterEnv.from_environ(dict(os.environ)))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "a" / "cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "a" / "cache" / "triton")
    # a later init in the same process (another run dir) moves what ddpjob set ...
    compilecache.use_run_dir(tmp_path / "b", ClusterEnv.from_environ(dict(os.environ)))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "b" / "cache" / "inductor")
    # ... but never a place the user exported
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/site/cache")
    compilecache.use_run_dir(tmp_path / "c", ClusterEnv.from_environ(dict(os.environ)))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/site/cache"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "cache" / "triton")
