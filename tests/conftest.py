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
import pathlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import distributed  # noqa: E402

pytest_plugins = ["tests.cpu_durations"]  # --cpu-durations=N: CPU seconds per test, whatever the load

SPAWNING_FIXTURES = {"training_run"}

# The runs the tests ask ``training_run`` for, grouped so that one spawn trains a whole group (a
# process start and a first compile cost more than a tiny model's run): the first request of a
# run trains its group. Runs not listed train alone.
TRAINING_GROUPS = (
    tuple(("gpt", stage) for stage in range(4)),
    (*(("mlp", stage) for stage in range(4)), ("mlp_scalar", 3), ("mlp_break", 0), ("mlp_break", 3)),
)


@functools.lru_cache(maxsize=None)
def _training_group(runs: tuple[tuple[str, int], ...], world_size: int, batch_size: int) -> dict:
    from tests.workers import train_runs

    per_rank = distributed.spawn(train_runs, world_size, runs, 3, batch_size, 1e-3, timeout_s=600)
    return {run: tuple(rank[run] for rank in per_rank) for run in runs}


def _training_run(name: str, stage: int, world_size: int, batch_size: int) -> tuple:
    run = (name, stage)
    group = next((g for g in TRAINING_GROUPS if run in g), (run,)) if (world_size, batch_size) == (2, 4) else (run,)
    return _training_group(group, world_size, batch_size)[run]


@pytest.fixture(scope="session")
def training_run():
    """``training_run(name, stage, world_size=2, batch_size=4)`` -> per-rank results of 3 AdamW
    steps at lr 1e-3 (``tests.workers.train``), run once per session and shared by the tests."""
    return lambda name, stage, world_size=2, batch_size=4: _training_run(name, stage, world_size, batch_size)


@functools.lru_cache(maxsize=None)
def _one_rank_run(name: str, stage: int, world_size: int) -> dict:
    from tests.workers import train

    return distributed.run_as_rank(train, world_size, name, stage, 3, 2 * world_size, 1e-3)


@pytest.fixture(scope="session")
def one_rank():
    """``one_rank(name, stage, world_size=2)`` -> rank 0's result of ``training_run``'s 3 steps,
    run in this process as rank 0 of a fake world (``zerograph.fake_world``): its graphs, shards,
    collectives and bytes are those of rank 0 of a real world; its losses and parameters are
    meaningless. For checks of structure and accounting; once per session."""
    return lambda name, stage, world_size=2: _one_rank_run(name, stage, world_size)


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


# session fixtures that cache costly runs for several files (see _xdist_group)
SHARED_RUN_FIXTURES = ("training_run", "one_rank")
REPO = pathlib.Path(__file__).resolve().parent.parent  # xdist's node ids are relative to it


@functools.lru_cache(maxsize=None)
def _xdist_group(path: str) -> str:
    """The unit of work ``pytest -n 2 --dist loadfile`` (``make test``) gives one worker: a file,
    so that its module fixtures (one spawn each) run once; or, for a file whose tests take a
    shared-run session fixture, that fixture's name, so its cached runs are made on one worker.
    Read from the file's text: xdist's controller schedules by node id, without the items."""
    try:
        text = (REPO / path).read_text()
    except OSError:
        return path
    for name in SHARED_RUN_FIXTURES:
        if re.search(rf"def test_\w+\([^)]*\b{name}\b", text):
            return name
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with the files that share a session run grouped (``_xdist_group``)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_group(nodeid.split("::", 1)[0])

    return SharedRunScheduling(config, log)
