"""Run named check functions of a test module in fresh interpreters, all started at once.

Some checks need a process that has not imported Triton yet (``TRITON_INTERPRET`` is read at
import) or must not leave a process group behind in the pytest process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tests.distributed import WALL_FACTOR, cpu_seconds

REPO = Path(__file__).resolve().parents[1]


def start_checks(module: str, names: Iterable[str], interpreted: Iterable[str]) -> dict[str, subprocess.Popen]:
    """Start ``python -m <module> <name>`` for each name; ``interpreted`` ones get TRITON_INTERPRET=1."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base["OMP_NUM_THREADS"] = "1"
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    interpreted = set(interpreted)
    return {name: subprocess.Popen([sys.executable, "-m", module, name], cwd=REPO,
                                   env=dict(base, TRITON_INTERPRET="1") if name in interpreted else base,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name in names}


def stop_checks(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_check_passed(proc: subprocess.Popen, name: str, timeout_s: float = 300) -> None:
    """Wait for the check ``name`` and assert it passed. ``timeout_s`` bounds its CPU seconds, not
    its wall time (the checks start all at once and share 2 cores, with whatever else runs; see
    ``tests.distributed.spawn``), with ``WALL_FACTOR`` times it as a wall-clock backstop."""
    start, chunks = time.monotonic(), []
    while True:
        try:
            output, _ = proc.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            used, waited = cpu_seconds(proc.pid), time.monotonic() - start
            if used > timeout_s or waited > WALL_FACTOR * timeout_s:
                proc.kill()
                output, _ = proc.communicate()
                chunks.append(f"\n[killed: {used:.0f} CPU s, {waited:.0f} s wall; timeout_s={timeout_s:g}]")
                break
    output += "".join(chunks)
    assert proc.returncode == 0 and f"ok {name}" in output, output[-6000:]
