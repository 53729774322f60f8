"""Run named check functions of a test module in fresh processes, all started at once.

Some checks need a process that has not imported Triton yet (``TRITON_INTERPRET`` is read when
Triton builds its language functions, at import) or must not leave a process group behind in
the pytest process. A module's checks share one process per setting of ``TRITON_INTERPRET``,
which runs the module as ``__main__`` with the check names as its arguments; ``main`` then runs
them in turn, each in a child forked from it. A check that fails is reported and the next one
still runs.

The process is a child of the zerograph-free forkserver (tests/forkserver.py: torch and Triton
imported, Triton interpreted, no zerograph module), so it skips the imports of torch and Triton
that a new interpreter pays (docs/benchmarks.md, "The test suite"). Where this process's
forkserver is the warm one (the spawn lane), a new interpreter (``python -m <module>
<names...>``) is started instead.
"""
from __future__ import annotations

import multiprocessing.context
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from tests import forkserver
from tests.distributed import WALL_FACTOR, cpu_seconds

REPO = Path(__file__).resolve().parents[1]
FAILED = "FAILED check"  # what ``main`` prints before a failed check's name


class CheckProcess:
    """One interpreter running several checks; its output is read once, by the first waiter."""

    def __init__(self, popen: subprocess.Popen, names: list[str]) -> None:
        self.popen, self.names, self.output = popen, names, None

    def wait(self, timeout_s: float) -> str:
        """The process's output once it exits. ``timeout_s`` bounds its CPU seconds, not its wall
        time (the checks start all at once and share 2 cores, with whatever else runs; see
        ``tests.distributed.spawn``), with ``WALL_FACTOR`` times it as a wall-clock backstop."""
        if self.output is not None:
            return self.output
        start, note = time.monotonic(), ""
        while True:
            try:
                output, _ = self.popen.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                used, waited = cpu_seconds(self.popen.pid), time.monotonic() - start
                if used > timeout_s or waited > WALL_FACTOR * timeout_s:
                    self.popen.kill()
                    output, _ = self.popen.communicate()
                    note = f"\n[killed: {used:.0f} CPU s, {waited:.0f} s wall; timeout_s={timeout_s:g}]"
                    break
        self.output = output + note
        return self.output


def start_checks(module: str, names: Iterable[str], interpreted: Iterable[str]) -> dict[str, CheckProcess]:
    """Start ``module``'s ``main`` once for the ``interpreted`` names (with TRITON_INTERPRET=1)
    and once for the rest; returns each name's process."""
    names, interpreted = list(names), set(interpreted)
    context = forkserver.context(zerograph_free=True)
    procs: dict[str, CheckProcess] = {}
    for triton_interpret in (True, False):
        group = [name for name in names if (name in interpreted) == triton_interpret]
        if group:
            if context is not None:
                process = _ForkedChecks(context, module, group, triton_interpret)
            else:
                process = _interpreter(module, group, triton_interpret)
            procs.update(dict.fromkeys(group, CheckProcess(process, group)))
    return procs


def _interpreter(module: str, names: list[str], triton_interpret: bool) -> subprocess.Popen:
    """``python -m <module> <names...>``: a new interpreter (where no zerograph-free server is)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.Popen([sys.executable, "-m", module, *names], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_module(module: str, names: list[str], triton_interpret: bool, log_path: str) -> None:
    """In the forked child: output to ``log_path``, the Triton setting, then the module as ``__main__``."""
    log = os.open(log_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # the server imported Triton interpreted (tests.interpret_triton); zerograph reads the
    # variable at each call, so without it no kernel runs through the interpreter
    os.environ.pop("TRITON_INTERPRET", None)
    if triton_interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.argv = [module, *names]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class _ForkedChecks:
    """``_run_module`` in a child of the zerograph-free forkserver, with the part of the
    ``subprocess.Popen`` interface ``CheckProcess`` uses (its output is read from a file)."""

    def __init__(self, context: multiprocessing.context.BaseContext, module: str, names: list[str],
                 triton_interpret: bool) -> None:
        fd, self._log = tempfile.mkstemp(prefix="zerograph-checks-", suffix=".log")
        os.close(fd)
        self._process = context.Process(
            target=_run_module, args=(module, names, triton_interpret, self._log), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("checks", timeout)
        with open(self._log, errors="replace") as f:
            return f.read(), None

    def kill(self) -> None:
        self._process.kill()

    def wait(self) -> int | None:
        self._process.join()
        return self._process.exitcode

    def __del__(self) -> None:
        if os.path.exists(self._log):
            os.unlink(self._log)


def stop_checks(procs: dict[str, CheckProcess]) -> None:
    for proc in {id(p): p for p in procs.values()}.values():
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait()


def assert_check_passed(proc: CheckProcess, name: str, timeout_s: float = 300) -> None:
    """Wait for ``proc`` and assert the check ``name`` passed: it printed ``ok <name>``, and the
    process exited 0 or failed only in another of its checks."""
    output = proc.wait(timeout_s)
    others_failed = [other for other in proc.names if other != name and f"{FAILED} {other}:" in output]
    assert f"ok {name}" in output and (proc.popen.returncode == 0 or others_failed), output[-6000:]


def main(checks: dict[str, Callable[[], None]]) -> None:
    """A check module's ``__main__``: run the checks named on the command line in turn, each in a
    child forked from this interpreter (so it starts from the state a fresh process has after
    importing the module, whatever the check before it changed), each printing ``ok <name>`` at
    its end; exit 1 if any failed."""
    failed = []
    for name in sys.argv[1:]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                checks[name]()
            except BaseException:  # noqa: BLE001 - reported, and the next check still runs
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            print(f"{FAILED} {name}: exit code {code}", flush=True)
            failed.append(name)
    sys.exit(1 if failed else 0)
