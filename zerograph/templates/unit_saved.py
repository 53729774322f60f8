"""What a template's forward hands its backward: saved views replaced by their base, re-viewed in
backward, or by compact copies (part of ``unit_trace``'s partition step).

The min-cut partitioner prices a saved tensor by its own size, so it may save several views of
one storage (q, k and v of one fused ``qkv`` projection; an attention output and its transpose)
or a small view of a large one. Inside one graph that is free: the views share their base's
storage. A template's forward is a custom op's, whose outputs may not alias one another, so
each further view was cloned (``unit_trace._unaliased``): the saved set held more bytes than
eager autograd, which keeps the views of one storage. ``rebase_saved_views`` rewrites the two
partitioned graphs so that each storage is handed over at most once:

- the views of one base, when they cover at least half of its storage (or the base is a primal
  or saved anyway): the base is saved once and backward replays each view from it (views are
  metadata: no copy, no compute);
- otherwise (a small view of a storage nothing else keeps): a contiguous copy of each view, so
  the large storage dies with the forward.

Invariant: after the rewrite no saved forward output is a view of another node's storage through
a chain of pure view ops (unless that base is one of the unit's own outputs, left as before), and
the backward computes the same values from its inputs (the same view ops on the same storage).
Source: AOTAutograd's ``recompute_views`` (views replayed in backward instead of saved), applied
to the views its op list leaves out (``transpose``, ``detach``, ``_unsafe_view``).
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

log = logging.getLogger(__name__)

# normalizations whose backward reads their input and statistics, never their output: recomputing
# the output from the input (which the backward holds anyway) saves nothing more. Not batch norm,
# whose training forward updates running statistics.
RECOMPUTED_NORMS = frozenset({torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default})


def recompute_norms(joint: fx.GraphModule) -> int:
    """Mark each normalization of ``joint``'s forward (``RECOMPUTED_NORMS``) ``PREFER_RECOMPUTE``
    for the min-cut partitioner, which then saves its input (and not its output, nor its
    statistics) and runs it again in backward; returns how many it marked. The partitioner's cheap
    list leaves them out (a reduction), so unmarked it saves the output for the next matmul's
    weight gradient beside the input the norm's own backward needs: a GPT block's two layer norms
    then cost two (B, T, C) widths of its twelve. Same values: the norm runs again on
    the same input. Source: Inductor, which decomposes the norm into ops its partitioner recomputes.
    """
    marked = 0
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.target in RECOMPUTED_NORMS and "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            marked += 1
    return marked


@dataclasses.dataclass(frozen=True)
class SavedViews:
    """What ``rebase_saved_views`` did: views replaced by their base (``rebased``), and views
    replaced by a compact copy (``copied``), by node name in the forward graph."""

    rebased: tuple[str, ...] = ()
    copied: tuple[str, ...] = ()


def rebase_saved_views(fwd: fx.GraphModule, bwd: fx.GraphModule, n_outputs: int) -> SavedViews:
    """Rewrite the partitioned ``fwd`` (returning ``n_outputs`` outputs of the unit, then the saved
    tensors) and ``bwd`` (a placeholder named after each saved forward node, then the tangents)
    so that no saved tensor is a view of another's storage (module docstring). Returns what it
    changed; both graphs unchanged when nothing applies."""
    out_node = fwd.graph.output_node()
    values = list(out_node.args[0])
    user = set(values[:n_outputs])
    saved_in_order = []
    for node in values[n_outputs:]:
        if isinstance(node, fx.Node) and node not in saved_in_order:
            saved_in_order.append(node)
    groups: dict[fx.Node, list[tuple[fx.Node, list[fx.Node]]]] = {}
    for node in saved_in_order:
        base, chain = _view_chain(node)
        if chain and base not in user and _replayable(base, chain):
            groups.setdefault(base, []).append((node, chain))
    if not groups:
        return SavedViews()
    placeholders = {n.name: n for n in bwd.graph.nodes if n.op == "placeholder"}
    replace: dict[fx.Node, fx.Node] = {}
    rebased, copied = [], []
    for base, views in groups.items():
        if _save_base(base, views, saved_in_order):
            for view, chain in views:
                _replay_in_backward(bwd.graph, placeholders[view.name], base, chain)
                replace[view] = base
                rebased.append(view.name)
        else:
            for view, _ in views:
                replace[view] = _compact_copy(fwd.graph, view, placeholders[view.name])
                copied.append(view.name)
    out_node.args = ([replace.get(v, v) if isinstance(v, fx.Node) else v for v in values],)
    _erase_dead(fwd.graph, [n for views in groups.values() for _, chain in views for n in chain])
    for gm in (fwd, bwd):
        gm.graph.lint()
        gm.recompile()
    log.debug("saved views: %d re-viewed from their base in backward, %d saved as compact copies",
              len(rebased), len(copied))
    return SavedViews(tuple(rebased), tuple(copied))


def _tensor(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


def _view_step(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` is a pure view of (it shares that tensor's storage, and its op writes
    nothing), or ``None``. ``getitem`` of a ``split``'s list steps to the split's input."""
    val = _tensor(node)
    if val is None or node.op != "call_function" or not node.args:
        return None
    source = node.args[0]
    op = node.target
    if op is operator.getitem and isinstance(source, fx.Node) and source.op == "call_function" and source.args:
        op, source = source.target, source.args[0]  # the list op (split) and its input
    if not _pure(op):
        return None
    base = _tensor(source)
    return source if base is not None and _same_storage(val, base) else None


