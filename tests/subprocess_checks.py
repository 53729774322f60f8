"""Run named check functions of a test module in fresh interpreters, all started at once.

Some checks need a process that has not imported Triton yet (``TRITON_INTERPRET`` is read at
import) or must not leave a process group behind in the pytest process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

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
    output, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0 and f"ok {name}" in output, output[-6000:]
