"""Fixtures shared by the cluster tier's modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from test_preemption_slurm import Reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """The uninterrupted reference run of test_preemption_slurm's job (4 local ranks), trained
    once per pytest session: test_preemption_slurm, test_requeue_slurm and test_container_slurm
    compare their SLURM runs bit for bit with the same run (each module trained its own before)."""
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    if ref.ranks is not None:
        ref.ranks.kill()
