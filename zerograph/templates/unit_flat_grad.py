"""A templated unit's flat gradient written in place (part of ``unit_trace``'s partition step).

With a flat shard, autograd's backward of the cut (``FlatShard.unflatten``: split the gathered
``(world, chunk)`` buffer into each parameter's columns) is one ``cat`` of every parameter's
gradient at the end of the unit's backward. Until it runs, each gradient is held on its own, and
while it runs, the concatenated copy beside them: the unit's gradient twice, at the moment the
gathered unit, the next unit's prefetch and the saved activations of every unit before it are
live too (a stage-3 step can peak in that ``cat``).

``write_flat_gradient_in_place`` rewrites the partitioned backward: one buffer of the ``cat``'s
shape is allocated where the first gradient is ready, and each gradient is copied into its
columns right after the op that computes it, so it dies there. The unit's gradient is then held
once, plus the gradient being copied. Same values (a copy per column range, as ``cat`` makes).
For the eager lowering only: Inductor plans a ``cat``'s buffer itself, and takes functional graphs.
Source: FSDP2's reduce-scatter input, which ``foreach_reduce`` fills gradient by gradient.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..passes._fx import is_alias_of_input

aten = torch.ops.aten


def write_flat_gradient_in_place(bwd: fx.GraphModule, flat_index: int) -> bool:
    """Rewrite ``bwd`` (a partitioned backward returning one gradient per primal) so that the
    gradient of primal ``flat_index`` (the flat shard) is a buffer filled by ``copy_`` as each
    parameter's gradient is computed, instead of a ``cat`` of them all at the end. Returns whether
    it rewrote: ``False`` (graph unchanged) when that gradient is not a ``cat`` read only through
    views, or its inputs do not tile the ``cat``'s output (then ``cat`` stays)."""
    graph = bwd.graph
    node = graph.output_node().args[0][flat_index]
    while isinstance(node, fx.Node) and node.target is not aten.cat.default and is_alias_of_input(node):
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target is not aten.cat.default or len(node.users) != 1:
        return False
    cat = node
    parts = [p for p in cat.args[0] if p.meta["val"].numel()]
    out = cat.meta["val"]
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % out.dim()
    if not _tiles(parts, out, dim):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    offsets, offset = {}, 0
    for part in parts:
        offsets[part] = offset
        offset += part.meta["val"].shape[dim]
    # each part's view chain back to the op that computed it: the copy goes right after that op
    chains = {part: _view_chain(part) for part in parts}
    roots = {part: (chain[-1].args[0] if chain else part) for part, chain in chains.items()}
    roots = {p: (last_placeholder if r.op == "placeholder" else r) for p, r in roots.items()}
    buf = last = last_root = None
    for part in sorted(parts, key=lambda p: order[roots[p]]):
        root = roots[part]
        if last is None or order[root] > order[last_root]:
            point, last_root = root.next, root
        else:  # computed by the same op as the part before (or earlier): after that part's copy
            point = last.next
        with graph.inserting_before(point):
            if buf is None:
                buf = graph.call_function(aten.empty.memory_format, (list(out.shape),),
                                          {"dtype": out.dtype, "device": out.device})
                buf.meta["val"] = torch.empty_like(out)
            last = _copy_in(graph, buf, part, chains[part], dim, offsets[part])
    cat.replace_all_uses_with(buf)
    graph.erase_node(cat)
    for part in parts:
        _erase_unused(chains[part])
    graph.lint()
    bwd.recompile()
    return True


def _tiles(parts: list[fx.Node], out: torch.Tensor, dim: int) -> bool:
    vals = [p.meta["val"] for p in parts]
    return (bool(parts) and sum(v.shape[dim] for v in vals) == out.shape[dim]
            and all(v.dtype == out.dtype and v.device == out.device and v.dim() == out.dim()
                    and all(a == b for i, (a, b) in enumerate(zip(v.shape, out.shape)) if i != dim) for v in vals))


def _view_chain(part: fx.Node) -> list[fx.Node]:
    """The views ``part`` is of (``part`` first), back to the first node that is not a view; their
    other arguments are shapes and dims, no nodes."""
    chain, node = [], part
    while is_alias_of_input(node) and node.target is not operator.getitem and len(node.all_input_nodes) == 1:
        chain.append(node)
        node = node.args[0]
    return chain


def _copy_in(graph: fx.Graph, buf: fx.Node, part: fx.Node, chain: list[fx.Node], dim: int, offset: int) -> fx.Node:
    """At the graph's insert point: ``part``'s view chain replayed on the node it views, and a
    ``copy_`` of it into columns ``offset:`` of ``buf`` along ``dim``. Returns the ``copy_``."""
    value = chain[-1].args[0] if chain else part
    for view in reversed(chain):  # innermost first
        replayed = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
        replayed.meta["val"] = view.meta["val"]
        value = replayed
    width = part.meta["val"].shape[dim]
    columns = graph.call_function(aten.slice.Tensor, (buf, dim, offset, offset + width))
    columns.meta["val"] = buf.meta["val"].narrow(dim, offset, width)
    copy = graph.call_function(aten.copy_.default, (columns, value))
    copy.meta["val"] = columns.meta["val"]
    return copy


def _erase_unused(nodes: list[fx.Node]) -> None:
    for node in nodes:
        if not node.users and not node.is_impure():
            node.graph.erase_node(node)
