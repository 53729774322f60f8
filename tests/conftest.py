import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import functools

import pytest


@functools.lru_cache(maxsize=None)
def _training_run(name: str, stage: int, world_size: int, batch_size: int) -> tuple:
    from tests.distributed import spawn
    from tests.workers import train

    return tuple(spawn(train, world_size, name, stage, 3, batch_size, 1e-3))


@pytest.fixture(scope="session")
def training_run():
    """``training_run(name, stage, world_size=2, batch_size=4)`` -> per-rank results of 3 AdamW
    steps at lr 1e-3, run once per session and shared by the parity, accounting and structure tests."""
    return lambda name, stage, world_size=2, batch_size=4: _training_run(name, stage, world_size, batch_size)
