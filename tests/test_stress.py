"""The stress lane's own logic (``tests/stress.py``, ``make stress``): which runs count as aborts,
which files it runs, the environment it gives them. In process; the lane itself is not run here."""
from __future__ import annotations

from collections import Counter

import pytest

from . import stress

TCACHE_ABORT = ("malloc(): unaligned tcache chunk detected\n"
                "RankFailed: --- rank 1 ended by signal SIGABRT ---\nFAILED tests/test_patterns.py::test_x - RankFailed")


@pytest.mark.parametrize(("returncode", "output", "outcome"), [
    (0, "", "ok"),
    (5, "no tests ran", "ok"),
    (0, "rank 1 ended by signal SIGABRT (a fault test's own kill)", "ok"),
    (1, TCACHE_ABORT, "abort"),
    (1, "terminate called after throwing an instance of 'gloo::EnforceNotMet'", "abort"),
    (-6, "", "abort"),
    (1, "E   assert 0 > 0", "failure"),
    (124, "[stress] timed out after 10 s", "failure"),
])
def test_runs_are_classified(returncode: int, output: str, outcome: str) -> None:
    assert stress.classify(returncode, output) == outcome


def test_the_default_targets_are_the_files_that_spawn_ranks() -> None:
    files = stress.distributed_test_files()
    assert {"tests/test_accumulation.py", "tests/test_patterns.py"} <= set(files)
    assert "tests/test_stress.py" not in files and "tests/test_collective_watch.py" not in files


def test_the_environment_turns_glibcs_checks_on_or_keeps_its_allocator() -> None:
    checked = stress.checked_environment(7)
    assert checked["MALLOC_CHECK_"] == "3" and checked["MALLOC_PERTURB_"] == "7"
    if stress.malloc_debug_library() is not None:  # glibc 2.34+ reads MALLOC_CHECK_ only there
        assert "libc_malloc_debug" in checked["LD_PRELOAD"]
    plain = stress.checked_environment(7, malloc_check=False)
    assert "MALLOC_CHECK_" not in plain and plain["MALLOC_PERTURB_"] == "7"


def test_the_summary_counts_by_target() -> None:
    counts = {"tests/a.py": Counter(runs=3, abort=1, ok=2), "tests/b.py": Counter(runs=3, failure=1, ok=2)}
    text = stress.summary(counts, Counter({"tests/a.py::test_x": 1}))
    assert "tests/a.py     3       1         0" in text and "total          6       1         1" in text
    assert "aborted runs failed in: tests/a.py::test_x x1" in text
