"""Put each templated unit's ops back into the partitioned forward and backward.

Until the partition a templated unit is one node with its output and a token, ``unit_call`` in the
forward and ``unit_call_backward`` in the backward ([Note: a unit is one node until the partition]
in ``zerograph/graph/ops.py``); its values are put back only here, once. Runs on the partitioned
pair (the manager's "partitioned" pipeline, inside AOTAutograd's ``partition_fn``).

Pre: ``fwd`` / ``bwd`` as the min-cut partitioner returns them: ``fwd``'s outputs are its
``num_fwd_outputs`` own, then the saved tensors, then saved opaque objects and symbolic ints;
``bwd``'s inputs are the saved symbolic ints, the saved tensors in the same order, then the rest
(tangents).
Post: no ``unit_call`` / ``unit_call_backward`` is left. Each ``unit_call`` is ``unit_forward``
with the same arguments (its output: ``getitem`` 0); each ``unit_call_backward`` is
``unit_backward`` of the template, reading the primals the template saves
(``UnitTemplate.saved_primals``), the activations its ``unit_forward`` saved, and the tangent,
with the same outputs; the ``unit_call`` a backward belongs to is read off its token (saved or
recomputed like any value). The activations are new saved tensors, first among them on both sides;
a saved tensor no backward node reads any longer (a primal, or a token) is dropped from both sides,
and AOTAutograd reads the counts off the returned graphs. A unit under an activation checkpoint
(``mark_recomputed_unit_calls``) hands nothing over: its backward runs ``unit_forward`` again
(docs/design.md, section "Pipeline", says why).

The same expansion for a no-grad graph is ``expand_inference_unit_calls``; the marking of
checkpointed units, on the joint, is ``mark_recomputed_unit_calls``.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.graph import registry
from zerograph.graph.ops import UNIT_BACKWARD, UNIT_CALL, UNIT_CALL_BACKWARD, UNIT_FORWARD, _empty_like_meta

from ._fx import save_for_backward, saved_tensor_inputs
from .context import PartitionedGraphs, PassContext, PassResult
from .contract import contract

RECOMPUTED = "zerograph_unit_recomputed"  # on a unit_call_backward whose unit's activations backward recomputes

_ALIASES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})
RECOMPUTE_POLICIES = frozenset({CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE})


def _through_aliases(node: fx.Node) -> fx.Node:
    """The value ``node`` is a ``detach`` / ``alias`` chain of (``node`` itself if none)."""
    while node.target in _ALIASES:
        node = node.args[0]
    return node


def call_of_token(token: fx.Node) -> fx.Node:
    """The ``unit_call`` node whose token ``token`` is (through aliases and the ``getitem``)."""
    token = _through_aliases(token)
    assert (token.target is operator.getitem and token.args[0].target is UNIT_CALL
            and token.args[1] == len(token.args[0].meta["val"]) - 1), f"{token.name} is not a unit_call's token"
    return token.args[0]


def _unit_forward(graph: fx.Graph, call: fx.Node, template: Any, args: tuple | None = None) -> list[fx.Node]:
    """``unit_forward`` with ``call``'s arguments (or ``args``) before ``call``; with no ``args``,
    in its place (``call``'s token becomes an empty tensor nothing reads once the backward is
    expanded). Returns its saved activations (``getitem`` nodes; those no one reads are left to
    dead-code elimination)."""
    args = _call_args(call) if args is None else args
    values = _empty_like_meta(args[3][0].meta["val"], template.output_metas)
    with graph.inserting_before(call):
        forward = graph.call_function(UNIT_FORWARD, args)
        forward.meta.update({k: v for k, v in call.meta.items() if k not in ("val", RECOMPUTED)})
        forward.meta["val"] = values
        items = []
        for i, value in enumerate(values):
            item = graph.call_function(operator.getitem, (forward, i))
            item.meta["val"] = value
            items.append(item)
        if call.target is UNIT_CALL:
            for user in list(call.users):  # getitem i < n_outputs: an output; getitem n_outputs: the token
                if user.args[1] < template.n_outputs:
                    user.replace_all_uses_with(items[user.args[1]])
                else:
                    token = graph.call_function(torch.ops.aten.new_empty.default, (items[0], [0]))
                    token.meta["val"] = user.meta["val"]
                    user.replace_all_uses_with(token)
                graph.erase_node(user)
            graph.erase_node(call)
    return [items[i] for i in template.saved_outputs]


def _unit_backward(graph: fx.Graph, call: fx.Node, template: Any, saved: list[fx.Node]) -> None:
    """``unit_backward`` of ``template`` in place of ``call`` (a ``unit_call_backward``), reading ``saved``."""
    template_id, primals, _, tangents = call.args
    if call.meta.get(RECOMPUTED):  # it was given every primal: the template's backward reads some
        primals = [primals[i] for i in template.saved_primals]
    with graph.inserting_before(call):
        backward = graph.call_function(UNIT_BACKWARD, (template_id, primals, saved, tangents))
    backward.meta.update(call.meta)
    call.replace_all_uses_with(backward)
    graph.erase_node(call)


def template_of(call: fx.Node) -> Any:
    """The ``unit_trace.UnitTemplate`` a ``unit_call`` node calls (traced already: the node's fake
    implementation looked it up in the registry)."""
    kind, mode, arg_grads, primals, call_structure = _call_args(call)
    return registry.unit_template(kind, mode, arg_grads, [p.meta["val"] for p in primals], call_structure)


def _call_args(call: fx.Node) -> tuple:
    """A ``unit_call`` node's ``(kind, mode, arg_grads, primals, call)``, however the trace passed them."""
    return (*call.args, *[call.kwargs[name] for name in ("kind", "mode", "arg_grads", "primals", "call")
                          [len(call.args):]])


