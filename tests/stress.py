"""The stress lane (``make stress``, not part of ``make test``): the suite's spawned trainings run
again and again under glibc's heap checks, counting the runs that abort.

A memory-safety defect (a buffer freed or reused while a collective still writes it, a read after
release) shows on CPU only now and then: a rank aborts with ``malloc(): unaligned tcache chunk
detected`` or a segfault, in whichever test happened to allocate next. glibc's checks make such
faults show sooner and more often, and two allocators catch different ones, so by default the
iterations alternate between them (``--malloc``):

- ``check``: ``MALLOC_CHECK_=3``, glibc's checking allocator (glibc 2.34 and later read it only
  with ``libc_malloc_debug.so`` preloaded, which this script does): every block carries a check
  byte past its end, so a write past a buffer aborts at its ``free``. It serves blocks without
  the tcache, so a write into a freed small block goes unseen (``tests/test_stress.py`` shows both);
- ``plain``: glibc's own allocator, the one the aborts were seen with: a write after free into a
  small block corrupts the tcache's list, and the next ``malloc`` of that size aborts.

Both with ``MALLOC_PERTURB_`` (freed memory filled with a byte pattern, so a read after free reads
garbage and a parity test fails).

Each run is one pytest process over one target (a test file, a node id), ``-m distributed``
(only the tests that spawn ranks), with the ranks' output uncaptured so that glibc's and gloo's
messages land in the log. A run is an *abort* when its output shows a signal death or a malloc /
gloo abort message, a *failure* when it failed otherwise; the log of each is kept in the log folder.

    python -m tests.stress [--iterations N] [--tests TARGET ...] [-k EXPR] [--log-dir DIR]
                           [--perturb BYTE] [--malloc alternate|check|plain] [--timeout S]
                           [--env NAME=VALUE ...] [--beside-in-process]

Without ``--tests`` every test file with a test marked ``distributed`` is a target. Prints a
summary by target: runs, trainings (each case of a spawn that runs many, or the spawn), aborts
and failures, and which tests the aborted runs failed in. ``--beside-in-process`` loads the cores as
``make test`` does: its other lane, the in-process tests, runs in a loop beside the runs.
Under the checking allocator, tests that read the ranks' resident memory may fail without a
fault (``test_bench``'s peak over baseline reads 0): a failure is not an abort.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes.util
import glob
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

REPO = pathlib.Path(__file__).resolve().parent.parent

# what an aborted rank leaves in a run's output: tests/distributed.py's report of a rank killed by a
# signal, faulthandler's header, glibc's heap-check messages, gloo's and the C++ runtime's aborts
ABORT_PATTERNS = re.compile(
    r"signal SIG(?:ABRT|SEGV|BUS|ILL|FPE)|Fatal Python error|malloc\(\)|free\(\)|double free|corrupted "
    r"(?:size|double-linked|top size)|tcache|malloc_consolidate|munmap_chunk|realloc\(\)|"
    r"terminate called|gloo/.*(?:Abort|abort)|Segmentation fault")
# a file every spawn of a run appends a line to (tests.distributed._log_training), read by `trainings`
SPAWN_LOG = "ZEROGRAPH_SPAWN_LOG"
FAILED_TEST = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def distributed_test_files() -> list[str]:
    """Every test file that spawns ranks (marked ``distributed``, or using the ``training_run`` fixture)."""
    files = []
    for path in sorted(glob.glob(str(REPO / "tests" / "test_*.py"))):
        text = pathlib.Path(path).read_text()
        if "mark.distributed" in text or "training_run" in text:
            files.append(os.path.relpath(path, REPO))
    return files


def malloc_debug_library() -> str | None:
    """glibc's ``libc_malloc_debug.so`` (where ``MALLOC_CHECK_`` lives since glibc 2.34), or ``None``."""
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64"):
        for name in ("libc_malloc_debug.so.0", "libc_malloc_debug.so"):
            if os.path.exists(os.path.join(directory, name)):
                return os.path.join(directory, name)
    found = ctypes.util.find_library("c_malloc_debug")
    return found


def checked_environment(perturb: int, malloc_check: bool = True) -> dict[str, str]:
    """This process's environment with glibc's heap checks on (inherited by the forkserver and the
    ranks): ``MALLOC_PERTURB_`` always, ``MALLOC_CHECK_=3`` when ``malloc_check``."""
    env = dict(os.environ, MALLOC_PERTURB_=str(perturb), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if not malloc_check:
        env.pop("MALLOC_CHECK_", None)
        return env
    env["MALLOC_CHECK_"] = "3"
    library = malloc_debug_library()
    if library is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, (env.get("LD_PRELOAD"), library)))
    return env


def classify(returncode: int, output: str) -> str:
    """``"ok"``, ``"abort"`` (pytest killed by a signal, or failed with a rank's signal death or a
    heap / gloo abort message in its output) or ``"failure"``. A run that passed is ok whatever
    its ranks printed: the fault tests end ranks on purpose."""
    if returncode in (0, 5):  # 5: pytest collected nothing (-k matched none)
        return "ok"
    return "abort" if returncode < 0 or ABORT_PATTERNS.search(output) else "failure"


def run_once(target: str, keyword: str | None, env: dict[str, str],
             timeout_s: float) -> tuple[int, str, float, int]:
    """One pytest process over ``target``: its exit code (negative: a signal; 124: timed out),
    output, seconds, and the trainings its spawned ranks ran (``trainings``)."""
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "distributed", "-rfE",
               target]
    if keyword:
        command += ["-k", keyword]
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("r", suffix=".spawns") as spawns:
        env = {**env, SPAWN_LOG: spawns.name}
        try:
            done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, text=True, errors="replace")
            returncode, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            returncode, output = 124, out + f"\n[stress] timed out after {timeout_s:g} s\n"
        return returncode, output, time.monotonic() - start, trainings(spawns.read())


