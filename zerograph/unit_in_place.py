"""In-place ops on a template's own intermediates made out-of-place, before the partition.

``make_fx`` records a body as it runs, in-place ops included; the min-cut partitioner expects the
functional graph AOTAutograd hands it. Dropout is the common case: it decomposes to
``bernoulli_(empty_like(x), p)`` and ``div_``, and the partitioner, which may not move a random op
to backward, meets the mask as a forward output it cannot place. A write to a tensor the body made
itself (not a primal, not a view of anything) is rewritten to its out-of-place overload, and the
reads after it take the new value: what functionalization does for such a tensor, with the same
ops, so the same random numbers in the same order. Writes to primals are not touched (refused or
made inline by ``unit_trace._check_no_writes``), nor writes to a tensor that has views (their
readers would need the write replayed through the view).
Source: AOTAutograd's functionalization of the joint graph (``torch._functorch``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy


def functionalize_fresh_writes(graph: fx.Graph) -> int:
    """Rewrite each in-place op of ``graph`` whose written tensor is a fresh intermediate with no
    views to its out-of-place overload; uses after it of the written tensor (or of the op's
    returned alias) read the new node. Returns the number of ops rewritten.

    Pre: a graph of ATen ``OpOverload`` calls as ``make_fx`` records them. Post: same values,
    fewer mutations; the graph lints."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        functional = _out_of_place(node)
        if functional is None or not node.args:
            continue
        written = node.args[0]
        if not _fresh_without_views(written):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(functional, node.args, node.kwargs)
        new.meta.update(node.meta)
        if isinstance(node.meta.get("val"), torch.Tensor):  # a value of its own: the in-place op's aliased its input
            new.meta["val"] = node.meta["val"].clone()
        for user in list(written.users):
            if user is not node and user is not new and order.get(user, len(order)) > order[node]:
                user.replace_input_with(written, new)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        order[new] = order[node]
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


def _out_of_place(node: fx.Node) -> torch._ops.OpOverload | None:
    """The out-of-place ATen overload of ``node``'s in-place op (same arguments, by name and
    type), or ``None`` where ``node`` is no in-place ATen op or has no such overload."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    if not schema.name.startswith("aten::") or not schema.name.endswith("_") or schema.name.endswith("__"):
        return None
    first = schema.arguments[0] if schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write:
        return None
    packet = getattr(torch.ops.aten, schema.name[len("aten::"):-1], None)
    if packet is None:
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    for overload_name in packet.overloads():
        overload = getattr(packet, overload_name)
        candidate = overload._schema
        if candidate.is_mutable or [(a.name, str(a.type)) for a in candidate.arguments] != wanted:
            continue
        return overload
    return None


def _fresh_without_views(node: object) -> bool:
    """Whether ``node`` is a tensor the graph made that aliases nothing: a call whose result is
    no view or alias of an input, none of whose users takes a view of it."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if any(r.alias_info is not None for r in node.target._schema.returns):
        return False
    for user in node.users:
        target = user.target
        if user.op == "output":
            continue
        if not isinstance(target, torch._ops.OpOverload):
            return False
        returns = target._schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return False  # a view of the tensor: its readers would miss the write
    return True


def save_random_values(graph: fx.Graph) -> int:
    """Mark each random op of ``graph`` (ATen's ``nondeterministic_seeded`` tag: ``bernoulli``,
    ``rand``, ``normal``...) ``MUST_SAVE``, so the partitioner hands its value to backward instead
    of drawing it again there (a second draw is another mask: eager's backward reuses the
    forward's). Returns the number of ops marked."""
    marked = 0
    for node in graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked
