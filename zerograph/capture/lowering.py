"""Lowering a graph the passes finished: FX's Python (the eager lowering) or Inductor, whole or
by islands of compute between templated units (``islands.py``).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.graph import _BoxedCodeGen

from ..graph.ops import UNIT_BACKWARD, UNIT_FORWARD
from .islands import lower_islands

log = logging.getLogger(__name__)


def lower(lowering: str, gm: fx.GraphModule, inputs: list[Any], kind: str,
          with_islands: bool) -> tuple[Callable, tuple[int, int] | None]:
    """The lowered graph (a boxed callable), and under Inductor's lowering by islands (islands,
    distinct islands). ``lowering``: ``"eager"`` (FX's Python) or ``"inductor"``; ``kind``: the
    graph's kind (forward, backward, inference)."""
    if lowering == "inductor":
        if any(n.target in (UNIT_FORWARD, UNIT_BACKWARD) for n in gm.graph.nodes) and _static_shapes(gm):
            # the units' bodies are lowered per kind already (unit_trace): the rest runs as FX
            # Python, or with Config.inductor_islands, Inductor takes the islands of compute
            # between the units, each distinct one once (islands.py)
            if not with_islands:
                return _boxed(gm), None
            split, islands, compiled = lower_islands(gm, kind, _inductor_island)
            log.info("%s graph: %d compute islands lowered by Inductor, %d distinct", kind, islands, compiled)
            return _boxed(split), (islands, compiled)
        return _inductor(_decomposed(gm, inputs), inputs, kind), None
    return _boxed(gm), None


def _static_shapes(gm: fx.GraphModule) -> bool:
    """No input of ``gm`` has a symbolic size or stride (the islands' keys compare sizes as ints)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride(), value.storage_offset()))):
            return False
    return True


def _inductor_island(island: fx.GraphModule, inputs: list[Any], kind: str) -> Callable:
    """One island (``islands.lower_islands``) lowered by Inductor, its outputs in the strides the
    graph's fake values give them: the rest of the graph (views, unit calls, collectives, other
    islands) was traced with those. So every output is marked user-visible (Inductor otherwise
    may pad an output's strides on GPU), and an island whose decomposition changes an output's
    strides runs as FX Python instead. In a tracing context of its own: Inductor records each
    compiled graph's output strides in the current one, which AOTAutograd keeps for the graph it
    compiles (room for one graph's)."""
    decomposed = _decomposed(island, inputs)
    (output,) = decomposed.graph.find_nodes(op="output")
    (expected,) = island.graph.find_nodes(op="output")
    if [n.meta["val"].stride() for n in output.args[0]] != [n.meta["val"].stride() for n in expected.args[0]]:
        log.info("%s island left to Python: its decomposition changes an output's strides", kind)
        return lambda args: list(island(*args))
    output.meta["user_visible_output_idxs"] = list(range(len(output.args[0])))
    with torch._guards.tracing(torch._guards.TracingContext(detect_fake_mode(inputs))):
        return _inductor(decomposed, inputs, kind)


def _decomposed(gm: fx.GraphModule, inputs: list[Any]) -> fx.GraphModule:
    """``gm`` traced again on its fake ``inputs`` with Inductor's decompositions: the passes
    spliced in plain aten ops (t, reshape, ...), which Inductor lowers only decomposed."""
    from torch._inductor.decomposition import select_decomp_table

    with detect_fake_mode(inputs) or contextlib.nullcontext():
        return make_fx(fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*inputs)


def _inductor(gm: fx.GraphModule, inputs: list[Any], kind: str) -> Callable:
    """Inductor's ``compile_fx_inner`` on a decomposed graph (a whole one, or an island): a boxed callable."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, inputs, is_backward=kind == "backward", is_inference=kind == "inference")


def _boxed(gm: fx.GraphModule) -> Callable:
    """The eager lowering: FX's generated Python, called with AOTAutograd's boxed convention (one
    list, which the code empties once it has read it), so that each input, e.g. an activation
    saved for backward, is freed after its last use instead of when the graph returns (Inductor's
    generated code does the same). Runs a copy: the recorded graph keeps its ordinary signature."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_BoxedCodeGen())
    boxed = fx.GraphModule(gm, graph)

    def run(args: list[Any]) -> Any:
        return boxed.forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def decompositions(lowering: str) -> dict | None:
    """The decompositions AOTAutograd traces with: Inductor's table under its lowering, else none."""
    if lowering == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None
