"""Eager's ``None`` gradient for a graph input the loss reaches only through outputs it does not read.

AOTAutograd's compiled backward takes a gradient for every differentiable output of its graph and
fills zeros where none arrived (an output the loss does not read: another member of a returned
tuple, an intermediate the model stored on itself), so it returns a defined gradient, zeros, for
every input, where eager autograd leaves ``.grad`` ``None`` and AdamW's weight decay leaves the
parameter alone. Which outputs got a gradient is known only when the backward runs: a post-hook
on the compiled function's autograd node (``torch.autograd.graph.Node.register_hook``) sees
``None`` for them, and replaces the gradient of every input that no reached output depends on
with ``None``. The graph's collectives ran all the same, so the ranks stay in step; the ranks
agree on the inputs no rank reached with one all-reduce of a mask, run only for graphs whose
outputs depend on different inputs (a graph with one loss output pays nothing).

Which inputs an output depends on is read from the Dynamo graph's data flow (an over-estimate of
where its gradient flows: an input it reads through a non-differentiable op counts as reached,
and keeps the zero gradient it had before).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils import _pytree as pytree

COMPILED_NODE = "CompiledFunctionBackward"  # AOTAutograd's autograd.Function (runtime_wrappers.py)


def output_reach(gm: fx.GraphModule) -> list[frozenset[int]]:
    """For each output of ``gm`` (its return value's leaves, in ``pytree`` order), the positions
    of the placeholders it depends on through the graph's data flow."""
    deps: dict[fx.Node, frozenset[int]] = {}
    outputs: list[frozenset[int]] = []
    placeholders = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node] = frozenset((placeholders,))
            placeholders += 1
        elif node.op == "output":
            outputs = [deps.get(leaf, frozenset()) if isinstance(leaf, fx.Node) else frozenset()
                       for leaf in pytree.tree_leaves(node.args[0])]
        else:
            deps[node] = frozenset().union(*(deps[arg] for arg in node.all_input_nodes))
    return outputs


def none_for_unreached(compiled: Callable[..., Any], reach: list[frozenset[int]],
                       group: dist.ProcessGroup, device: torch.device) -> Callable[..., Any]:
    """``compiled`` (``aot_module_simplified``'s function of a Dynamo graph whose outputs have
    ``reach``, ``output_reach``), giving the inputs that no output a backward reached depends on
    a ``None`` gradient, as eager does; ``compiled`` itself when every output depends on the same
    inputs. ``group``: the ranks that run this graph in step (they agree on which inputs no rank
    reached, with a mask on ``device``: CPU for gloo, the rank's GPU for NCCL)."""
    contested = sorted(frozenset().union(*reach) - frozenset.intersection(*reach)) if reach else []
    if not contested:
        return compiled
    watch = _UnreachedInputs(reach, contested, group, device)

    @functools.wraps(compiled)
    def call(*args: Any) -> Any:
        outputs = compiled(*args)
        if torch.is_grad_enabled():
            watch.hook(args, outputs)
        return outputs

    return call


class _UnreachedInputs:
    """One graph's reach (``output_reach``) and the inputs some output does not depend on."""

    def __init__(self, reach: list[frozenset[int]], contested: list[int], group: dist.ProcessGroup,
                 device: torch.device) -> None:
        self.reach, self.contested, self.group, self.device = reach, contested, group, device

    def hook(self, args: Sequence[Any], outputs: Any) -> None:
        """Register the post-hook on this call's compiled autograd node, if the call made one."""
        node, output_slots = _compiled_node(pytree.tree_leaves(outputs))
        if node is None:
            return
        edges = {(id(fn), nr): slot for slot, (fn, nr) in enumerate(node.next_functions) if fn is not None}
        input_slots: dict[int, int] = {}
        for position in self.contested:
            arg = args[position] if position < len(args) else None
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                edge = get_gradient_edge(arg)
                slot = edges.get((id(edge.node), edge.output_nr))
                if slot is not None:
                    input_slots[position] = slot
        if input_slots:
            node.register_hook(functools.partial(self._drop_unreached, output_slots, input_slots))

    def _drop_unreached(self, output_slots: dict[int, int | None], input_slots: dict[int, int],
                        grad_inputs: tuple[torch.Tensor | None, ...],
                        grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        """``grad_inputs`` with ``None`` for each contested input no rank reached. An output the
        node does not produce itself counts as reached (its gradient's way is not followed)."""
        reached: set[int] = set()
        for index, slot in output_slots.items():
            if slot is None or grad_outputs[slot] is not None:
                reached |= self.reach[index]
        mask = torch.tensor([position in reached for position in input_slots], dtype=torch.uint8,
                            device=self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
        grads = list(grad_inputs)
        for was_reached, slot in zip(mask.tolist(), input_slots.values()):  # (one device-to-host copy)
            if not was_reached:
                grads[slot] = None
        return tuple(grads)


def _compiled_node(outputs: Sequence[Any]) -> tuple[Node | None, dict[int, int | None]]:
    """The compiled function's autograd node of one call and, for each output a gradient can
    reach (by position in ``outputs``), the slot of its gradient among the node's inputs, or
    ``None`` for one the node does not produce itself (an alias AOTAutograd regenerates)."""
    node: Node | None = None
    slots: dict[int, int | None] = {}
    for index, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            continue
        edge = get_gradient_edge(out)
        if edge.node.name() == COMPILED_NODE and (node is None or edge.node is node):
            node = edge.node
            slots[index] = edge.output_nr
        else:
            slots[index] = None
    return node, slots
