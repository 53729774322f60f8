"""Put each templated unit's ops back into the partitioned forward and backward.

Until the partition a templated unit is one node with one output in the model's graphs:
``zerograph::unit_call`` in the forward, ``zerograph::unit_call_backward`` in the joint's backward
(``ops.py``). Dynamo, AOTAutograd and the min-cut partitioner each pay per graph value, and the
template's own op, ``unit_forward``, returns the unit's output and every activation its backward
reads (16 values for a GPT block, each a ``getitem`` node in every trace). Measured on a chain of
custom ops standing for units (``aot_autograd`` with the min-cut partitioner, 4 -> 64 units, CPU
ms per unit): 48-49 with 16 outputs per op, 12-17 with one.

``pair_unit_calls`` (on the joint, before its passes): each ``unit_call_backward`` and the
``unit_call`` whose backward it is (the same primals, node for node) get one id in
``meta["zerograph_unit_call"]``, which the partitioner's node copies keep.

``expand_unit_calls`` (on the partitioned pair, inside AOTAutograd's ``partition_fn``):

Pre: ``fwd`` / ``bwd`` as the min-cut partitioner returns them: ``fwd``'s outputs are its
``num_fwd_outputs`` own, then the saved tensors, then saved opaque objects and symbolic ints;
``bwd``'s inputs are the saved symbolic ints, the saved tensors in the same order, then the rest
(tangents); every ``unit_call_backward`` is paired.
Post: no ``unit_call`` / ``unit_call_backward`` is left. Each ``unit_call`` is ``unit_forward``
with the same arguments (its output: ``getitem`` 0); each ``unit_call_backward`` is
``unit_backward`` of the template, reading the primals the template saves
(``UnitTemplate.saved_primals``), the activations its ``unit_forward`` saved, and the tangent,
with the same outputs. Where that ``unit_forward`` is in the forward, its activations are new
saved tensors, first among them on both sides; a saved tensor no backward node reads any longer
(a primal only ``unit_call_backward`` read) is dropped from both sides. AOTAutograd reads the
saved-tensor counts off the returned graphs, so the pair stays consistent. A unit under an
activation checkpoint (``pair_unit_calls`` marks its backward) hands nothing over: the backward
runs its ``unit_forward`` again, from the primals the partitioner made available there, as the
checkpoint asks (without this, a block whose output backward has anyway, the next block's input,
kept its activations from forward: the partitioner cannot see them inside ``unit_call``).

``expand_inference_unit_calls``: an inference graph's ``unit_call``s become ``unit_forward``'s
first output.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.ops import UNIT_BACKWARD, UNIT_CALL, UNIT_CALL_BACKWARD, UNIT_FORWARD, _empty_like_meta

PAIR = "zerograph_unit_call"  # node.meta key: the id shared by a unit_call and its backward
RECOMPUTED = "zerograph_unit_recomputed"  # on a unit_call_backward whose unit's activations backward recomputes

_ALIASES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})
_RECOMPUTE = frozenset({CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE})
TemplateOf = Callable[[fx.Node], Any]  # a unit_call node -> its unit_trace.UnitTemplate


def pair_unit_calls(joint: fx.GraphModule) -> int:
    """Give each ``unit_call_backward`` of ``joint`` and the ``unit_call`` whose output it names
    one id (``meta[PAIR]``); returns the number of pairs. A ``unit_call`` inside an activation
    checkpoint (``torch.utils.checkpoint``: its recompute tag) has its activations recomputed in
    backward, not saved: its backward is given every primal of the call (``meta[RECOMPUTED]``),
    so that the partitioner makes them all available there."""
    pairs = 0
    for node in joint.graph.nodes:
        if node.target is UNIT_CALL_BACKWARD:
            forward = node.args[2]
            while forward.target in _ALIASES:  # autograd saves the output detached
                forward = forward.args[0]
            assert forward.target is UNIT_CALL, f"{node.name} names {forward.name}, not a unit_call"
            forward.meta[PAIR] = node.meta[PAIR] = pairs
            pairs += 1
            if forward.meta.get("recompute") in _RECOMPUTE:
                template_id, _, output, tangent = node.args
                node.args = (template_id, list(forward.args[3]), output, tangent)
                node.meta[RECOMPUTED] = True
    return pairs


def _unit_forward(graph: fx.Graph, call: fx.Node, template: Any, args: tuple | None = None) -> list[fx.Node]:
    """``unit_forward`` with ``call``'s arguments (or ``args``) before ``call``; with no ``args``,
    in its place. Returns its saved activations (``getitem`` nodes; those no one reads are left
    to dead-code elimination)."""
    args = call.args if args is None else args
    values = _empty_like_meta(args[3][0].meta["val"], template.output_metas)
    with graph.inserting_before(call):
        forward = graph.call_function(UNIT_FORWARD, args)
        forward.meta.update({k: v for k, v in call.meta.items() if k not in ("val", PAIR, RECOMPUTED)})
        forward.meta["val"] = values
        items = []
        for i, value in enumerate(values):
            item = graph.call_function(operator.getitem, (forward, i))
            item.meta["val"] = value
            items.append(item)
    if call.target is UNIT_CALL:
        call.replace_all_uses_with(items[0])
        graph.erase_node(call)
    return items[template.n_outputs:]


def _unit_backward(graph: fx.Graph, call: fx.Node, template: Any, saved: list[fx.Node]) -> None:
    """``unit_backward`` of ``template`` in place of ``call`` (a ``unit_call_backward``), reading ``saved``."""
    template_id, primals, _, tangent = call.args
    if call.meta.get(RECOMPUTED):  # it was given every primal: the template's backward reads some
        primals = [primals[i] for i in template.saved_primals]
    with graph.inserting_before(call):
        backward = graph.call_function(UNIT_BACKWARD, (template_id, primals, saved, [tangent]))
    backward.meta.update(call.meta)
    call.replace_all_uses_with(backward)
    graph.erase_node(call)


def _expand_forwards(graph: fx.Graph, template_of: TemplateOf) -> dict[int, tuple[tuple, Any, list[fx.Node]]]:
    """Expand every ``unit_call`` of ``graph``: pair id -> (its arguments' scalars, its template,
    its saved activations there)."""
    expanded = {}
    for i, call in enumerate([n for n in graph.nodes if n.target is UNIT_CALL]):
        template = template_of(call)
        expanded[call.meta.get(PAIR, -1 - i)] = (call.args[:3], template, _unit_forward(graph, call, template))
    return expanded


def expand_unit_calls(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int,
                      template_of: TemplateOf) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Expand the unit calls of a partitioned pair (module docstring: pre and post)."""
    in_forward = _expand_forwards(fwd.graph, template_of)
    in_backward = _expand_forwards(bwd.graph, template_of)  # forwards the partitioner put in backward
    backward_calls = [n for n in bwd.graph.nodes if n.target is UNIT_CALL_BACKWARD]
    saved_of = {pair: saved for pair, (_, _, saved) in in_backward.items()}
    for call in backward_calls:  # a checkpointed unit: its forward again, from the primals it was given
        pair = call.meta[PAIR]
        if call.meta.get(RECOMPUTED) and pair not in saved_of:
            scalars, template, _ = in_forward[pair]
            saved_of[pair] = _unit_forward(bwd.graph, call, template, (*scalars, call.args[1]))
    handed = [call.meta[PAIR] for call in backward_calls if call.meta[PAIR] not in saved_of]
    # the activations handed over: first among the saved tensors, in one order on both sides
    fwd_out = fwd.graph.output_node()
    outputs = list(fwd_out.args[0])
    n_saved_symbols = sum(1 for v in outputs[num_fwd_outputs:] if _is_symbol(v))
    fwd_out.args = (outputs[:num_fwd_outputs] + [v for pair in handed for v in in_forward[pair][2]]
                    + outputs[num_fwd_outputs:],)
    first_saved = [n for n in bwd.graph.nodes if n.op == "placeholder"][n_saved_symbols]
    with bwd.graph.inserting_before(first_saved):
        for pair in handed:
            saved_of[pair] = []
            for value in in_forward[pair][2]:
                placeholder = bwd.graph.placeholder(f"{value.name}_saved")
                placeholder.meta["val"] = value.meta["val"]
                saved_of[pair].append(placeholder)
    for call in backward_calls:
        pair = call.meta[PAIR]
        template = (in_forward.get(pair) or in_backward[pair])[1]
        _unit_backward(bwd.graph, call, template, saved_of[pair])
    _drop_unread_saved(fwd, bwd, num_fwd_outputs, n_saved_symbols)
    for gm in (fwd, bwd):
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return fwd, bwd


