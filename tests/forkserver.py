"""The forkserver the tests start processes from, so that a child skips the imports (and, for
ranks, the first compile's warm-up) it would otherwise pay, yet is a new process.

A process has one forkserver, and what it preloads is fixed when it starts. Two kinds of server:

- *warm* (``context()``, what ``tests.distributed.spawn`` asks for): ``PRELOAD`` and then
  ``tests.warm_rank``, which imports zerograph and compiles, runs and frees one tiny model. A rank
  forked from it skips zerograph's imports and the first compile's warm-up that a rank forked from
  a cold server pays (docs/benchmarks.md, "The test suite").
- *cold* (``context(zerograph_free=True)``): ``PRELOAD`` only, torch but no zerograph module, for
  tests/test_layers.py's children, which must import each zerograph module first (they unpickle
  their task from a module that imports this one, so this module imports nothing of zerograph),
  and for tests/subprocess_checks.py's. It sets ``TRITON_INTERPRET=1`` before torch imports
  Triton (``tests.interpret_triton``), so that its children can run Triton kernels interpreted.

``make test`` runs the two kinds in different pytest workers (the spawn lane and the in-process
lane, tests/conftest.py), so each gets its own server. Where one process asks for both, the first
request decides the server and a later request it cannot serve gets ``None`` (the caller then
starts fresh interpreters instead).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context

# no zerograph module here (see above); torch._inductor.compile_fx is what a first compile imports
PRELOAD = ("torch", "torch.fx", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch._dynamo", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
           "torch.fx.experimental.symbolic_shapes", "torch.utils.flop_counter", "torch._inductor.compile_fx",
           "numpy", "networkx")
WARM = ("tests.guard_probe", "tests.warm_rank")
COLD_FIRST = ("tests.interpret_triton",)

_started_warm: bool | None = None  # how this process's server was (or will be) started; None: not yet


def context(zerograph_free: bool = False) -> multiprocessing.context.BaseContext | None:
    """The forkserver context: warm, or with no zerograph module when ``zerograph_free``. ``None``
    when this process's server was already set up the other way (see the module docstring)."""
    global _started_warm
    warm = not zerograph_free
    if _started_warm is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD + WARM if warm else COLD_FIRST + PRELOAD))
        _started_warm = warm
    if _started_warm != warm:
        return None
    return multiprocessing.get_context("forkserver")
