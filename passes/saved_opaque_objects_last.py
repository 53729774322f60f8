"""Saved opaque objects after every saved tensor, on the partitioned pair (torch 2.13's
partitioner can put them before the RNG states of a recomputed random op).

Pre: a forward / backward pair as the min-cut partitioner returns it. Post: the forward's saved
values are its saved tensors, then the opaque objects, then the symbols, and the backward's inputs
follow the same order: what AOTAutograd's runtime reads.
"""
from __future__ import annotations

from torch._functorch._aot_autograd.graph_compile import is_opaque_node

from ._fx import is_symbol, saved_tensor_inputs
from .context import PartitionedGraphs, PassContext, PassResult
from .contract import contract


@contract(provides=("saved_tensors_first",))
def saved_opaque_objects_last(pair: PartitionedGraphs, ctx: PassContext) -> PassResult:
    """Reorder the saved values of a partitioned pair so that opaque objects (the per-parameter
    build's ``DeviceMesh``) follow every saved tensor, as AOTAutograd's runtime reads them
    (tensors, then opaque objects, then symbols). In torch 2.13 the partitioner appends the RNG
    states it saves for a recomputed random op (``functionalize_rng_ops``: under
    ``torch.utils.checkpoint``, SDPA counts as one) after the opaque objects, and the runtime then
    refuses the mesh as a tensor. Both graphs move alike: the forward's outputs and the backward's
    inputs."""
    fwd, bwd, num_fwd_outputs = pair.forward, pair.backward, pair.num_fwd_outputs
    fwd_out = fwd.graph.output_node()
    outputs = list(fwd_out.args[0])
    inputs = saved_tensor_inputs(fwd, bwd, num_fwd_outputs)  # the non-symbols saved, then the tangents
    saved = [v for v in outputs[num_fwd_outputs:] if not is_symbol(v)]
    opaque = [i for i, v in enumerate(saved) if is_opaque_node(v)]
    order = [i for i in range(len(saved)) if i not in opaque] + opaque
    if order == list(range(len(saved))):
        return PassResult(pair, False)
    fwd_out.args = (outputs[:num_fwd_outputs] + [saved[i] for i in order] + outputs[num_fwd_outputs + len(saved):],)
    anchor = inputs[0].prev
    for i in order:
        anchor.append(inputs[i])
        anchor = inputs[i]
    for gm in (fwd, bwd):
        gm.graph.lint()
        gm.recompile()
    return PassResult(pair, True, {"opaque_objects_moved": len(opaque)})
