"""Stage 3 with hpZ: backward re-gathers parameters from a secondary partition inside the node.

Pre: a stage-3 joint graph after ``insert_allgather`` and ``selective_unshard``: every gather chain
that backward re-runs is tagged ``MUST_RECOMPUTE``; ``ctx.secondary_group`` is ``(group_name, M)``,
the ranks of this rank's node (M divides the world size N).
Post: for each such gather, forward keeps this rank's 1/M of the gathered (unpacked) buffer
(``zerograph::shard_activation`` over the node group, ``MUST_SAVE``) and backward rebuilds the
buffer with an all-gather over the node group (``zerograph::gather_activation``) before its first
backward use, reading it wherever it read the gathered parameters. Backward then runs no all-gather
over the N ranks for these units, and the forward's gathered buffers are still freed after their
last forward use. Gathers ``selective_unshard`` kept, and graphs without a secondary group, are
left alone.

Memory: each rank holds 1/M of every re-gathered unit from forward to backward (in
``param_dtype``), where plain stage 3 holds 1/N (the primary shard, always held) and nothing more;
communication: backward's all-gathers move the same bytes over the node's links instead of the
whole world's.

Source: ZeRO++ (arXiv 2306.10209) section 3.2, hierarchical partitioning (hpZ); DeepSpeed's
``zero_hpz_partition_size``. The partition and gather are the ops of ZeRO-R's P_a
(``activation_partition.partition_storage``), applied to gathered parameters.
"""
from __future__ import annotations

import logging

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.errors import PassError
from zerograph.ops import GATHER_ACTIVATION, SHARD_ACTIVATION
from zerograph.vocab import TAG

from ._fx import find_collectives, position, readable_result, save_for_backward
from .activation_partition import backward_nodes, partition_storage
from .context import PassContext, PassResult
from .contract import contract
from .liveness import storage_root

log = logging.getLogger(__name__)


@contract(requires=("gathers",))
def secondary_partition(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.graph_kind != "joint" or ctx.stage != 3 or ctx.secondary_group is None:
        return PassResult(gm, False)
    graph = gm.graph
    group_name, group_size = ctx.secondary_group
    backward = backward_nodes(graph)
    pos = position(graph)
    partitioned = 0
    for collective in find_collectives(graph):
        if collective.role != "gather" or collective.wait in backward:
            continue
        for root in _gathered_roots(collective):
            if root.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
                continue  # kept from forward to backward (selective_unshard): nothing to re-gather
            views = _views_of(root)
            if not any(u in backward for n in views for u in n.users):
                continue
            partition_storage(graph, root, backward, pos, group_name, group_size, role="secondary")
            partitioned += 1
            if _read_by_checkpointed_forward(views, backward):
                # an activation checkpoint recomputes an op that reads the buffer: the chain stays
                # tagged, so the partitioner recomputes the gather for it (saving the buffer would
                # keep it whole), and hand_over_secondary_pieces then feeds that op the piece
                continue
            # backward no longer reads the gathered buffer: untag the chain, or the partitioner
            # would recompute it in backward to make the piece there instead of saving the piece
            for node in [*collective.issue, *collective.finish, *views]:
                node.meta.pop("recompute", None)
    if partitioned:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    log.debug("secondary_partition: %d gathered buffers kept as 1/%d over %s", partitioned, group_size, group_name)
    return PassResult(gm, bool(partitioned), {"secondary_partitions": partitioned})


def secondary_partition_outputs(graph: fx.Graph) -> list[int]:
    """Indices of a partitioned forward graph's outputs that are secondary partitions this pass
    made (tagged ``secondary_shard``): what hpZ holds from forward to backward, reported apart
    from the saved activations (``zerograph.stats``)."""
    output = graph.find_nodes(op="output")[0]
    return [i for i, node in enumerate(output.args[0])
            if isinstance(node, fx.Node) and node.meta.get(TAG, {}).get("role") == "secondary_shard"]


def hand_over_secondary_pieces(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int,
                               secondary_group: tuple[str, int] | None) -> int:
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
    forward saves 1/M of it, not the whole. ``secondary_group``: ``(group_name, M)``, or None
    without hpZ (nothing to do). Returns the number of recomputed buffers replaced."""
    if secondary_group is None:
        return 0
    group_name, group_size = secondary_group
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
        return 0
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
    return len(recomputed)


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


_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _read_by_checkpointed_forward(views: list[fx.Node], backward: set[fx.Node]) -> bool:
    """A forward op an activation checkpoint recomputes (its recompute tag; not zerograph's own
    gather chain, which carries ``TAG``) reads ``views``."""
    return any(u not in backward and TAG not in u.meta and u.meta.get("recompute") in _RECOMPUTE
               for n in views for u in n.users)


def _gathered_roots(collective) -> list[fx.Node]:
    """The storages a gather's copy-out hands to compute: the roots of its nodes that untagged
    (compute) nodes read."""
    roots = []
    for node in collective.finish:
        if any(TAG not in u.meta for u in node.users):
            root = storage_root(node)
            if root not in roots:
                roots.append(root)
    return roots


def _views_of(root: fx.Node) -> list[fx.Node]:
    """``root`` and every node that shares its storage through views."""
    found, stack = [root], [root]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in found and storage_root(user) is root:
                found.append(user)
                stack.append(user)
    return found
