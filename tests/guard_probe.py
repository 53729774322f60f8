"""Importing this module turns off Dynamo's guard-latency probe in this process (the tests only).

When Dynamo builds a frame's guards it runs them once more, after flushing the CPU's caches, to
log how long they take (``torch._dynamo.guards.profile_guard_manager``, reported as the compile
metric ``guard_latency_us``). Nothing reads that figure but Dynamo's logs, and no test looks at
it; the flush costs a few milliseconds per compiled frame, and the suite compiles thousands of
frames of small models, where it is a sizeable share of a compile's CPU time (docs/benchmarks.md,
"The test suite"). The guards themselves are built, checked on the frame that made them and used
exactly as before.

Imported by the pytest workers (tests/conftest.py), by the warm forkserver the ranks are forked
from (tests/forkserver.py) and by every rank process (tests/distributed.py). Not for zerograph
itself: a library does not patch its users' torch.
"""
from __future__ import annotations

import torch._dynamo.guards


def _no_latency_probe(*args: object, **kwargs: object) -> float:
    return 0.0


torch._dynamo.guards.profile_guard_manager = _no_latency_probe
