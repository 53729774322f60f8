"""Decide which parameters share one collective: one bucket per unit, or adjacent units up to a cap.

Pre: the graph holds ``unshard`` markers (joint, forward, inference) or ``reduce_grad`` markers
(backward), not yet expanded.
Post: every marker carries ``meta["zerograph"]["bucket"]``, an int equal for the markers that one
all-gather (or one reduce-scatter) will move; the graph's nodes and order are unchanged.
``insert_allgather`` and ``insert_reduce_scatter`` then emit one flat collective per (bucket,
dtype); without this pass they emit one per parameter (the un-bucketed baseline).

Buckets follow the order in which units are first used in this graph, so on every rank the same
markers land in the same bucket in the same order, and the flat layout is bitwise reproducible.
A unit is never split: one larger than ``bucket_bytes`` is a bucket of its own. Bytes are full
(unsharded, padded) bytes, what the all-gather produces.

Source: PyTorch DDP's gradient buckets (``bucket_cap_mb``); DeepSpeed's ``reduce_bucket_size``;
FSDP2's one all-gather per ``fully_shard`` unit; SimpleFSDP (arXiv 2411.00284) section 4.1.
"""
from __future__ import annotations

import torch.fx as fx

from zerograph.graph.ops import REDUCE_GRAD, UNSHARD
from zerograph.graph.vocab import TAG

from .context import PassContext, PassResult
from .contract import contract


def unit_order(markers: list[fx.Node], ctx: PassContext) -> list[int]:
    """Units in the order this graph first uses them."""
    return list(dict.fromkeys(ctx.layouts[m.args[1]].unit for m in markers))


def unit_bytes(unit: int, markers: list[fx.Node], ctx: PassContext) -> int:
    """Full bytes the unit's collective moves: in the gathered dtype (``param_dtype``) or, in
    backward, the reduced one (``reduce_dtype``)."""
    keys = {m.args[1] for m in markers if ctx.layouts[m.args[1]].unit == unit}
    layouts = [ctx.layouts[k] for k in keys]
    if ctx.graph_kind == "backward":
        return sum(layout.padded_numel * layout.reduce_dtype.itemsize for layout in layouts)
    return sum(layout.padded_numel * layout.param_dtype.itemsize for layout in layouts)


def assign_buckets(units: list[int], sizes: dict[int, int], cap: int) -> dict[int, int]:
    """Unit -> bucket id: walk ``units`` in order, opening a new bucket whenever adding the next
    unit would exceed ``cap`` bytes (``cap == 0``: one bucket per unit). Bucket ids are the index
    of their first unit in ``units``."""
    bucket_of: dict[int, int] = {}
    bucket, filled = -1, 0
    for i, unit in enumerate(units):
        if bucket < 0 or cap == 0 or filled + sizes[unit] > cap:
            bucket, filled = i, 0
        bucket_of[unit] = bucket
        filled += sizes[unit]
    return bucket_of


@contract(requires=("markers",), provides=("buckets",))
def bucketing(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    marker = REDUCE_GRAD if ctx.graph_kind == "backward" else UNSHARD
    markers = list(gm.graph.find_nodes(op="call_function", target=marker))
    if not markers or not ctx.communicates:
        return PassResult(gm, False)
    units = unit_order(markers, ctx)
    sizes = {u: unit_bytes(u, markers, ctx) for u in units}
    bucket_of = assign_buckets(units, sizes, ctx.schedule.bucket_bytes)
    for node in markers:
        node.meta.setdefault(TAG, {})["bucket"] = bucket_of[ctx.layouts[node.args[1]].unit]
    return PassResult(gm, True, {"buckets": len(set(bucket_of.values())), "units": len(units)})
