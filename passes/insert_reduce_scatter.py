"""Replace ``zerograph::reduce_grad`` markers by one gradient reduction per bucket.

Pre: a backward graph holding ``reduce_grad(full_grad, key)`` markers, with ``bucketing``'s bucket
ids (without it, each parameter is a bucket).
Post: no marker is left; every trainable parameter's gradient is reduced exactly once. For each
(bucket, dtype): copy-in (pad each full gradient to ``N * chunk_rows`` rows, lay the rank chunks side
by side) -> ``reduce_scatter_tensor`` (stages 1-3) or ``all_reduce`` (stage 0 and 0-d parameters,
buckets of whole gradients) -> ``wait_tensor`` -> divide by N (ranks' gradients are averaged, as DDP does) ->
copy-out of each shard's rows. A parameter used several times (tied weights) has several markers;
their gradients are summed first and reduced once.

Placement (the stage's promise about full gradients):
- stages 0 and 2: right after the bucket's last gradient is produced, so the full gradients die
  there (ZeRO-2 "reduce as produced, free at once"; DDP's bucketed all-reduce);
- stage 1: at the end of backward (P_os keeps full gradients until the step, then reduces);
- stage 3: as stage 2.
At world size 1 the marker becomes its input.

Source: ZeRO (arXiv 1910.02054) sections 5.1-5.3 and 7 (volume Ψ per reduce-scatter);
PyTorch DDP's gradient buckets; FSDP2's reduce-scatter copy-in.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from zerograph.ops import REDUCE_GRAD
from zerograph.sharding import ParamLayout

from ._fx import bucket_tag, group_markers, position, sink_below_inputs, splice
from .context import PassContext, PassResult

funcol = torch.ops._c10d_functional


def plan_reductions(graph: fx.Graph, ctx: PassContext) -> list[list[fx.Node]]:
    """Group the markers into collectives, one per (bucket, dtype, sharded), in graph order
    (rank-agreed); without ``bucketing`` each parameter is its own bucket."""
    return group_markers(graph.find_nodes(op="call_function", target=REDUCE_GRAD), ctx)


def _reduce_fn(layouts: list[ParamLayout], local_rows: list[int], world_size: int, group_name: str, scatter: bool):
    def reduce(*grads: torch.Tensor) -> list[torch.Tensor]:
        if scatter:
            blocks = []
            for grad, layout in zip(grads, layouts):
                missing = world_size * layout.chunk_rows - grad.shape[0]
                padded = F.pad(grad, [0, 0] * (grad.dim() - 1) + [0, missing]) if missing else grad
                blocks.append(padded.reshape(world_size, layout.shard_numel))  # (N, chunk numel)
            send = torch.cat(blocks, dim=1).reshape(-1) if len(blocks) > 1 else blocks[0].reshape(-1)
            out = funcol.wait_tensor(funcol.reduce_scatter_tensor(send, "sum", world_size, group_name))
        else:
            send = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
            out = funcol.wait_tensor(funcol.all_reduce(send, "sum", group_name))
        out = out / world_size
        shards, offset = [], 0
        for layout, rows in zip(layouts, local_rows):
            size = layout.shard_numel if scatter else layout.numel
            chunk = out[offset : offset + size]
            chunk = chunk.view(-1, *layout.shape[1:])[:rows] if scatter else chunk.view(layout.shape)
            shards.append(chunk.clone())  # own storage: the flat bucket dies here
            offset += size
        return shards

    return reduce


def insert_reduce_scatter(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    plan = plan_reductions(graph, ctx)
    if not plan:
        return PassResult(gm, False)
    output = graph.find_nodes(op="output")[0]
    reductions = 0
    for markers in plan:
        if not ctx.communicates:
            for marker in markers:
                marker.replace_all_uses_with(marker.args[0])
                graph.erase_node(marker)
            continue
        order = position(graph)
        by_key: dict[int, list[fx.Node]] = {}
        for marker in markers:
            by_key.setdefault(marker.args[1], []).append(marker)
        keys = list(by_key)
        layouts = [ctx.layouts[k] for k in keys]
        grads = [marker.args[0] for marker in markers]
        last_grad = max(grads, key=order.__getitem__)
        point = output if ctx.stage == 1 else last_grad.next
        summed = []
        for key in keys:  # tied parameters: one gradient per parameter, summed before the reduction
            key_grads = [m.args[0] for m in by_key[key]]
            summed.append(key_grads[0] if len(key_grads) == 1 else
                          splice(graph, lambda *gs: sum(gs[1:], gs[0]), key_grads, before=point))
        scatter = layouts[0].sharded  # plan_reductions keeps sharded and replicated apart
        local_rows = [by_key[k][0].meta["val"].shape[0] if scatter else 0 for k in keys]
        shards = splice(graph, _reduce_fn(layouts, local_rows, ctx.world_size, ctx.group_name, scatter),
                        summed, before=point, tag=bucket_tag("reduce", layouts))
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
        reductions += 1
    sink_below_inputs(graph)  # uses of an early marker move below the unit's reduction
    graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(gm, True, {"reduce_scatter" if ctx.stage else "all_reduce": reductions})