def _pure(target: object) -> bool:
    """An ATen op that writes none of its arguments (so replaying it reads, never changes)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _view_chain(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """``node``'s base (the first node up its view chain that is not a pure view of its input)
    and the chain's nodes from just below the base down to ``node`` (empty: ``node`` is no view).
    A ``getitem`` brings its list op (``split``) along, just before it."""
    chain: list[fx.Node] = []
    current = node
    while (source := _view_step(current)) is not None:
        chain.append(current)
        if current.target is operator.getitem:
            chain.append(current.args[0])
        current = source
    return current, chain[::-1]


def _replayable(base: fx.Node, chain: list[fx.Node]) -> bool:
    """Whether backward can replay ``chain`` from ``base`` alone: no chain node reads another
    node (a symbolic size) than the base or an earlier chain node."""
    allowed = {base}
    for node in chain:
        if not all(n in allowed for n in node.all_input_nodes):
            return False
        allowed.add(node)
    return True


def _save_base(base: fx.Node, views: list[tuple[fx.Node, list[fx.Node]]], saved: list[fx.Node]) -> bool:
    """Save ``base`` once (rather than a compact copy of each view) when it is a primal (autograd
    keeps it anyway), already saved, or when the views cover at least half of its storage."""
    if base.op == "placeholder" or base in saved:
        return True
    storage = _tensor(base).untyped_storage().nbytes()
    covered = sum(_tensor(v).numel() * _tensor(v).element_size() for v, _ in views)
    return 2 * covered >= storage


def _replay_in_backward(graph: fx.Graph, placeholder: fx.Node, base: fx.Node, chain: list[fx.Node]) -> None:
    """Make ``placeholder`` (a saved view's) receive ``base`` and replay ``chain`` on it, just
    after the placeholders, in place of its every use."""
    users = list(placeholder.users)
    placeholder.meta["val"] = base.meta["val"]
    copies: dict[fx.Node, fx.Node] = {base: placeholder}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        for node in chain:
            copies[node] = graph.node_copy(node, lambda n: copies[n])
    view = copies[chain[-1]]
    for user in users:
        user.replace_input_with(placeholder, view)


def _compact_copy(graph: fx.Graph, view: fx.Node, placeholder: fx.Node) -> fx.Node:
    """A contiguous copy of ``view`` at the forward's end, to save in its place."""
    with graph.inserting_before(graph.output_node()):
        copy = graph.call_function(torch.ops.aten.clone.default, (view,),
                                   {"memory_format": torch.contiguous_format})
    copy.meta["val"] = view.meta["val"].clone(memory_format=torch.contiguous_format)
    placeholder.meta["val"] = copy.meta["val"]
    return copy


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` (view-chain nodes of the forward) left without users, latest first."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
