"""Rewrites of one saved storage of a joint graph, for ``activation_partition`` (offload, P_a) and
``secondary_partition`` (hpZ): keep a piece of it and gather it back in backward, or mark it for
PyTorch's activation offloading; either way backward's reads of it, and of forward views of it,
are redirected to a tensor equal to it.

Pre: a joint graph whose backward nodes are ``backward`` (``activation_partition.backward_nodes``)
and whose node positions are ``pos``. Post: ``root`` is read by no backward node (P_a), or is
saved as it is and marked ``should_offload`` (offload).

Source: ZeRO (arXiv 1910.02054) section 6.1 (P_a, CPU offload); PyTorch's partitioner-level
activation offloading (``torch._functorch.config.enable_activation_offloading``).
"""
from __future__ import annotations

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.graph.ops import GATHER_ACTIVATION, SHARD_ACTIVATION
from zerograph.graph.vocab import TAG, WAIT

from ._fx import readable_result
from .liveness import storage_root

SHOULD_OFFLOAD = "should_offload"  # node.meta key PyTorch's activation offloading reads


def partition_storage(graph: fx.Graph, root: fx.Node, backward: set[fx.Node], pos: dict[fx.Node, int],
                      group_name: str, group_size: int, role: str = "activation") -> None:
    """P_a for one saved storage: forward keeps this rank's piece (``shard_activation``, saved:
    ``MUST_SAVE``), backward all-gathers it (``gather_activation``, ``partitioner_tag`` is_backward)
    before the first backward use and reads the gathered tensor wherever it read ``root`` or a
    forward view of it (``_backward_reads_from``). ``root`` is then dead after forward. ``role``
    names the pieces in their tags (``<role>_shard``, ``<role>_gather``): hpZ's
    ``secondary_partition`` partitions gathered parameters the same way."""
    val = root.meta["val"]
    # a collective's output (hpZ's gathered buffer where no copy-out follows the all-gather: a
    # bucket of one flat shard) holds the result only once its wait has run
    written = readable_result(root)
    with graph.inserting_after(written):
        piece = graph.call_function(SHARD_ACTIVATION, (written, group_name, group_size))
    with detect_fake_mode([val]):
        piece.meta["val"] = SHARD_ACTIVATION(val, group_name, group_size)
    piece.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    piece.meta[TAG] = {"role": f"{role}_shard"}
    readers = _backward_readers(graph, root, backward)
    with graph.inserting_before(_first_use(readers, backward, pos)):
        full = graph.call_function(GATHER_ACTIVATION, (piece, list(val.shape), group_name, group_size))
    full.meta.update({"val": val, "partitioner_tag": "is_backward", TAG: {"role": f"{role}_gather"}})
    _backward_reads_from(graph, full, root, readers, backward, pos)


def offload_storage(graph: fx.Graph, root: fx.Node, backward: set[fx.Node], pos: dict[fx.Node, int]) -> None:
    """Offload for one saved storage: PyTorch's offloading moves only a saved node that is no view
    (``can_offload``), and the partitioner saves the views backward reads; so backward replays
    those views on ``root`` itself (``_backward_reads_from``), ``root`` is saved as it is
    (``MUST_SAVE``) and marked ``should_offload``."""
    _backward_reads_from(graph, root, root, _backward_readers(graph, root, backward), backward, pos)
    root.meta[SHOULD_OFFLOAD] = True
    root.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _first_use(readers: list[fx.Node], backward: set[fx.Node], pos: dict[fx.Node, int]) -> fx.Node:
    """The first backward node that reads any of ``readers``."""
    return min((u for n in readers for u in n.users if u in backward), key=pos.__getitem__)


def _backward_readers(graph: fx.Graph, root: fx.Node, backward: set[fx.Node]) -> list[fx.Node]:
    """``root`` and its forward views (same storage) that backward nodes read."""
    return [n for n in graph.nodes if n not in backward and storage_root(n) is root
            and any(u in backward for u in n.users)]


def _backward_reads_from(graph: fx.Graph, source: fx.Node, root: fx.Node, readers: list[fx.Node],
                         backward: set[fx.Node], pos: dict[fx.Node, int]) -> None:
    """Make every backward use of ``readers`` (``root`` and forward views of it) read ``source``
    instead, a tensor equal to ``root`` (itself, or its all-gathered copy): the view chain from
    ``root`` to each reader is replayed on ``source`` in backward, before the first backward use
    of any of them (replays share links of the chain, e.g. one ``split`` for q, k and v;
    ``partitioner_tag`` is_backward; views cost no copy)."""
    replayed = {root: source}
    before = _first_use(readers, backward, pos)

    def replay(node: fx.Node) -> fx.Node:
        if node.target is WAIT:  # the collective's result itself, not a view of it
            return replay(node.args[0])
        if node not in replayed:
            base = replay(node.args[0])
            with graph.inserting_before(before):
                copy = graph.call_function(node.target, (base, *node.args[1:]), dict(node.kwargs))
            # MUST_RECOMPUTE as well: otherwise the min-cut may compute the copy in forward and
            # save it (a view weighs as much as its base), which is what this undoes
            copy.meta.update({"val": node.meta["val"], "partitioner_tag": "is_backward",
                              "recompute": CheckpointPolicy.MUST_RECOMPUTE})
            replayed[node] = copy
        return replayed[node]

    for node in readers:
        users = [u for u in node.users if u in backward]
        if node is root and source is root:
            continue  # backward already reads root itself
        view = replay(node)
        for user in users:
            user.replace_input_with(node, view)