def _is_symbol(value: Any) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.SymInt | torch.SymFloat | torch.SymBool)


def _drop_unread_saved(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int, n_saved_symbols: int) -> None:
    """Drop each saved tensor that no backward node reads from the forward's outputs and the
    backward's inputs (the i-th saved tensor is forward output ``num_fwd_outputs + i`` and
    backward input ``n_saved_symbols + i``)."""
    fwd_out = fwd.graph.output_node()
    outputs = list(fwd_out.args[0])
    saved_inputs = [n for n in bwd.graph.nodes if n.op == "placeholder"][n_saved_symbols:]
    n_saved_tensors = sum(1 for v in outputs[num_fwd_outputs:] if isinstance(v, fx.Node)
                          and isinstance(v.meta.get("val"), torch.Tensor))
    unread = [i for i in range(n_saved_tensors) if not saved_inputs[i].users]
    for i in reversed(unread):
        bwd.graph.erase_node(saved_inputs[i])
        del outputs[num_fwd_outputs + i]
    fwd_out.args = (outputs,)


def expand_inference_unit_calls(gm: fx.GraphModule, template_of: TemplateOf) -> fx.GraphModule:
    """Each ``unit_call`` of an inference graph becomes ``unit_forward``'s first output."""
    if any(n.target is UNIT_CALL for n in gm.graph.nodes):
        for _, _, saved in _expand_forwards(gm.graph, template_of).values():
            for item in saved:
                gm.graph.erase_node(item)
        gm.graph.lint()
        gm.recompile()
    return gm
