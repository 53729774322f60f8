"""The second half of hpZ, on the partitioned pair: a unit an activation checkpoint recomputes
is re-gathered in backward over its node from a piece the forward saved, like any other unit.

``secondary_partition`` (on the joint) leaves the gather chain of such a unit recompute-tagged, so
that the partitioner recomputes the gather for the checkpoint's recomputation; this pass then
replaces that recomputed N-rank all-gather by the node-group one (invariant: the pass's docstring).

Source: ZeRO++ (arXiv 2306.10209) section 3.2, hierarchical partitioning (hpZ).
"""
from __future__ import annotations

import torch.fx as fx
from torch._guards import detect_fake_mode

from zerograph.errors import PassError
from zerograph.graph.ops import GATHER_ACTIVATION, SHARD_ACTIVATION
from zerograph.graph.vocab import TAG

from ._fx import find_collectives, position, readable_result, save_for_backward
from .context import PartitionedGraphs, PassContext, PassResult
from .contract import contract
from .liveness import storage_root


@contract(requires=("gathers",))
def hand_over_secondary_pieces(pair: PartitionedGraphs, ctx: PassContext) -> PassResult:
    """The second half of hpZ, on the partitioned pair, for units an activation checkpoint
    recomputes (``torch.utils.checkpoint`` around a block: its forward ops carry a recompute tag).

    Pre: the partitioner recomputed such a unit's gather chain (an all-gather over all N ranks)
    in backward, for the checkpoint's recomputation of the unit's forward. The unit may have a
    node-group all-gather already (``gather_activation``, tagged ``secondary_gather``: backward's
    gradients read its parameters), reading a piece the forward saved or backward recomputed from
    the recomputed buffer, as the min-cut chose; or none (only the recomputed forward reads them,
    e.g. a bias gathered alone). Post: backward holds no all-gather over the N ranks. For each
    recomputed buffer, the forward cuts the piece from its own gathered buffer and saves it
    (tagged ``secondary_shard``, among the first saved tensors) unless it saved it already;
    backward's node-group all-gather of that piece (made here if there was none) runs before the
    first op that read the recomputed buffer, every such op reads it instead, and the N-rank
    chain is erased. So a checkpointed unit is re-gathered over its node, like any other, and
    forward saves 1/M of it, not the whole. ``ctx.secondary_group``: ``(group_name, M)``, or None
    without hpZ (nothing to do)."""
    if ctx.secondary_group is None:
        return PassResult(pair, False)
    fwd, bwd, num_fwd_outputs = pair.forward, pair.backward, pair.num_fwd_outputs
    group_name, group_size = ctx.secondary_group
    in_forward = {n.name: n for n in fwd.graph.nodes}
    # each node-group gather, by the name of the buffer its piece is cut from
    gather_of = {}
    for gather in bwd.graph.find_nodes(op="call_function", target=GATHER_ACTIVATION):
        if gather.meta.get(TAG, {}).get("role") == "secondary_gather":
            piece = gather.args[0]
            source = in_forward[piece.name] if piece.op == "placeholder" else piece
            gather_of[source.args[0].name] = gather
    recomputed = []  # the buffers the recomputed chains hand to anything outside themselves
    for collective in find_collectives(bwd.graph):
        if collective.role == "gather" and collective.kind == "all_gather":
            for node in collective.finish:
                root = readable_result(storage_root(node))
                if root not in recomputed and any(u not in collective.finish for u in node.users):
                    recomputed.append(root)
    if not recomputed:
        return PassResult(pair, False)
    unsaved = []  # (gather, forward buffer) whose piece the forward does not save yet
    for root in recomputed:
        buffer = in_forward.get(root.name)
        if buffer is None or buffer.target is not root.target:
            raise PassError(f"hpZ: the forward has no gathered buffer {root.name} to cut a secondary piece from")
        gather = gather_of.get(root.name)
        if gather is None:
            val = root.meta["val"]
            with bwd.graph.inserting_before(root):  # a placeholder replaces its input below
                gather = bwd.graph.call_function(GATHER_ACTIVATION, (root, list(val.shape), group_name, group_size))
            gather.meta.update({"val": val, TAG: {"role": "secondary_gather"}})
            gather_of[root.name] = gather
        if gather.args[0].op != "placeholder":
            unsaved.append((gather, buffer))
    pieces = []
    for gather, buffer in unsaved:
        with fwd.graph.inserting_after(buffer):
            piece = fwd.graph.call_function(SHARD_ACTIVATION, (buffer, group_name, group_size))
        with detect_fake_mode([buffer.meta["val"]]):
            piece.meta.update({"val": SHARD_ACTIVATION(buffer.meta["val"], group_name, group_size),
                               TAG: {"role": "secondary_shard"}})
        pieces.append(piece)
    for (gather, _), saved in zip(unsaved, save_for_backward(fwd, bwd, num_fwd_outputs, pieces), strict=True):
        gather.replace_input_with(gather.args[0], saved)
    order = position(bwd.graph)
    for root in recomputed:
        gather = gather_of[root.name]
        first_read = min((*root.users, gather), key=order.__getitem__)
        if first_read is not gather:
            first_read.prepend(gather)
        root.replace_all_uses_with(gather)
        _erase_dead_gather(bwd.graph, root)
    for gm in (fwd, bwd):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return PassResult(pair, True, {"secondary_pieces_handed_over": len(recomputed)})



def _erase_dead_gather(graph: fx.Graph, buffer: fx.Node) -> None:
    """Erase ``buffer`` (read by no one now) and, upwards, each node of its gather chain (tagged
    ``TAG`` role "gather") that no one reads any more. Dead-code elimination alone would leave the
    collective's ``wait_tensor``, which FX counts as a side effect."""
    stack = [buffer]
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(n for n in inputs if n.meta.get(TAG, {}).get("role") == "gather")
