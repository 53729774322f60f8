"""Replace ``zerograph::reduce_grad`` markers by one gradient reduction per bucket.

Pre: a backward graph holding ``reduce_grad(full_grad, key)`` markers, with ``bucketing``'s bucket
ids (without it, each parameter is a bucket).
Post: no marker is left; every trainable parameter's gradient is reduced exactly once. For each
(bucket, dtype): copy-in (pad each full gradient to ``N * chunk_rows`` rows, lay the rank chunks side
by side; one ``zerograph::pack_shards`` node for a bucket of several parameters) -> ``reduce_scatter_tensor`` (stages
1-3) or ``all_reduce`` (stage 0 and 0-d parameters,
buckets of whole gradients) -> ``wait_tensor`` -> divide by N (ranks' gradients are averaged, as DDP does) ->
copy-out of each shard's rows. Hybrid sharding (``ctx.replicate_group``, a 2-D mesh): the
reduced shard is then all-reduced across the replicate group before the division, which is by
N = shard ranks x replicas (FSDP2's HSDP; DeepSpeed's MiCS). A parameter used several times (tied weights) has several markers;
their gradients are summed first and reduced once.

Mixed precision: each full gradient (in ``param_dtype``) is cast to ``reduce_dtype`` in the copy-in,
before tied gradients are summed, and each reduced shard is cast to the parameter's own dtype in the
copy-out, so ``.grad`` matches the (fp32 master) shard. Without mixed precision no cast is emitted.

Gradient accumulation (the markers' ``grad_mode``, set by ``requires_gradient_sync``):
- ``"sync"``: the reduction above;
- ``"accumulate"``: no collective; each parameter's summed full gradient goes to
  ``zerograph::accumulate_unsynced``, which adds it to the runtime's buffer and returns zeros for
  the shard, right after the bucket's last gradient;
- ``"flush"``: the reduction above, its copy-in first adding the runtime's buffer to each gradient
  (``zerograph::take_unsynced``), so the accumulated sum is reduced once.

Placement (the stage's promise about full gradients):
- stages 0 and 2: right after the bucket's last gradient is produced, so the full gradients die
  there (ZeRO-2 "reduce as produced, free at once"; DDP's bucketed all-reduce);
- stage 1: at the end of backward (P_os keeps full gradients until the step, then reduces);
- stage 3: as stage 2.
At world size 1 the marker becomes its input (cast through ``reduce_dtype`` to the parameter's dtype
under mixed precision), whatever the mode: one rank has nothing to synchronise.

With ``Config.reduce_quantization="int8"`` (ZeRO++'s qgZ, in one hop) a sharded bucket of float
gradients with a shard of at least one block is reduced by ``_quantized_reduce_scatter`` instead:
``zerograph::pack_quantized`` (rank ``r``'s chunk of every gradient as int8 blocks + fp32 scales),
``all_to_all_single`` (counted as the bucket's reduce-scatter), ``zerograph::dequantize_sum`` (the
N chunks of this rank's shard summed in fp32), then ÷N and the copy-out as above.

Source: ZeRO (arXiv 1910.02054) sections 5.1-5.3 and 7 (volume Ψ per reduce-scatter);
PyTorch DDP's gradient buckets and ``no_sync``; FSDP2's reduce-scatter copy-in,
``MixedPrecisionPolicy.reduce_dtype`` and ``set_requires_gradient_sync``; ZeRO++ (arXiv
2306.10209) section 3.3 (qgZ).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from zerograph.kernels.ops import PACK_SHARDS, from_wire, to_wire
from zerograph.kernels.quantize import BLOCK, DEQUANTIZE_SUM, PACK_QUANTIZED, QUANTIZABLE_DTYPES, quantizes, wire_layout
from zerograph.ops import ACCUMULATE_UNSYNCED, REDUCE_GRAD, TAKE_UNSYNCED, grad_mode_of
from zerograph.sharding import ParamLayout
from zerograph.vocab import GRAD_ACCUMULATE, GRAD_FLUSH

from ._fx import bucket_tag, group_markers, layout_template, position, sink_below_inputs, splice
from .context import PassContext, PassResult
from .contract import contract

funcol = torch.ops._c10d_functional


def plan_reductions(graph: fx.Graph, ctx: PassContext) -> list[list[fx.Node]]:
    """Group the markers into collectives, one per (bucket, reduce_dtype, sharded), in graph order
    (rank-agreed); without ``bucketing`` each parameter is its own bucket."""
    return group_markers(graph.find_nodes(op="call_function", target=REDUCE_GRAD), ctx)


def _copy_in(grads: tuple[torch.Tensor, ...], layouts: list[ParamLayout], world_size: int,
             scatter: bool) -> torch.Tensor:
    """The bucket's send buffer in ``reduce_dtype``. Reduce-scatter: ``(N * sum shard_numel,)``,
    each full gradient padded to ``N * chunk_rows`` rows and the rank chunks side by side, so rank
    ``r`` receives its rows of every gradient; all-reduce: the flattened gradients concatenated.

    A bucket of several parameters is one ``zerograph::pack_shards`` node (the Triton pack kernel
    on CUDA, casting on the fly); a single parameter keeps the plain ops (often no copy at all)."""
    dtype = layouts[0].reduce_dtype  # group_markers keeps one reduce_dtype per bucket
    if len(grads) > 1:
        if scatter:
            return PACK_SHARDS(list(grads), [layout.chunk_rows for layout in layouts], world_size, dtype)
        flat = [g.reshape(-1) for g in grads]  # 0-d parameters too: pack cuts rows on dim 0
        return PACK_SHARDS(flat, [layout.numel for layout in layouts], 1, dtype)
    (grad,), (layout,) = grads, layouts
    grad = grad.to(dtype)
    if not scatter:
        return grad.reshape(-1)
    missing = world_size * layout.chunk_rows - grad.shape[0]
    padded = F.pad(grad, [0, 0] * (grad.dim() - 1) + [0, missing]) if missing else grad
    return padded.reshape(-1)  # (N * chunk numel,)


def _quantized_reduce_scatter(grads: tuple[torch.Tensor, ...], layouts: list[ParamLayout], world_size: int,
                              group_name: str) -> torch.Tensor:
    """qgZ in one hop: ``(sum shard_numel,)`` fp32, the sum over ranks of this rank's rows of each
    gradient, as ``reduce_scatter_tensor`` returns them. Copy-in ``zerograph::pack_quantized``
    (chunk ``r`` of every gradient quantized for rank ``r``), one ``all_to_all_single`` of those
    bytes, copy-out ``zerograph::dequantize_sum`` (the N received chunks dequantized, summed in fp32).

    Why an all-to-all and not a quantized ring: a ring reduce-scatter would dequantize, add and
    re-quantize at each of its N - 1 hops (N - 1 quantization errors, and a kernel per hop); the
    all-to-all sends each rank the same (N-1)/N of the buffer in one hop, quantized once. ZeRO++'s
    hierarchical version (intra-node, then inter-node) only changes which links carry it."""
    dtype, chunk_rows = layouts[0].reduce_dtype, [layout.chunk_rows for layout in layouts]
    rank_bytes = wire_layout([layout.shard_numel for layout in layouts], dtype.itemsize).rank_bytes
    send = PACK_QUANTIZED(list(grads), chunk_rows, world_size, dtype, BLOCK)  # (N * rank_bytes,) uint8
    splits = [rank_bytes] * world_size
    received = funcol.wait_tensor(funcol.all_to_all_single(send, splits, splits, group_name))
    return DEQUANTIZE_SUM(received, world_size, chunk_rows, [layout.row_numel for layout in layouts], dtype, BLOCK)


def _quantizes_reduction(layouts: list[ParamLayout], quantization: str | None, scatter: bool) -> bool:
    return (quantization is not None and scatter and all(layout.param_dtype in QUANTIZABLE_DTYPES for layout in layouts)
            and quantizes([layout.shard_numel for layout in layouts], layouts[0].reduce_dtype))


def _reduce_fn(keys: list[int], layouts: list[ParamLayout], local_rows: list[int], world_size: int,
               group_name: str, scatter: bool, flush: bool, replicate_group: tuple[str, int] | None = None,
               quantization: str | None = None):
    quantized = _quantizes_reduction(layouts, quantization, scatter)

    def reduce(*grads: torch.Tensor) -> list[torch.Tensor]:
        if flush:  # add what the unsynced micro-batches accumulated (already in reduce_dtype)
            grads = tuple(TAKE_UNSYNCED(g, k) for g, k in zip(grads, keys))
        if quantized:  # Config.reduce_quantization: fp32 sums of int8 chunks
            out = _quantized_reduce_scatter(grads, layouts, world_size, group_name)
            moved = out.dtype
        else:
            send = _copy_in(grads, layouts, world_size, scatter)
            if scatter:  # complex reduces as its real view (to_wire): the sum of each part
                out = funcol.wait_tensor(funcol.reduce_scatter_tensor(to_wire(send), "sum", world_size, group_name))
            else:
                out = funcol.wait_tensor(funcol.all_reduce(to_wire(send), "sum", group_name))
            moved = send.dtype
        replicas = 1
        if replicate_group is not None:  # hybrid sharding: the reduced shard summed across replicas
            replicate_name, replicas = replicate_group
            out = funcol.wait_tensor(funcol.all_reduce(out, "sum", replicate_name))
        out = from_wire(out, moved) / (world_size * replicas)
        shards, offset = [], 0
        for layout, rows in zip(layouts, local_rows):
            size = layout.shard_numel if scatter else layout.numel
            chunk = out[offset : offset + size]
            chunk = chunk.view(-1, *layout.shape[1:])[:rows] if scatter else chunk.view(layout.shape)
            # own storage (the flat bucket dies here), in the shard's dtype (the master's, for .grad)
            shards.append(chunk.clone() if chunk.dtype == layout.dtype else chunk.to(layout.dtype))
            offset += size
        return shards

    return reduce


def _accumulate_fn(keys: list[int]):
    def accumulate(*grads: torch.Tensor) -> list[torch.Tensor]:
        return [ACCUMULATE_UNSYNCED(g, k) for g, k in zip(grads, keys)]

    return accumulate


def _sum_fn(dtype: torch.dtype):
    """Sum a tied parameter's gradients in ``dtype`` (its reduce dtype: no 16-bit sum of 16-bit parts)."""
    def total(*grads: torch.Tensor) -> torch.Tensor:
        return sum((g.to(dtype) for g in grads[1:]), grads[0].to(dtype))

    return total


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
                          splice(graph, _sum_fn(layout.reduce_dtype), key_grads, before=point,
                                 template=("sum", layout.reduce_dtype)))
        if mode == GRAD_ACCUMULATE:
            shards = splice(graph, _accumulate_fn(keys), summed, before=point,
                            tag=bucket_tag("accumulate", layouts))
            accumulations += 1
        else:
            scatter = layouts[0].sharded  # plan_reductions keeps sharded and replicated apart
            local_rows = [by_key[k][0].meta["val"].shape[0] if scatter else 0 for k in keys]
            flush = mode == GRAD_FLUSH  # the flush's copy-in names the keys: no template shared across buckets
            fn = _reduce_fn(keys, layouts, local_rows, ctx.world_size, ctx.group_name, scatter,
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
            local = splice(graph, _round_through_reduce_dtype(layout), [grad], before=marker)
        marker.replace_all_uses_with(local)
        graph.erase_node(marker)


def _round_through_reduce_dtype(layout: ParamLayout):
    def cast(g: torch.Tensor) -> torch.Tensor:
        return g.to(layout.reduce_dtype).to(layout.dtype)

    return cast