def expand_forwards(graph: fx.Graph) -> dict[fx.Node, tuple[tuple, Any, list[fx.Node]]]:
    """Expand every ``unit_call`` of ``graph``: the call (erased) -> (its arguments but the
    primals, its template, its saved activations there)."""
    expanded = {}
    for call in [n for n in graph.nodes if n.target is UNIT_CALL]:
        template = template_of(call)
        kind, mode, arg_grads, _, call_structure = _call_args(call)
        expanded[call] = ((kind, mode, arg_grads, call_structure), template, _unit_forward(graph, call, template))
    return expanded


@contract(provides=("units_expanded",))
def expand_unit_calls(pair: PartitionedGraphs, ctx: PassContext) -> PassResult:
    """Expand the unit calls of a partitioned pair (module docstring: pre and post)."""
    fwd, bwd, num_fwd_outputs = pair.forward, pair.backward, pair.num_fwd_outputs
    outputs = list(fwd.graph.output_node().args[0])
    saved_inputs = saved_tensor_inputs(fwd, bwd, num_fwd_outputs)
    saved_index = {n: i for i, n in enumerate(saved_inputs)}
    backward_calls = [n for n in bwd.graph.nodes if n.target is UNIT_CALL_BACKWARD]
    # each backward's unit_call, through its token: in the backward (the partitioner recomputed
    # it there) or, through the saved tensors, in the forward; two identical calls the
    # partitioner merged are one call here, and their backwards share its activations
    call_of = {}
    for call in backward_calls:
        token = _through_aliases(call.args[2])
        if token in saved_index:
            token = outputs[num_fwd_outputs + saved_index[token]]
        call_of[call] = call_of_token(token)
    in_forward = expand_forwards(fwd.graph)
    in_backward = expand_forwards(bwd.graph)
    saved_of = {forward: saved for forward, (_, _, saved) in in_backward.items()}
    for call in backward_calls:  # a checkpointed unit: its forward again, from the primals it was given
        if call.meta.get(RECOMPUTED) and call_of[call] not in saved_of:
            (kind, mode, arg_grads, call_structure), template, _ = in_forward[call_of[call]]
            saved_of[call] = _unit_forward(bwd.graph, call, template, (kind, mode, arg_grads, call.args[1], call_structure))
    handed = list(dict.fromkeys(call_of[c] for c in backward_calls if c not in saved_of and call_of[c] not in saved_of))
    # the activations handed over: first among the saved tensors, in one order on both sides
    inputs = iter(save_for_backward(fwd, bwd, num_fwd_outputs, [v for f in handed for v in in_forward[f][2]]))
    for forward in handed:
        saved_of[forward] = [next(inputs) for _ in in_forward[forward][2]]
    for call in backward_calls:
        forward = call_of[call]
        template = (in_forward.get(forward) or in_backward[forward])[1]
        _unit_backward(bwd.graph, call, template, saved_of[call] if call in saved_of else saved_of[forward])
    if not (in_forward or in_backward):
        return PassResult(pair, False)
    _drop_unread_saved(fwd, bwd, num_fwd_outputs)
    for gm in (fwd, bwd):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return PassResult(pair, True, {"unit_forwards": len(in_forward) + len(in_backward),
                                   "unit_backwards": len(backward_calls)})


def _drop_unread_saved(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Drop each saved tensor that no backward node reads from the forward's outputs and the
    backward's inputs (``saved_tensor_inputs``: the i-th saved tensor is forward output
    ``num_fwd_outputs + i``)."""
    fwd_out = fwd.graph.output_node()
    outputs = list(fwd_out.args[0])
    saved_inputs = saved_tensor_inputs(fwd, bwd, num_fwd_outputs)
    n_saved_tensors = sum(1 for v in outputs[num_fwd_outputs:] if isinstance(v, fx.Node)
                          and isinstance(v.meta.get("val"), torch.Tensor))
    unread = [i for i in range(n_saved_tensors) if not saved_inputs[i].users]
    for i in reversed(unread):
        bwd.graph.erase_node(saved_inputs[i])
        del outputs[num_fwd_outputs + i]
    fwd_out.args = (outputs,)
