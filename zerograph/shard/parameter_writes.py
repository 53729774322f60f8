"""The parameter-write check of a captured forward: a gathered parameter written in place inside
forward is refused by name, since the write would never reach the shards.

``check_no_parameter_writes`` runs on every Dynamo graph (``capture.ZeroGraphBackend``);
``parameter_write_error`` words the refusal for it and for a unit template's body
(``unit_trace``).
"""
from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import ShardingError
from ..graph.ops import UNSHARD

# methods ending in "_" that write no element of their tensor
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})
_INPLACE_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                                operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})
# functions that write their weight when given max_norm (they renormalise the rows they look up)
_RENORMALISING = {torch.nn.functional.embedding: 1, torch.nn.functional.embedding_bag: 1}


def written_arguments(node: fx.Node) -> list[tuple[Any, str]]:
    """``(argument, op)`` for every argument a Dynamo graph node writes in place: a method ending
    in ``_`` (``clamp_``, ``copy_``, ``mul_``), item assignment and augmented operators, a torch
    function ending in ``_`` (``torch.embedding_renorm_``), ``F.embedding`` / ``F.embedding_bag``
    with ``max_norm``, an ``OpOverload`` whose schema marks an argument written, ``out=`` and
    ``inplace=True``."""
    target, args, kwargs = node.target, node.args, node.kwargs
    found: list[tuple[Any, str]] = []
    if node.op == "call_method" and args:
        name = str(target)
        if (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES) or name in (
                "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
            found.append((args[0], f"Tensor.{name}"))
    elif node.op == "call_function":
        if target in _INPLACE_OPERATORS and args:
            found.append((args[0], "item assignment (t[...] = v)" if target is operator.setitem
                          else f"operator.{target.__name__}"))
        elif target in _RENORMALISING:
            bound = inspect.signature(target).bind(*args, **kwargs)
            if bound.arguments.get("max_norm") is not None:
                found.append((args[_RENORMALISING[target]] if len(args) > 1 else kwargs.get("weight"),
                              f"F.{target.__name__}(max_norm=...), which renormalises the rows it looks up in place"))
        elif isinstance(target, torch._ops.OpOverload):
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    found.append((value, str(target)))
        elif getattr(target, "__name__", "").endswith("_") and getattr(target, "__module__", None) in (
                "torch", "torch._C._VariableFunctions", None) and args:
            found.append((args[0], f"torch.{target.__name__}"))
    if isinstance(kwargs.get("out"), fx.Node):
        found.append((kwargs["out"], f"{getattr(target, '__name__', target)}(out=...)"))
    if kwargs.get("inplace") is True and args:
        found.append((args[0], f"{getattr(target, '__name__', target)}(inplace=True)"))
    return found


_CUTS = frozenset({"view", "reshape", operator.getitem})  # how FlatShard.full_parameter cuts, as Dynamo records it


def check_no_parameter_writes(graph: fx.Graph, layouts: dict[int, Any],
                              flat_members: dict[str, dict[int, str]] | None = None) -> None:
    """Refuse a captured forward that writes a gathered parameter in place.

    Inside a zerograph forward a parameter attribute is ``zerograph::unshard``'s output, a new
    tensor (the gathered copy at stages 1-3, a copy of the replica at stage 0), so an in-place
    write to it, or to a view of it (``weight.data``, ``weight[i]``), never reaches the shards
    the optimizer updates: it would be lost silently. Writes are found by storage: every written
    argument (``written_arguments``) whose fake value shares a storage with a marker's output.
    Writing back instead is not offered: every rank writes its own rows of a different batch
    (DDP's replicas diverge there), so there is no single result to store.

    Also refuses ``F.embedding(..., sparse=True)`` on a parameter (a sparse gradient; see
    ``api._check_no_sparse_gradients`` for the module form).

    ``flat_members``: a unit's flat shard name -> element offset -> the name of the parameter there
    (``flat.py``), so that a write to a parameter cut out of the flat shard names the parameter.

    Raises:
        ShardingError: naming the parameter (its first name), the op and what to do instead.
    """
    marker_of: dict[StorageWeakRef, str] = {}  # storage of a full parameter (or a view) -> its name
    name_of: dict[fx.Node, str] = {}  # the markers and their cuts -> the parameter's name
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        if node.target is UNSHARD:
            name_of[node] = layouts[node.args[1]].fqn
        elif node.target in _CUTS and node.args and node.args[0] in name_of:
            # a parameter cut out of its unit's gathered flat shard (flat.py), a reshape's copy at
            # world size > 1; the cut's column slice says which parameter it is
            name = name_of[node.args[0]]
            index = node.args[1] if len(node.args) > 1 else None
            if isinstance(index, tuple) and len(index) == 2 and isinstance(index[1], slice):
                name = (flat_members or {}).get(name, {}).get(index[1].start, name)
            name_of[node] = name
        else:
            continue
        marker_of.setdefault(StorageWeakRef(value.untyped_storage()), name_of[node])
    if not marker_of:
        return
    for node in graph.nodes:
        if node.target in _RENORMALISING and inspect.signature(node.target).bind(*node.args, **node.kwargs) \
                .arguments.get("sparse") is True:  # F.embedding(..., sparse=True): see api's module check
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            value = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
            fqn = name_of.get(weight) or (marker_of.get(StorageWeakRef(value.untyped_storage()))
                                          if isinstance(value, torch.Tensor) else None)
            if fqn is not None:
                raise ShardingError(
                    f"parameter {fqn!r} gets a sparse gradient from F.{node.target.__name__}(sparse=True) "
                    f"(graph node {node.name!r}), which zerograph's sharded parameters (DTensors) cannot hold: "
                    "use sparse=False")
        for arg, op in written_arguments(node):
            value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
            if not isinstance(value, torch.Tensor):
                continue
            fqn = name_of.get(arg) or marker_of.get(StorageWeakRef(value.untyped_storage()))
            if fqn is None:
                continue
            raise parameter_write_error(fqn, op, node.name)


def parameter_write_error(fqn: str, op: str, node_name: str) -> ShardingError:
    """The error for parameter ``fqn`` written in place by ``op`` (graph node ``node_name``) inside
    forward, with what to do instead; one wording for the model graph and a unit template's body."""
    if "embedding_renorm" in op:  # as a traced body records F.embedding(max_norm=...)
        op = f"{op}, which F.embedding(max_norm=...) calls to renormalise the rows it looks up in place"
    renormalising = "max_norm" in op
    hint = ("build the embedding with max_norm=None and, if the norm bound matters, renormalise after "
            "opt.step() under torch.no_grad() (outside forward the weight is this rank's DTensor shard of "
            "whole rows, Shard(0), e.g. w.to_local().copy_(torch.renorm(w.to_local(), 2, 0, max_norm)); "
            "this bounds every row, not only those looked up)" if renormalising else
            "compute with a changed copy instead (w = self.weight.clamp(...)), or change the parameter "
            "outside forward, e.g. after opt.step() under torch.no_grad(), where it is this rank's "
            "DTensor shard")
    return ShardingError(
        f"parameter {fqn!r} is written in place inside forward by {op} (graph node {node_name!r}). "
        "Inside a zerograph forward a parameter is a gathered copy of the shards (at every stage), so "
        f"the write would never reach the parameter and would be lost silently. To fix: {hint}")
