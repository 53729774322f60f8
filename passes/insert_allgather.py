"""Replace ``zerograph::unshard`` markers by one all-gather per bucket.

Pre: the graph holds ``unshard(shard, key)`` markers (joint, forward or inference graph), with
``bucketing``'s bucket ids (a unit, or adjacent units up to a byte cap; without it, a parameter).
Post: no marker is left. For each (bucket, param_dtype) with sharded parameters, in order of
first use:
    copy-in (cast each shard to ``param_dtype``, pad it to ``chunk_rows``, flatten, concatenate:
    one ``zerograph::pack_shards`` node for a bucket of several parameters)
    -> all_gather_into_tensor -> wait_tensor
    -> copy-out (a bucket of several parameters: one ``zerograph::unpack_gathered`` node, the
    parameters parameter-major in one new buffer, then a slice and a view per parameter; a single
    parameter: views of the gathered buffer, no copy),
every node tagged with the bucket's ``gather`` role (the copy-out joins ``find_collectives``'
finish chain), inserted right before the bucket's first marker, so it is gathered once even when
a parameter is used several times (tied weights). ``prefetch`` and ``schedule_overlap`` move the
start and the wait apart later. At stage 3 every inserted node and every view of a gathered
parameter is marked ``MUST_RECOMPUTE``: the min-cut partitioner then saves only the
shards for backward and re-gathers there (ZeRO-3's "gather for forward, release, gather again for
backward"); gathered buffers die after their last use (FX codegen and Inductor free them).
At stages 1-2 the gathered parameters stay saved for backward (gathered once per step, the 2Ψ of
the paper); of a multi-parameter bucket the partitioner saves the one unpacked buffer, not each
view of it (every view is marked ``MUST_RECOMPUTE``: AOTAutograd's ``recompute_views``, per
node). At stage 0 or world size 1 the marker becomes its input (shards are full tensors), cast
to ``param_dtype`` under mixed precision. Without mixed precision no cast is emitted.

With ``Config.gather_quantization="int8"`` (ZeRO++'s qwZ) a bucket of fp32/bf16/fp16 parameters
of which at least one shard holds a block (256 elements) is gathered quantized instead: copy-in
``zerograph::pack_quantized`` (each rank's shards as int8 blocks plus fp32 scales, small shards
raw, in one uint8 send buffer: ``zerograph.kernels.quantize``), an all-gather of those bytes, and
copy-out ``zerograph::unpack_dequantized`` (each rank's chunk dequantized with its own scales into
``param_dtype``, parameter-major), then a slice and a view per parameter. Quantize is fused with
the pack (and dequantize with the unpack) in one kernel launch per parameter. The gradient is
unaffected: the markers' backward (``reduce_grad``) reduces the full-precision gradient, taken at
the dequantized weights. Other buckets (integer, bool, complex, fp64, or all shards below a
block) gather as without quantization.

The spliced tensor function is ``zerograph.runtime.collectives.gather_fn``, which the runtime's
eager fallback calls too ([Note: one collective function, traced and run] in ``collectives.py``).

Source: ZeRO (arXiv 1910.02054) section 5.3 (P_p); FSDP2's copy-in / all-gather / copy-out;
SimpleFSDP (arXiv 2411.00284) for recompute-tagged gathers; FSDP2's ``MixedPrecisionPolicy``
(cast before the all-gather, so a bf16 gather moves half the bytes of fp32); ZeRO++ (arXiv
2306.10209) section 3.1 (qwZ).
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
