"""In-place writes in a unit's joint graph (``unit_trace``): writes to its primals are refused
(``check_no_writes``), writes to its intermediates made out-of-place (``functional_joint``)
before the min-cut partitioner, which, as AOTAutograd's, expects a functional graph, and random
ops marked to be saved, not drawn again in backward (``save_random_values``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from ..shard.parameter_writes import parameter_write_error


def check_no_writes(name: str, joint: fx.GraphModule, n_primals: int, parameters: dict[int, str],
                     cut_out: dict[StorageWeakRef, str] | None = None) -> None:
    """Refuse a body that writes a primal in place: a parameter with ``ShardingError`` (as
    ``parameter_writes.check_no_parameter_writes`` refuses it inline: the write would be lost), anything
    else (an argument, a buffer: a batch norm's statistics) with ``ValueError``, which makes the
    kind run inline. ``parameters``: primal index -> the parameter's name in the unit;
    ``cut_out``: storages of parameters cut out of a flat shard -> their names (writes refused too)."""
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"][:n_primals]
    index_of: dict[StorageWeakRef, int | str] = {
        StorageWeakRef(n.meta["val"].untyped_storage()): i for i, n in enumerate(placeholders)
        if isinstance(n.meta.get("val"), torch.Tensor)}
    for ref, param_name in (cut_out or {}).items():
        index_of.setdefault(ref, param_name)
    for node in joint.graph.nodes:
        for value in _written(node):
            val = value.meta.get("val") if isinstance(value, fx.Node) else None
            index = index_of.get(StorageWeakRef(val.untyped_storage())) if isinstance(val, torch.Tensor) else None
            if index is None:
                continue
            if isinstance(index, str) or index in parameters:
                param_name = index if isinstance(index, str) else parameters[index]
                raise parameter_write_error(f"{name}.{param_name}", str(node.target), f"{node.name} in the unit's body")
            raise ValueError(f"unit {name!r} writes an input or buffer in place ({node.target}); a template's "
                             "inputs are copies")


def functional_joint(joint_graph: fx.GraphModule, primals: list[torch.Tensor], tangents: list[torch.Tensor],
                fake_mode: FakeTensorMode) -> fx.GraphModule:
    """``joint_graph`` with its in-place writes to intermediates (``x[..., :k] += y``, the
    ``copy_`` into a slice of zeros in ``rfft``'s backward) made out-of-place, as AOTAutograd
    functionalizes before it partitions: the min-cut partitioner keeps only the ancestors of each
    output, so a write whose result is read through its base's node was dropped, silently. A
    graph without writes is returned as it is (writes to primals were refused before this).
    Source: ``torch.func.functionalize(remove="mutations")``."""
    if not any(_written(node) for node in joint_graph.graph.nodes):
        return joint_graph

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> Any:
        return torch.func.functionalize(joint_graph, remove="mutations")(primals, tangents)

    with fake_mode:
        return make_fx(joint)([p.detach() for p in primals], tangents)


def _written(node: fx.Node) -> list[Any]:
    """The arguments ``node`` writes in place (its schema's mutable ones; none for a node that is
    no ATen op)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for i, arg in enumerate(node.target._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def save_random_values(graph: fx.Graph) -> int:
    """Mark each random op of ``graph`` (ATen's ``nondeterministic_seeded`` tag: ``bernoulli``,
    ``rand``, ``normal``...) ``MUST_SAVE``, so the partitioner hands its value to backward instead
    of drawing it again there (a second draw is another mask: eager's backward reuses the
    forward's). Attention carries the tag for its dropout, so it counts only with a ``dropout_p``
    other than 0. Returns the number of ops marked."""
    marked = 0
    for node in graph.nodes:
        if _draws_random(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def _draws_random(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    schema = target._schema.arguments
    values = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
              for i, a in enumerate(schema)}
    return values.get("dropout_p", 1.0) != 0
