"""The Inductor lowering of a graph that calls unit templates: islands of compute, each distinct one once.

With ``Config.unit_templates`` a unit's body is already lowered by Inductor once per kind
(``unit_trace``), so what the model's graph still holds per unit is glue: the unit's
all-gather and wait, its ``unit_forward`` / ``unit_backward`` call and the outputs it hands
over, a gradient's pre-divide and its reduce-scatter. Handing that whole graph to Inductor
(``lowering.lower``'s other path) costs Inductor's lowering, scheduling and code generation for
every unit's glue, a cost that grows with depth.

Here the graph is split instead into *islands*: maximal runs of consecutive ATen ops with at
least two that compute (no zerograph op, no collective, nothing that writes its input),
fused into submodules with ``torch.fx``'s ``fuse_by_partitions``. Each island is lowered by
Inductor; islands of the same structure on inputs of the same shapes, strides, storage offsets
and dtypes (one per unit: a gradient's pre-divide and copy) share one compiled callable, so their
count does not grow with depth. The
rest of the graph (the collectives, the unit calls, views) runs as FX's generated Python, as
under the eager lowering; the order of every node is the graph's, so the schedule the passes
placed is kept. The source of the idea: Inductor's own split of a graph at ops it does not lower
(fallback kernels), here done once per structure instead of once per node.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

_PREFIX = "zerograph_island_"  # the fused submodules' names
IslandCompiler = Callable[[fx.GraphModule, list[torch.Tensor], str], Callable[[list[torch.Tensor]], Any]]


def _can_hold(node: fx.Node) -> bool:
    """What an island may hold: ATen / prims ops that write none of their inputs and return
    tensors, and the ``getitem`` of such an op's tuple."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and _can_hold(source)
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if target._schema.is_mutable:
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)


def _is_view(node: fx.Node) -> bool:
    """An op ``_can_hold`` accepts that only views its input (``getitem`` is not one)."""
    return node.target is not operator.getitem and node.target.is_view


def _computes(node: fx.Node) -> bool:
    """An op ``_can_hold`` accepts that neither views nor unpacks a tuple."""
    return node.target is not operator.getitem and not _is_view(node)


def _runs(graph: fx.Graph) -> list[dict[fx.Node, None]]:
    """The islands: maximal runs of consecutive nodes (in the graph's order, which is the order
    the passes scheduled) that an island may hold, each with at least two nodes that compute. A
    run of views and one op stays in Python: there is nothing to fuse, the op's ATen kernel is
    what Inductor would call or generate, and each island costs a compile (on CPU a C++ compile
    when Inductor's cache is cold). Consecutive, not merely connected: ``torch.fx``'s
    ``CapabilityBasedPartitioner`` merges any nodes that close no cycle, e.g. every unit's
    gradient pre-divide into one island placed after the last unit's backward, which would hold
    every reduce-scatter back to the end of backward."""
    runs: list[dict[fx.Node, None]] = []
    run: list[fx.Node] = []

    def close() -> None:
        kept = _without_end_views(run)
        if sum(1 for n in kept if _computes(n)) >= 2:
            runs.append(dict.fromkeys(kept))
        run.clear()

    for node in graph.nodes:
        # a getitem stays with the op whose tuple it reads: a tuple never crosses an island's edge
        if _can_hold(node) and (node.target is not operator.getitem or node.args[0] in run):
            run.append(node)
            continue
        close()
    close()
    return runs


def _without_end_views(run: list[fx.Node]) -> list[fx.Node]:
    """``run`` less the views at either end (and the getitems of a multi-output view left out at
    the start: ``split``, ``chunk``, ``unbind``): they cost nothing in Python, and an island's
    key should not depend on them (the tiny GPT's per-unit gradient islands differed only in a
    trailing view: two distinct islands, two compiles, instead of one). A getitem left out runs
    before the island, reading a view that runs before it too."""
    start = 0
    while start < len(run) and _is_view(run[start]):
        start += 1
    dropped = set(run[:start])
    kept = [n for n in run[start:] if not (n.target is operator.getitem and n.args[0] in dropped)]
    while kept and _is_view(kept[-1]):
        kept.pop()
    return kept


def _structure(island: fx.GraphModule, inputs: list[torch.Tensor]) -> tuple:
    """A key equal for two islands exactly when they compute the same thing on inputs of the same
    shapes, strides, storage offsets, dtypes and devices: each node's op and target with its arguments as
    positions in the island, and the inputs' metadata."""
    index = {node: i for i, node in enumerate(island.graph.nodes)}

    def arg(a: Any) -> Any:
        return ("node", index[a]) if isinstance(a, fx.Node) else repr(a)

    nodes = tuple((n.op, str(n.target) if n.op != "placeholder" else "", tuple(fx.node.map_aggregate(n.args, arg)),
                   tuple(sorted((k, repr(fx.node.map_aggregate(v, arg))) for k, v in n.kwargs.items())))
                  for n in island.graph.nodes)
    # the storage offset too: Inductor compiles an as_strided relative to its example input's
    metas = tuple((tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, str(t.device)) for t in inputs)
    return nodes, metas


class _Island(torch.nn.Module):
    """A compiled island in the graph in place of its submodule (kept as ``island``, to read):
    called with the island's inputs, returns its outputs as a tuple, as the submodule did."""

    def __init__(self, island: fx.GraphModule, compiled: Callable[[list[torch.Tensor]], Any]) -> None:
        super().__init__()
        self.island, self.compiled = island, compiled

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.compiled(list(args)))  # boxed: the callee may empty the list it is given


def lower_islands(gm: fx.GraphModule, kind: str, compile_island: IslandCompiler) -> tuple[fx.GraphModule, int, int]:
    """Split a copy of ``gm`` into compute islands and lower each distinct island once.

    Args:
        gm: a partitioned forward, backward or inference graph after the passes, its nodes carrying
            fake values (``meta["val"]``); left unchanged.
        kind: ``"forward"``, ``"backward"`` or ``"inference"``, handed to ``compile_island``.
        compile_island: ``(island, fake inputs, kind) -> boxed callable`` returning the island's
            outputs as a list (``lowering._inductor_island``: Inductor's ``compile_fx_inner``); an
            island returns a tuple, also of one tensor.

    Returns:
        ``(module, islands, compiled)``: a graph module with ``gm``'s inputs and outputs whose
        islands call their compiled callables, the number of islands that compute, and the number
        of distinct ones compiled.
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node metadata comes along (the fake values)
    split = fx.GraphModule(gm, graph)
    split = fuse_by_partitions(split, _runs(split.graph), prefix=_PREFIX, always_return_tuple=True)
    compiled: dict[tuple, Callable] = {}
    islands = 0
    for node in list(split.graph.nodes):
        if node.op != "call_module" or not node.target.startswith(_PREFIX):
            continue
        island = split.get_submodule(node.target)
        islands += 1
        inputs = [a.meta["val"] for a in node.args]
        key = _structure(island, inputs)
        if key not in compiled:
            compiled[key] = compile_island(island, inputs, kind)
        split.add_submodule(node.target, _Island(island, compiled[key]))
    split.recompile()
    return split, islands, len(compiled)
