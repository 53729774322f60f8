"""The stress lane's own logic (``tests/stress.py``, ``make stress``): which runs count as aborts,
which files it runs, the environment it gives them. In process; the lane itself is not run here."""
from __future__ import annotations

import os
import subprocess
import sys
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


# a write after free into a small block, then allocations of its size: what a collective writing
# into a released buffer does. glibc stores the tcache's next pointer XORed with the block's
# address >> 12 (safe-linking), so a fixed byte pattern decodes to an address whose alignment
# depends on where the block landed: one run in 16 decoded to an aligned one and crashed on it
# (SIGSEGV) instead of glibc's check. The value written decodes to an odd address wherever it lands.
WRITE_AFTER_FREE = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
chunk = libc.malloc(24)
libc.free(ctypes.c_void_p(chunk))
ctypes.c_uint64.from_address(chunk).value = (chunk >> 12) ^ 0x4141414141414141
ctypes.memset(chunk + 8, 0x41, 8)
for _ in range(4):
    libc.malloc(24)
"""


def test_each_allocator_catches_what_the_other_misses() -> None:
    """Why the lane alternates: glibc's own allocator aborts on a write after free into a small
    block (the tcache's list is corrupt), with the message the ranks died with; the checking
    allocator (MALLOC_CHECK_=3) serves blocks without the tcache and misses it."""
    def run(malloc_check: bool) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", WRITE_AFTER_FREE], env=stress.checked_environment(165, malloc_check),
                              capture_output=True, text=True, timeout=60)

    plain = run(False)
    assert plain.returncode < 0 and "malloc(): unaligned tcache chunk detected" in plain.stderr
    assert stress.classify(plain.returncode, plain.stderr) == "abort"
    if stress.malloc_debug_library() is not None:
        assert run(True).returncode == 0


def test_the_summary_counts_by_target() -> None:
    counts = {"tests/a.py": Counter(runs=3, abort=1, ok=2, trainings=12),
              "tests/b.py": Counter(runs=3, failure=1, ok=2, trainings=9)}
    text = stress.summary(counts, Counter({"tests/a.py::test_x": 1}))
    assert "tests/a.py     3         12       1         0" in text and "total          6         21       1         1" in text
    assert "aborted runs failed in: tests/a.py::test_x x1" in text


def test_a_run_counts_the_trainings_its_ranks_ran(tmp_path) -> None:
    """``run_once`` counts the trainings of its pytest process from the spawn log: a spawn that ran
    its function once is one, a spawn of many cases (``run_case_in_step``) is its cases."""
    test = tmp_path / "test_spawns.py"
    marker = "@pytest.mark." + "distributed"  # not spelled whole: this file spawns no ranks
    lines = ["spawn a", "spawn b", "case b", "case b", "case b"]
    test.write_text(f"import os\nimport pytest\n\n{marker}\ndef test_x():\n"
                    f"    open(os.environ['ZEROGRAPH_SPAWN_LOG'], 'a').write({chr(10).join(lines)!r} + '\\n')\n")
    returncode, _, _, trained = stress.run_once(str(test), None, dict(os.environ), 120)
    assert (returncode, trained) == (0, 4)
