"""Small FX helpers shared by the passes: splice a traced function in, find aliases, tag nodes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

TAG = "zerograph"  # node.meta[TAG] = {"role": ..., "unit": ...} on every node a pass inserts


def splice(graph: fx.Graph, fn: Callable[..., Any], args: Sequence[fx.Node], *, before: fx.Node,
           tag: dict[str, Any] | None = None) -> Any:
    """Trace ``fn`` on the fake values of ``args`` and insert its ops before ``before``.

    Replacement code is written as an ordinary tensor function and traced to aten ops (Inductor's
    fx_passes do the same), so every inserted node carries ``meta["val"]`` for the partitioner and
    later passes. Returns ``fn``'s output structure with the new nodes in place of tensors.
    """
    vals = [a.meta["val"] for a in args]
    fake_mode = detect_fake_mode(vals)
    assert fake_mode is not None, "graph nodes carry no fake values"
    with fake_mode:
        traced = make_fx(fn, pre_dispatch=False)(*vals)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args))
    result: Any = None
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = pytree.tree_map(lambda x: env[x] if isinstance(x, fx.Node) else x, node.args[0])
                break
            assert node.op == "call_function", f"traced replacement produced a {node.op} node"
            new = graph.node_copy(node, lambda n: env[n])
            if tag is not None:
                new.meta[TAG] = dict(tag)
            env[node] = new
    return result


def is_alias_of_input(node: fx.Node) -> bool:
    """True when ``node``'s output shares storage with its first tensor input (a view op)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def hoist_before(node: fx.Node, point: fx.Node, order: dict[fx.Node, int]) -> None:
    """Move ``node`` (and, recursively, its inputs) before ``point`` if it sits after it."""
    if order[node] < order[point] or node.op == "placeholder":
        return
    for inp in node.all_input_nodes:
        hoist_before(inp, point, order)
    point.prepend(node)
    order[node] = order[point] - 0.5  # type: ignore[assignment]


def count_targets(graph: fx.Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            name = str(node.target)
            counts[name] = counts.get(name, 0) + 1
    return counts


def sink_below_inputs(graph: fx.Graph) -> None:
    """Move each node that sits above one of its inputs to just below it; all else keeps its order.

    The mirror image of Inductor's ``stable_topological_sort`` (which lifts inputs up to their
    users): a pass that defines a value later than its old uses wants the uses to move down, so the
    new definition stays where the pass put it.
    """
    placed: set[fx.Node] = set()
    waiting: list[fx.Node] = []
    for node in list(graph.nodes):
        if not all(inp in placed for inp in node.all_input_nodes):
            assert node.op != "output", "sink_below_inputs: a value is never defined"
            waiting.append(node)
            continue
        placed.add(node)
        cursor, progress = node, True
        while progress and waiting:
            progress = False
            for pending in list(waiting):
                if all(inp in placed for inp in pending.all_input_nodes):
                    if cursor.op == "output":
                        cursor.prepend(pending)
                    else:
                        cursor.append(pending)
                        cursor = pending
                    placed.add(pending)
                    waiting.remove(pending)
                    progress = True
