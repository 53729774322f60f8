"""Shared fixtures and the markers of the fast lane.

Markers (registered in pyproject.toml): ``distributed`` (spawns gloo ranks), ``slow`` (long in
one process), ``own_scope`` (spawns outside the spawn lane's order). ``make test-fast`` runs
``-m "not distributed and not slow"``. A test that uses the ``training_run`` fixture is marked
``distributed`` here; any other test that spawns ranks carries the marker itself, and
``tests.distributed.spawn`` raises ``SpawnNotMarked`` in a test without it, so a new multi-rank
test cannot slip into the fast lane unmarked.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ast  # noqa: E402
import functools  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

# torch and zerograph (through tests.distributed) are imported inside the hooks and fixtures: under
# pytest-xdist the controller loads this file before it starts the workers and runs none of them,
# so importing torch here would hold every worker's start back by torch's import

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
    from tests import distributed
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
    from tests import distributed
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
    misread = []
    for item in items:
        if SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)
        marked = item.get_closest_marker("distributed") is not None
        scope = _xdist_scope(item.nodeid)
        if marked != (scope == SPAWN_LANE or scope.startswith(OWN_SCOPE)):
            misread.append(item.nodeid)
    if misread:  # the two lanes of `make test` would run two spawns at once
        raise pytest.UsageError(f"tests/conftest.py's _spawning_tests misreads which tests spawn: {misread[:5]}; "
                                "mark them with @pytest.mark.distributed on the test function or pytestmark")


def _without_pytest_handlers_on_the_structured_trace() -> None:
    """pytest's log capture attaches its handlers to every non-propagating logger, torch's
    structured trace (``torch._logging._internal.trace_log``) among them. ``trace_structured``
    builds its payload whenever that logger has a handler, so under pytest every compile would
    print each Dynamo, AOTAutograd and zerograph graph (``zerograph.dump.trace``) into the
    captured log: about a tenth of an in-process compile, for text nobody reads. A test that wants
    the trace adds its own handler (tests/test_dump_reports.py)."""
    from _pytest.logging import LogCaptureHandler, _FileHandler, _LiveLoggingNullHandler
    from torch._logging._internal import trace_log

    for handler in list(trace_log.handlers):
        if isinstance(handler, (LogCaptureHandler, _FileHandler, _LiveLoggingNullHandler)):
            trace_log.removeHandler(handler)


# inside pytest's own wrappers (trylast), after it has attached its handlers for the phase
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item):
    """Also lets ``tests.distributed.spawn`` run only inside tests marked ``distributed``: set
    before any fixture of the test (module and session fixtures included) is set up."""
    from tests import distributed

    marked = item.get_closest_marker("distributed") is not None
    distributed.spawn_allowed = lambda: marked
    _without_pytest_handlers_on_the_structured_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item):
    _without_pytest_handlers_on_the_structured_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item):
    _without_pytest_handlers_on_the_structured_trace()
    return (yield)


# session fixtures that cache costly runs for several files (see _xdist_group)
SHARED_RUN_FIXTURES = ("training_run", "one_rank")
REPO = pathlib.Path(__file__).resolve().parent.parent  # xdist's node ids are relative to it
SPAWN_LANE = "distributed"  # the xdist scope of every test that spawns ranks from the forkserver
OWN_SCOPE = "own-scope"  # the prefix of the scope of each test marked own_scope


@functools.lru_cache(maxsize=None)
def _module_syntax(path: str) -> ast.Module | None:
    """The syntax tree of test file ``path`` (``None`` if unreadable). The lanes are read from it:
    xdist's controller schedules by node id, without the items; a test misread here is only
    scheduled in the other lane."""
    try:
        return ast.parse((REPO / path).read_text())
    except (OSError, SyntaxError):
        return None


def _test_functions(path: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = _module_syntax(path)
    return [] if tree is None else [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                                    and node.name.startswith("test_")]


def _marked(node: ast.FunctionDef | ast.AsyncFunctionDef, marker: str) -> bool:
    return any(f"mark.{marker}" in ast.unparse(d) for d in node.decorator_list)


@functools.lru_cache(maxsize=None)
def _spawning_tests(path: str) -> frozenset[str]:
    """Names of the tests in file ``path`` that spawn ranks: marked ``distributed`` (by
    ``pytestmark`` or a decorator) or taking a fixture in ``SPAWNING_FIXTURES``."""
    tree = _module_syntax(path)
    whole_file = tree is not None and any(
        isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
        and "distributed" in ast.unparse(node.value) for node in tree.body)
    return frozenset(node.name for node in _test_functions(path)
                     if whole_file or _marked(node, "distributed") or SPAWNING_FIXTURES & {a.arg for a in node.args.args})


@functools.lru_cache(maxsize=None)
def _own_scope_tests(path: str) -> frozenset[str]:
    """Names of the tests in file ``path`` marked ``own_scope``."""
    return frozenset(node.name for node in _test_functions(path) if _marked(node, "own_scope"))


@functools.lru_cache(maxsize=None)
def _xdist_group(path: str) -> str:
    """The unit of work for an in-process test under ``pytest -n 2 --dist loadfile``: its file,
    so that its module fixtures run once; or, for a file whose tests take a shared-run session
    fixture, that fixture's name, so its cached runs are made on one worker."""
    try:
        text = (REPO / path).read_text()
    except OSError:
        return path
    for name in SHARED_RUN_FIXTURES:
        if re.search(rf"def test_\w+\([^)]*\b{name}\b", text):
            return name
    return path


def _xdist_scope(nodeid: str) -> str:
    """Two lanes (``make test``): every test that spawns ranks from the forkserver in one scope
    (``SPAWN_LANE``), run in order by one worker, while the other worker takes the in-process
    tests file by file (``_xdist_group``). At most one such spawn runs at a time, so 2 cores hold
    its 2 ranks and one in-process test instead of two spawns' 4 ranks. A test marked
    ``own_scope`` (the Llama example, whose ranks import transformers and compile two models; the
    semantics matrix's per-parameter builds) is a scope of its own (``OWN_SCOPE``), one test
    function with its parametrizations, which ``--dist loadfile`` hands out after the
    larger scopes: the in-process worker, which otherwise finishes its queue well before the
    spawn lane, runs it at its end, beside the lane's last spawns."""
    path, _, rest = nodeid.partition("::")
    name = rest.split("[", 1)[0]
    if name in _own_scope_tests(path):  # every parametrization of it: its module fixtures run once
        return f"{OWN_SCOPE}:{path}::{name}"
    if name in _spawning_tests(path):
        return SPAWN_LANE
    return _xdist_group(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` scheduled by ``_xdist_scope``."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TwoLaneScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_scope(nodeid)

    return TwoLaneScheduling(config, log)
