"""Replace ``zerograph::reduce_grad`` markers by one gradient reduction per bucket.

Pre: a backward graph holding ``reduce_grad(full_grad, key)`` markers, with ``bucketing``'s bucket
ids (without it, each parameter is a bucket).
Post: no marker is left; every trainable parameter's gradient is reduced exactly once (a tied
weight's several markers are summed first). Per (bucket, dtype): copy-in (cast to ``reduce_dtype``;
``zerograph::pack_shards`` for several parameters: [Note: the copy-in layout] in
``zerograph/kernels/ops.py``) -> ``reduce_scatter_tensor`` (stages 1-3) or ``all_reduce`` (stage 0
and 0-d parameters) -> ``wait_tensor`` -> with ``ctx.replicate_group``, an all-reduce across
replicas -> divide by N (shard ranks x replicas) -> copy-out of each shard's rows, cast to the
parameter's dtype. Without mixed precision no cast is emitted. At world size 1 the marker becomes
its input (cast through ``reduce_dtype``), whatever the mode.
Modes (the markers' ``grad_mode``): ``"sync"``, the reduction above; ``"accumulate"``, no
collective: ``zerograph::accumulate_unsynced`` adds the summed full gradient to the runtime's
buffer and returns a zero shard; ``"flush"``, the reduction with that buffer added in the copy-in
(``zerograph::take_unsynced``). Placement: stage 1 at the end of backward; stages 0, 2 and 3
right after the bucket's last gradient is produced. qgZ (``Config.reduce_quantization="int8"``):
``pack_quantized`` -> ``all_to_all_single`` -> ``dequantize_sum`` (``zerograph.kernels.quantize``).
Why each placement, cast and step: docs/design.md, section "Gathers and reductions".

The spliced tensor functions are ``zerograph.runtime.collectives.reduce_fn`` and its helpers
([Note: one collective function, traced and run] in ``collectives.py``).

Source: ZeRO (arXiv 1910.02054) sections 5.1-5.3 and 7; DDP's gradient buckets and ``no_sync``;
FSDP2's reduce-scatter copy-in, ``MixedPrecisionPolicy.reduce_dtype``, ``set_requires_gradient_sync``
and HSDP; ZeRO++ (arXiv 2306.10209) section 3.3 (qgZ).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from zerograph.graph.ops import REDUCE_GRAD, grad_mode_of
from zerograph.graph.vocab import GRAD_ACCUMULATE, GRAD_FLUSH
from zerograph.runtime.collectives import accumulate_fn, reduce_fn, round_through_reduce_dtype, sum_fn

from ._fx import bucket_tag, group_markers, layout_template, position, sink_below_inputs, splice
from .context import PassContext, PassResult
from .contract import contract


def plan_reductions(graph: fx.Graph, ctx: PassContext) -> list[list[fx.Node]]:
    """Group the markers into collectives, one per (bucket, reduce_dtype, sharded), in graph order
    (rank-agreed); without ``bucketing`` each parameter is its own bucket."""
    return group_markers(graph.find_nodes(op="call_function", target=REDUCE_GRAD), ctx)


@contract(requires=("markers",), provides=("reductions",))
def insert_reduce_scatter(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    plan = plan_reductions(graph, ctx)
    if not plan:
        return PassResult(gm, False)
    output = graph.find_nodes(op="output")[0]
    reductions = accumulations = 0
    order = position(graph)  # splices insert new nodes only: the old ones keep their relative order
    for markers in plan:
        if not ctx.communicates:
            _replace_by_local_copies(graph, markers, ctx)
            continue
        modes = {grad_mode_of(m) for m in markers}
        assert len(modes) == 1, f"one forward traces one grad_mode, found {modes}"
        mode = modes.pop()
        by_key: dict[int, list[fx.Node]] = {}
        for marker in markers:
            by_key.setdefault(marker.args[1], []).append(marker)
        keys = list(by_key)
        layouts = [ctx.layouts[k] for k in keys]
        grads = [marker.args[0] for marker in markers]
        last_grad = max(grads, key=order.__getitem__)
        # what accumulates is copied out at once; otherwise the stage decides (module docstring)
        point = output if ctx.stage == 1 and mode != GRAD_ACCUMULATE else last_grad.next
        summed = []
        for key, layout in zip(keys, layouts):  # tied parameters: one gradient per parameter, summed first
            key_grads = [m.args[0] for m in by_key[key]]
            summed.append(key_grads[0] if len(key_grads) == 1 else
                          splice(graph, sum_fn(layout.reduce_dtype), key_grads, before=point,
                                 template=("sum", layout.reduce_dtype)))
        if mode == GRAD_ACCUMULATE:
            shards = splice(graph, accumulate_fn(keys), summed, before=point,
                            tag=bucket_tag("accumulate", layouts))
            accumulations += 1
        else:
            scatter = layouts[0].sharded  # plan_reductions keeps sharded and replicated apart
            local_rows = [by_key[k][0].meta["val"].shape[0] if scatter else 0 for k in keys]
            flush = mode == GRAD_FLUSH  # the flush's copy-in names the keys: no template shared across buckets
            fn = reduce_fn(keys, layouts, local_rows, ctx.world_size, ctx.group_name, scatter,
                            flush=flush, replicate_group=ctx.replicate_group,
                            quantization=ctx.reduce_quantization)
            template = None if flush else ("reduce", layout_template(layouts), tuple(local_rows), ctx.world_size,
                                           ctx.group_name, scatter, ctx.replicate_group, ctx.reduce_quantization)
            shards = splice(graph, fn, summed, before=point, tag=bucket_tag("reduce", layouts), template=template)
            reductions += 1
        for key, shard in zip(keys, shards):
            first, *others = by_key[key]
            first.replace_all_uses_with(shard)
            for other in others:  # its share is already in `shard`; autograd adds these zeros
                with graph.inserting_before(point):
                    zero = graph.call_function(torch.ops.aten.zeros_like.default, (shard,))
                zero.meta["val"] = shard.meta["val"]
                other.replace_all_uses_with(zero)
        for marker in markers:
            graph.erase_node(marker)
    sink_below_inputs(graph)  # uses of an early marker move below the unit's reduction
    graph.eliminate_dead_code()
    gm.recompile()
    counts = {"reduce_scatter" if ctx.stage else "all_reduce": reductions}
    if accumulations:
        counts["accumulate_unsynced"] = accumulations
    return PassResult(gm, True, counts)


def _replace_by_local_copies(graph: fx.Graph, markers: list[fx.Node], ctx: PassContext) -> None:
    """World size 1: each marker becomes its gradient, cast through ``reduce_dtype`` to the
    parameter's dtype when those differ (as the reduction would round it)."""
    for marker in markers:
        grad, layout = marker.args[0], ctx.layouts[marker.args[1]]
        if grad.meta["val"].dtype == layout.reduce_dtype == layout.dtype:
            local = grad
        else:
            local = splice(graph, round_through_reduce_dtype(layout), [grad], before=marker)
        marker.replace_all_uses_with(local)
        graph.erase_node(marker)

