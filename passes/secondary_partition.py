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
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.graph.vocab import TAG

from ._fx import find_collectives, position
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


_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _read_by_checkpointed_forward(views: list[fx.Node], backward: set[fx.Node]) -> bool:
    """A forward op an activation checkpoint recomputes reads ``views``: a recompute tag with the
    checkpoint region's ``ac_graph_id`` (what ``torch.utils.checkpoint`` leaves on the ops it
    traced). zerograph's own tags do not count: its gather chain carries ``TAG``, and the views of
    a gathered parameter that ``insert_allgather`` tags ``MUST_RECOMPUTE`` (a Linear's transpose of
    its weight) carry no region."""
    return any(u not in backward and TAG not in u.meta and u.meta.get("recompute") in _RECOMPUTE
               and "ac_graph_id" in u.meta for n in views for u in n.users)


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
