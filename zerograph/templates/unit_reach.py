"""Which gradients each output of a templated unit reaches, and the calls that read those outputs in part.

A unit that returns a tuple whose members reach different parameters (``return h, self.side(x)``)
and a loss that reads one member only: eager leaves ``.grad`` ``None`` for the parameters only
the unread member reaches. The template's backward takes zeros for a member no gradient reached,
and a flat shard's gradient is one tensor, so those parameters would get zeros. A kind whose
members reach different gradients therefore runs inline, off its flat shards (autograd then
decides per parameter, as in eager), once a call leaves such a member unread: in the graph (the
model's graph or the joint trace gives the member no gradient: ``read_in_part``,
``lost_to_unread``) or possibly at run time (members that feed different outputs of the model's
graph, which the loss may read apart: ``read_in_part``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree

from ..graph import registry
from ..graph.ops import UNIT_CALL


def per_output_reach(outs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> tuple[frozenset[int], ...]:
    """For each of ``outs``, the positions in ``targets`` (tensors that require a gradient) that
    autograd reaches from it: their gradient edge's node lies on the output's graph."""
    nodes = [get_gradient_edge(t).node for t in targets]
    reach = []
    for out in outs:
        seen: set = set()
        stack = [out.grad_fn] if out.grad_fn is not None else []
        while stack:
            fn = stack.pop()
            if fn not in seen:
                seen.add(fn)
                stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
        reach.append(frozenset(j for j, node in enumerate(nodes) if node in seen))
    return tuple(reach)


def lost_to_unread(template: Any, read: Sequence[bool]) -> frozenset[int]:
    """The gradients (``UnitTemplate.output_reach`` positions) that only the outputs ``read``
    marks unread reach."""
    reach = template.output_reach
    if not reach:
        return frozenset()
    unread = frozenset().union(*(r for r, hit in zip(reach, read) if not hit))
    return unread - frozenset().union(*(r for r, hit in zip(reach, read) if hit))


def read_in_part(gm: fx.GraphModule) -> tuple[int, str] | None:
    """The first unit kind in ``gm`` (a Dynamo graph) with a call that leaves unread an output
    that alone reaches some gradient, or whose outputs reach different gradients and feed
    different outputs of the graph (a loss may read one and not the other, decided only when
    backward runs), with which; or ``None``."""
    sinks = _sinks(gm.graph)
    for node in gm.graph.nodes:
        if node.target is not UNIT_CALL:
            continue
        kind, mode, arg_grads, primals, call = node.args
        template = registry.unit_template(kind, mode, arg_grads, [p.meta["example_value"] for p in primals], call)
        feeds = [frozenset()] * len(template.output_reach)  # per output, the graph outputs it feeds
        for user in node.users:
            index = user.args[1] if len(user.args) > 1 else None
            if isinstance(index, int) and index < len(feeds):
                feeds[index] |= sinks.get(user, frozenset())
        if lost_to_unread(template, [bool(where) for where in feeds]):
            return kind, "a call leaves unread an output that alone reaches some gradient"
        read = [(reach, where) for reach, where in zip(template.output_reach, feeds) if reach and where]
        if any(r1 != r2 and w1 != w2 for r1, w1 in read for r2, w2 in read):
            return kind, ("its outputs reach different gradients and feed different outputs of the model's graph, "
                          "which a loss may read in part")
    return None


def _sinks(graph: fx.Graph) -> dict[fx.Node, frozenset[int]]:
    """For each node, the positions of the graph's outputs (its return value's leaves) it feeds."""
    sinks: dict[fx.Node, frozenset[int]] = {}
    output = graph.output_node()
    for position, leaf in enumerate(pytree.tree_leaves(output.args[0])):
        if isinstance(leaf, fx.Node):
            sinks[leaf] = sinks.get(leaf, frozenset()) | {position}
    for node in reversed(graph.nodes):
        for user in node.users:
            if user is not output:
                sinks[node] = sinks.get(node, frozenset()) | sinks.get(user, frozenset())
    return sinks
