"""Run named check functions of a test module in fresh interpreters, all started at once.

Some checks need a process that has not imported Triton yet (``TRITON_INTERPRET`` is read at
import) or must not leave a process group behind in the pytest process. A module's checks share
one interpreter per setting of ``TRITON_INTERPRET`` (``python -m <module> <name> <name> ...``,
run in turn by ``main``, each in a child forked from it): an interpreter's imports of torch,
Triton and zerograph cost about 3 CPU seconds, most of what a check costs. A check that fails is
reported and the next one still runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

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
    """Start ``python -m <module> <names...>`` once for the ``interpreted`` names (with
    TRITON_INTERPRET=1) and once for the rest; returns each name's process."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base["OMP_NUM_THREADS"] = "1"
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    names, interpreted = list(names), set(interpreted)
    procs: dict[str, CheckProcess] = {}
    for triton_interpret in (True, False):
        group = [name for name in names if (name in interpreted) == triton_interpret]
        if group:
            env = dict(base, TRITON_INTERPRET="1") if triton_interpret else base
            popen = subprocess.Popen([sys.executable, "-m", module, *group], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.update(dict.fromkeys(group, CheckProcess(popen, group)))
    return procs


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
