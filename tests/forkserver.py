"""The forkserver the tests start processes from: it has imported torch and the heavy modules
zerograph uses (``PRELOAD``), so a child skips about 5 CPU seconds of imports, yet is a new
process. This module imports nothing of zerograph: tests/test_layers.py's children, which must
import each zerograph module first, unpickle their task from a module that imports this one.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context

# no zerograph module here (see above); torch._inductor.compile_fx is what a first compile imports
PRELOAD = ("torch", "torch.fx", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch._dynamo", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
           "torch.fx.experimental.symbolic_shapes", "torch.utils.flop_counter", "torch._inductor.compile_fx",
           "numpy", "networkx")


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context with ``PRELOAD``. One server per process, started on first use, so
    every user in the test process goes through here (the preload is fixed at the server's start)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
