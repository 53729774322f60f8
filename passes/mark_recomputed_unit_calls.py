"""Templated units inside an activation checkpoint, marked on the joint graph before its passes.

Pre: the joint graph as AOTAutograd traces it, each templated unit one ``zerograph::unit_call``
and one ``unit_call_backward`` (``ops.py``). Post: a ``unit_call_backward`` whose call carries a
recompute tag (``torch.utils.checkpoint``) takes every primal of the call and is marked
``meta[RECOMPUTED]`` (a call whose template draws random numbers, and its outputs, are marked
``MUST_SAVE`` instead); ``expand_unit_calls`` then has its backward run the unit's forward again
instead of reading saved activations. Other graphs are returned unchanged.
"""
from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.graph.ops import UNIT_CALL_BACKWARD

from .context import PassContext, PassResult
from .contract import contract
from .expand_unit_calls import RECOMPUTE_POLICIES, RECOMPUTED, call_of_token, template_of


@contract()
def mark_recomputed_unit_calls(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """A ``unit_call`` of ``joint`` inside an activation checkpoint (``torch.utils.checkpoint``:
    its recompute tag) has its activations recomputed in backward, not saved: its
    ``unit_call_backward`` is given every primal of the call, so that the partitioner makes them
    all available there, and marked ``meta[RECOMPUTED]``. A call whose template draws random
    numbers (dropout) is left as it is: run again, it would draw other numbers, where eager's
    checkpoint restores the generator's state; its activations are handed over from forward, as
    the partitioner saves a random op's output rather than recompute it. Runs first: the later
    passes rewrite the calls' arguments."""
    marked = kept = 0
    for node in gm.graph.nodes:
        if node.target is UNIT_CALL_BACKWARD:
            call = call_of_token(node.args[2])
            if call.meta.get("recompute") not in RECOMPUTE_POLICIES:
                continue
            if template_of(call).draws_random:
                for value in (call, *call.users):  # the call and its outputs: nor may the partitioner run it again
                    value.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                kept += 1
            else:
                template_id, _, token, tangents = node.args
                node.args = (template_id, list(call.args[3]), token, tangents)
                node.meta[RECOMPUTED] = True
                marked += 1
    if marked:
        gm.recompile()
    # retagging a random call MUST_SAVE changes what the partitioner does: the graph changed too
    return PassResult(gm, bool(marked or kept), {"recomputed_unit_calls": marked, "random_unit_calls_kept": kept})
