"""Hand-built graphs around one templated unit (``zerograph::unit_call``), as capture leaves them
before the unit-call passes: the joint graph, the partitioned pair, an inference graph.

The unit is a real template (``templates.kinds``) of ``Block``, ``relu(x @ w.t())`` with ``w``
(4, 4) and ``x`` (2, 4), traced once per process on first use. Its primals are ``[x, w]``; its
``unit_forward`` returns the output and one activation the backward reads (``relu``'s output);
its backward reads primal ``x`` and that activation, and returns ``w``'s gradient (``x`` is the
batch: ``arg_grads`` 0). The graphs hold the unit's primals as inputs (``w`` the full weight, as
at stage 0); the unit-call passes read no gather.
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from tests.passes.graphs import GraphBuilder, aten
from zerograph.graph.ops import UNIT_CALL, UNIT_CALL_BACKWARD
from zerograph.passes.context import PartitionedGraphs
from zerograph.passes.expand_unit_calls import RECOMPUTED, template_of
from zerograph.templates.kinds import install_unit_templates
from zerograph.templates.unit_calls import call_key, describe

ROWS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(ROWS, ROWS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class DropoutBlock(Block):
    """``Block`` with a dropout after the matmul: its template draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.drop(self.lin(x)))


def block_kind(dropout: bool = False) -> tuple[int, int, int, Any]:
    """``(kind, mode, call, keep-alive)`` of one ``Block`` (``DropoutBlock``) unit in training
    mode: the arguments of its ``unit_call``, one kind per process. The registry holds kinds
    weakly; the last item keeps this one alive. The first template traced in a process pays
    torch's tracing warm-up (seconds)."""
    return _block_kind(dropout)


@functools.lru_cache(maxsize=None)
def _block_kind(dropout: bool) -> tuple[int, int, int, Any]:
    block = DropoutBlock() if dropout else Block()
    kinds = install_unit_templates([("u1", block)], {id(block.lin.weight): 0}, "eager", [])
    arguments = (describe((torch.empty(0),), []), describe({}, []))
    mode = (1 << len(list(block.modules()))) - 1  # every submodule in training mode
    return kinds[0].kind, mode, call_key((*arguments, None)), (block, kinds)


def _unit_call(b: GraphBuilder, x, w, *, checkpointed: bool = False, token: bool = True, dropout: bool = False):
    """``unit_call`` of the block on ``[x, w]``: ``(call, output, token)`` nodes (no token read
    without ``token``: ``None``); with ``checkpointed``, tagged as ``torch.utils.checkpoint``
    tags its region's nodes."""
    kind, mode, call, _ = block_kind(dropout)
    node = b.op(UNIT_CALL, kind, mode, 0, [x, w], call)
    out = b.op(operator.getitem, node, 0)
    token = b.op(operator.getitem, node, 1) if token else None
    if checkpointed:
        for tagged in (node, out, token):
            tagged.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=1)
    return node, out, token


def _backward(b: GraphBuilder, call, token, primals, tangent):
    """``unit_call_backward`` of ``call`` reading ``primals``: ``w``'s gradient (a ``getitem``)."""
    node = b.op(UNIT_CALL_BACKWARD, template_of(call).id, primals, token, [tangent])
    return b.op(operator.getitem, node, 0)


def joint_unit(*, checkpointed: bool = False, dropout: bool = False):
    """The joint graph of one unit call (a ``DropoutBlock`` with ``dropout``) and its backward:
    ``(builder, gm)``; returns the loss and ``w``'s reduced gradient. The backward reads the
    primals the template saves."""
    b = GraphBuilder([[(ROWS, ROWS)]], stage=0)
    x, tangent, w = b.input("x", 2, ROWS), b.input("tangents_1"), b.input("w", ROWS, ROWS)
    call, out, token = _unit_call(b, x, w, checkpointed=checkpointed, dropout=dropout)
    loss = b.op(aten.sum.default, out)
    primals = [[x, w][i] for i in template_of(call).saved_primals]
    grad = _backward(b, call, token, primals, b.op(aten.expand.default, tangent, [2, ROWS]))
    return b, b.output(loss, b.reduce_grad(grad, 0))


def partitioned_unit(*, recomputed: bool = False) -> tuple[GraphBuilder, PartitionedGraphs]:
    """The pair the partitioner makes of ``joint_unit``: the forward returns the loss and saves
    ``x`` and the call's token (and, for a unit ``mark_recomputed_unit_calls`` marked, ``w``);
    the backward takes them by those names, then the tangent, and returns ``w``'s gradient."""
    fb = GraphBuilder([[(ROWS, ROWS)]], stage=0)
    x, w = fb.input("x", 2, ROWS), fb.input("w", ROWS, ROWS)
    call, out, token = _unit_call(fb, x, w)
    saved = [x, w, token] if recomputed else [x, token]
    fwd = fb.output(fb.op(aten.sum.default, out), *saved)
    bb = GraphBuilder([[(ROWS, ROWS)]], stage=0)
    inputs = {n.name: bb.input(n.name, *n.meta["val"].shape) for n in saved}
    tangent = bb.input("tangents_1")
    primals = [inputs["x"], inputs["w"]] if recomputed else [inputs["x"]]
    grad = _backward(bb, call, inputs[token.name], primals, bb.op(aten.expand.default, tangent, [2, ROWS]))
    if recomputed:
        grad.args[0].meta[RECOMPUTED] = True
    return fb, PartitionedGraphs(fwd, bb.output(grad), num_fwd_outputs=1)


def inference_unit():
    """An inference (no-grad) graph of one unit call: ``(builder, gm)``; returns ``sum(output)``."""
    b = GraphBuilder([[(ROWS, ROWS)]], stage=0)
    x, w = b.input("x", 2, ROWS), b.input("w", ROWS, ROWS)
    _, out, _ = _unit_call(b, x, w, token=False)
    return b, b.output(b.op(aten.sum.default, out))
