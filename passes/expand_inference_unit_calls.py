"""Templated units put back into a no-grad (inference) graph.

Pre: an inference graph, each templated unit one ``zerograph::unit_call``. Post: each call is the
template's ``unit_forward`` (``expand_unit_calls``), of which only the output is read; the
activations it would save for backward are dropped.
"""
from __future__ import annotations

import torch.fx as fx

from .context import PassContext, PassResult
from .contract import contract
from .expand_unit_calls import expand_forwards


@contract(provides=("units_expanded",))
def expand_inference_unit_calls(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Each ``unit_call`` of an inference graph becomes ``unit_forward``'s first output."""
    expanded = expand_forwards(gm.graph)
    for _, _, saved in expanded.values():
        for item in saved:
            gm.graph.erase_node(item)
    if expanded:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, bool(expanded), {"unit_forwards": len(expanded)})
