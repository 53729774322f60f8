"""Shared fixtures and the markers of the fast lane.

Markers (registered in pyproject.toml): ``distributed`` (spawns gloo ranks), ``gpu`` (needs CUDA;
skipped without it), ``slow`` (long in one process). ``make test-fast`` runs
``-m "not distributed and not slow"``. A test that uses the ``training_run`` fixture is marked
``distributed`` here; any other test that spawns ranks carries the marker itself, and
``tests.distributed.spawn`` raises ``SpawnNotMarked`` in a test without it, so a new multi-rank
test cannot slip into the fast lane unmarked.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import distributed  # noqa: E402

SPAWNING_FIXTURES = {"training_run"}


@functools.lru_cache(maxsize=None)
def _training_run(name: str, stage: int, world_size: int, batch_size: int) -> tuple:
    from tests.workers import train

    return tuple(distributed.spawn(train, world_size, name, stage, 3, batch_size, 1e-3))


@pytest.fixture(scope="session")
def training_run():
    """``training_run(name, stage, world_size=2, batch_size=4)`` -> per-rank results of 3 AdamW
    steps at lr 1e-3, run once per session and shared by the parity and structure tests."""
    return lambda name, stage, world_size=2, batch_size=4: _training_run(name, stage, world_size, batch_size)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Let ``tests.distributed.spawn`` run only inside tests marked ``distributed``: set before
    any fixture of the test (module and session fixtures included) is set up."""
    marked = item.get_closest_marker("distributed") is not None
    distributed.spawn_allowed = lambda: marked
