"""Replace ``zerograph::unshard`` markers by one all-gather per bucket.

Pre: the graph holds ``unshard(shard, key)`` markers (joint, forward or inference graph), with
``bucketing``'s bucket ids (a unit, or adjacent units up to a byte cap; without it, a parameter).
Post: no marker is left. For each (bucket, param_dtype) with sharded parameters, in order of first
use, right before the bucket's first marker (a tied parameter is gathered once):
    copy-in (cast each shard to ``param_dtype``; ``zerograph::pack_shards`` for several
    parameters: [Note: the copy-in layout] in ``zerograph/kernels/ops.py``)
    -> all_gather_into_tensor -> wait_tensor
    -> copy-out (several parameters: ``zerograph::unpack_gathered`` into one new buffer, then a
    slice and a view each; one parameter: views of the gathered buffer, no copy),
every node tagged with the bucket's ``gather`` role. Stage 3: every inserted node and every view of
a gathered parameter is ``MUST_RECOMPUTE`` (the partitioner saves the shards, gathers again in
backward). Stages 1-2: the gathered parameters are saved for backward (of a multi-parameter bucket,
the one unpacked buffer: its views are ``MUST_RECOMPUTE``). Stage 0 or world size 1: the marker
becomes its input, cast to ``param_dtype`` under mixed precision. ``prefetch`` and
``schedule_overlap`` move the start and the wait apart later.
qwZ (``Config.gather_quantization="int8"``): a bucket of fp32/bf16/fp16 parameters of which a
shard holds a block is gathered as ``zerograph::pack_quantized`` -> all-gather of bytes ->
``zerograph::unpack_dequantized`` (``zerograph.kernels.quantize``); other buckets as without.
Why each stage is tagged so, and what qwZ does to the gradient: docs/design.md, section
"Gathers and reductions". The spliced tensor function is ``zerograph.runtime.collectives.gather_fn``
([Note: one collective function, traced and run] in ``collectives.py``).

Source: ZeRO (arXiv 1910.02054) section 5.3 (P_p); FSDP2's copy-in / all-gather / copy-out and
``MixedPrecisionPolicy``; SimpleFSDP (arXiv 2411.00284) for recompute-tagged gathers; ZeRO++
(arXiv 2306.10209) section 3.1 (qwZ).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.graph.ops import UNSHARD
from zerograph.graph.vocab import TAG
from zerograph.kernels.ops import UNPACK_GATHERED
from zerograph.kernels.quantize import UNPACK_DEQUANTIZED
from zerograph.runtime.collectives import cast_fn, gather_fn

from ._fx import NodeOrder, bucket_tag, group_markers, hoist_before, is_alias_of_input, layout_template, splice
from .context import PassContext, PassResult
from .contract import contract


def plan_gathers(graph: fx.Graph, ctx: PassContext) -> list[list[fx.Node]]:
    """Group the markers into all-gathers, in order of first use: one per (bucket, dtype,
    sharded), where the bucket is ``bucketing``'s choice or, without it, the parameter itself.

    Deterministic across ranks: ordered by graph position, never by set or dict-of-id order.
    """
    return group_markers(graph.find_nodes(op="call_function", target=UNSHARD), ctx)


@contract(requires=("markers",), provides=("gathers",))
def insert_allgather(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    plan = plan_gathers(graph, ctx)
    if not plan:
        return PassResult(gm, False)
    recompute = ctx.stage == 3 and ctx.graph_kind == "joint"
    gathers = 0
    order = NodeOrder(graph)  # hoists move shards' views up; splices insert before the markers
    for markers in plan:
        keys = list(dict.fromkeys(m.args[1] for m in markers))
        layouts = [ctx.layouts[k] for k in keys]
        if not ctx.communicates or not layouts[0].sharded:
            _replace_by_local_copies(graph, markers, ctx)
            continue
        first = markers[0]
        shard_of = {m.args[1]: m.args[0] for m in markers}
        for shard in shard_of.values():  # a shard's to_local view may sit after the unit's first use
            hoist_before(shard, first, order)
        fulls = splice(graph, gather_fn(layouts, ctx.world_size, ctx.group_name, ctx.gather_quantization),
                       [shard_of[k] for k in keys], before=first, tag=bucket_tag("gather", layouts),
                       template=("gather", layout_template(layouts), ctx.world_size, ctx.group_name,
                                 ctx.gather_quantization))
        full_of = dict(zip(keys, fulls))
        for marker in markers:
            marker.replace_all_uses_with(full_of[marker.args[1]])
            graph.erase_node(marker)
        gathers += 1
        if recompute:
            _mark_recompute(fulls)
        elif ctx.graph_kind == "joint" and (len(layouts) > 1 or _unpacked(fulls[0]) is not None):
            # saved for backward: the one unpacked buffer, not each parameter's view of it
            _recompute_views([_unpacked(fulls[0])])
    graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(gm, True, {"all_gather": gathers})


def _replace_by_local_copies(graph: fx.Graph, markers: list[fx.Node], ctx: PassContext) -> None:
    """No communication (the shard is the full parameter): each marker becomes its input, cast
    to ``param_dtype`` when that differs (one cast per parameter, before its first use)."""
    cast_of: dict[int, fx.Node] = {}
    for marker in markers:
        shard, key = marker.args[0], marker.args[1]
        dtype = ctx.layouts[key].param_dtype
        if shard.meta["val"].dtype == dtype:
            full = shard
        elif key in cast_of:
            full = cast_of[key]
        else:
            full = cast_of[key] = splice(graph, cast_fn(dtype), [shard], before=marker, template=("cast", dtype))
        marker.replace_all_uses_with(full)
        graph.erase_node(marker)


def _mark_recompute(fulls: list[fx.Node]) -> None:
    """Tag the gather chain and every view of a gathered parameter ``MUST_RECOMPUTE``, so no
    gathered buffer (nor an alias keeping it alive) is saved for backward."""
    stack = list(fulls)
    seen: set[fx.Node] = set()
    while stack:  # the inserted chain, walking back to the shards
        node = stack.pop()
        if node in seen or node.op != "call_function" or TAG not in node.meta:
            continue
        seen.add(node)
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        stack.extend(node.all_input_nodes)
    _recompute_views(fulls)


# ops that only move a tensor's data (after AOTAutograd's decompositions, ``reshape`` of a
# non-contiguous view is ``clone`` + ``_unsafe_view``): one made from gathered parameters alone
# is a gathered parameter too, as large, and as cheap to make again as a view
_LAYOUT_COPIES = frozenset({torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default,
                            torch.ops.aten.cat.default, torch.ops.aten._to_copy.default})


def _recompute_views(bases: list[fx.Node]) -> None:
    """Mark every view of ``bases`` (transitively, e.g. a weight's transpose), and every layout
    copy made of them alone (a parameter cut out of a unit's gathered flat shard: a column slice,
    copied by the reshape, ``flat.py``), ``MUST_RECOMPUTE``: otherwise the partitioner saves
    that copy for backward, and a stage-3 unit keeps its gathered parameters from forward to
    backward instead of gathering them again."""
    derived, stack = set(bases), list(bases)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in derived or user.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
                continue
            if is_alias_of_input(user) or (user.target in _LAYOUT_COPIES
                                           and all(inp in derived for inp in user.all_input_nodes)):
                user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                derived.add(user)
                stack.append(user)


def _unpacked(full: fx.Node) -> fx.Node | None:
    """The ``unpack_gathered`` (or ``unpack_dequantized``) node a gathered parameter views, or
    ``None`` when it views the gathered buffer itself (a single unquantized parameter)."""
    while full.target not in (UNPACK_GATHERED, UNPACK_DEQUANTIZED):
        if full.op != "call_function" or not full.args or not isinstance(full.args[0], fx.Node):
            return None
        full = full.args[0]
    return full
