"""pytest plugin: ``--cpu-durations=N`` lists the N tests that cost the most CPU, and the suite's total.

Wall-clock durations (``--durations``) say little on a machine other jobs share: the same suite's
wall time swings with their load (docs/benchmarks.md, "The test suite"). CPU seconds do not depend
on the load. Per test (setup, call and teardown, so the module fixtures that spawn ranks are
charged to the test that first needs them): CPU seconds of this process, and of its child
processes that ended meanwhile (subprocess checks; the ranks that tests/distributed.py forks from
its forkserver, as they report); and an estimate of its wall time
on an idle 2-core machine, ``self + children / 2`` (the ranks of a spawn run side by side).

Works under pytest-xdist too (each row rides on the test's teardown report to the controller).
Loaded by tests/conftest.py; outside this repository: ``-p tests.cpu_durations``.
"""
from __future__ import annotations

import resource
import sys
import time

import pytest

CORES = 2  # this project's machines: the children of one test share 2 cores

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests of most CPU seconds (0: all), and the suite's CPU total")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # ranks forked from tests/forkserver.py's server are its children, not ours: they report their own
    forked = getattr(sys.modules.get("tests.distributed"), "forked_ranks_cpu_s", 0.0)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + forked


_START = pytest.StashKey[tuple]()
_PROPERTY = "cpu_durations"  # (self CPU s, children CPU s, wall s) on a test's teardown report
_ROWS: dict[str, tuple[float, float, float]] = {}  # nodeid -> row, on the controller (or the only process)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.config.getoption("--cpu-durations") is not None:
        item.stash[_START] = (time.monotonic(), *_cpu())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and _START in item.stash:
        wall, own, children = item.stash[_START]
        own_after, children_after = _cpu()
        # a report's user_properties travel from a pytest-xdist worker to the controller
        report.user_properties.append((_PROPERTY, (own_after - own, children_after - children,
                                                   time.monotonic() - wall)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == _PROPERTY and report.when == "teardown":
            _ROWS[report.nodeid] = tuple(value)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    count = config.getoption("--cpu-durations")
    if count is None:
        return
    def estimate(row: tuple[float, float, float]) -> float:
        return row[0] + row[1] / CORES
    ordered = sorted(_ROWS.items(), key=lambda kv: estimate(kv[1]), reverse=True)
    write = terminalreporter.write_line
    terminalreporter.section(f"cpu durations (idle {CORES}-core estimate = self + children / {CORES})")
    for nodeid, row in ordered[:count or None]:
        write(f"{estimate(row):7.1f}s idle-est {row[0]:7.1f}s self {row[1]:7.1f}s children "
              f"{row[2]:7.1f}s wall  {nodeid}")
    own, children, wall = (sum(r[i] for r in _ROWS.values()) for i in range(3))
    write(f"TOTAL {len(_ROWS)} tests: idle-est {own + children / CORES:.0f} s, self {own:.0f} s, children "
          f"{children:.0f} s (CPU {own + children:.0f} s), wall {wall:.0f} s")