def trainings(log: str) -> int:
    """The trainings of a run's spawn log (``tests.distributed._log_training``): each spawn's
    cases, or the spawn itself where it ran its function once."""
    cases: collections.Counter = collections.Counter()
    for line in log.splitlines():
        what, _, spawn = line.partition(" ")
        cases[spawn] += what == "case"
    return sum(max(n, 1) for n in cases.values())


@contextlib.contextmanager
def in_process_lane_beside(enabled: bool, env: dict[str, str]) -> Iterator[None]:
    """While the block runs, ``make test``'s other lane (the tests that spawn no ranks) runs again and
    again in a process of its own, so the ranks share the cores as they do in the full suite."""
    if not enabled:
        yield
        return
    command = (f"while true; do {sys.executable} -m pytest -q -p no:cacheprovider -m 'not distributed' "
               "-x tests > /dev/null 2>&1; done")
    lane = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, start_new_session=True)
    try:
        yield
    finally:
        os.killpg(lane.pid, signal.SIGKILL)
        lane.wait()


def slug(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", target.removeprefix("tests/"))[:80]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3, help="runs of each target (default 3)")
    parser.add_argument("--tests", nargs="*", default=None,
                        help="pytest targets (files or node ids); default: every file with distributed tests")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression within the targets")
    parser.add_argument("--log-dir", default="stress-logs", help="where each aborted or failed run's log goes")
    parser.add_argument("--perturb", type=int, default=0xA5, help="MALLOC_PERTURB_ byte, 1-255 (default 165)")
    parser.add_argument("--timeout", type=float, default=1800, help="wall seconds per run (default 1800)")
    parser.add_argument("--malloc", choices=("alternate", "check", "plain"), default="alternate",
                        help="glibc's checking allocator (MALLOC_CHECK_=3), its own (tcache on), or one then the "
                             "other by iteration (default)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="more environment for the runs, e.g. ZEROGRAPH_DEBUG_COLLECTIVES=1 (repeatable)")
    parser.add_argument("--beside-in-process", action="store_true",
                        help="run the in-process tests in a loop beside, as make test's other lane does")
    args = parser.parse_args(argv)
    if not 1 <= args.perturb <= 255:
        parser.error("--perturb must be 1-255 (0 turns MALLOC_PERTURB_ off)")
    targets = args.tests or distributed_test_files()
    extra = dict(item.partition("=")[::2] for item in args.env)
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, collections.Counter] = {t: collections.Counter() for t in targets}
    aborted_in: collections.Counter = collections.Counter()
    print(f"[stress] {args.iterations} x {len(targets)} targets; malloc {args.malloc}, MALLOC_PERTURB_={args.perturb} "
          f"{' '.join(args.env)}; logs in {log_dir}/", flush=True)
    with in_process_lane_beside(args.beside_in_process, {**os.environ, "OMP_NUM_THREADS": "1"}):
        for iteration in range(args.iterations):
            allocator = args.malloc if args.malloc != "alternate" else ("check", "plain")[iteration % 2]
            env = {**checked_environment(args.perturb, allocator == "check"), **extra}
            for target in targets:
                returncode, output, seconds, trained = run_once(target, args.keyword, env, args.timeout)
                outcome = classify(returncode, output)
                counts[target].update({"runs": 1, outcome: 1, "trainings": trained})
                line = f"[stress] {iteration + 1}/{args.iterations} ({allocator}) {target}: {outcome} " \
                       f"(exit {returncode}, {trained} trainings, {seconds:.0f} s)"
                if outcome != "ok":
                    line += keep_log(log_dir / f"{outcome}-{iteration + 1:03d}-{slug(target)}.log", output,
                                     aborted_in if outcome == "abort" else None, target)
                print(line, flush=True)
    print(summary(counts, aborted_in), flush=True)
    return 1 if any(c["abort"] or c["failure"] for c in counts.values()) else 0


def keep_log(path: pathlib.Path, output: str, aborted_in: collections.Counter | None, target: str) -> str:
    """Write a run's output to ``path``; count an aborted run's failed tests (or its target) into
    ``aborted_in``. Returns the text that names the log and those tests."""
    path.write_text(output)
    failed = sorted(set(FAILED_TEST.findall(output)))
    if aborted_in is not None:
        aborted_in.update(failed or [target])
    return f" -> {path}" + (f" [{', '.join(failed[:4])}{' ...' if len(failed) > 4 else ''}]" if failed else "")


def summary(counts: dict[str, collections.Counter], aborted_in: collections.Counter) -> str:
    width = max(len(t) for t in counts)
    lines = ["", f"{'target':<{width}}  runs  trainings  aborts  failures"]
    for target, c in counts.items():
        lines.append(f"{target:<{width}}  {c['runs']:>4}  {c['trainings']:>9}  {c['abort']:>6}  {c['failure']:>8}")
    total = sum(counts.values(), collections.Counter())
    lines.append(f"{'total':<{width}}  {total['runs']:>4}  {total['trainings']:>9}  {total['abort']:>6}  "
                 f"{total['failure']:>8}")
    if aborted_in:
        lines.append("aborted runs failed in: " + ", ".join(f"{t} x{n}" for t, n in aborted_in.most_common()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
