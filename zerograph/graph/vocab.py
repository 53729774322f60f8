"""The words every layer shares: the functional collectives the passes insert, the tag they leave
on graph nodes, and the gradient modes of the markers.

This is the bottom layer's FX vocabulary: the passes write these ops and tags, the runtime, the cost
model and the reporting modules read them, and none of them needs to import another for it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

# node.meta[TAG] = {"role": ..., "unit": ..., "units": ...} on every node a pass inserts
TAG = "zerograph"

# True in the dict of a class zerograph makes for one module instance (sharding's subclass with
# parameter properties, a template trace's recording subclass): ``sharding.original_class`` skips them
GENERATED_CLASS = "_zerograph_generated"

# The functional collectives the passes insert (torch.distributed._functional_collectives), by kind.
COLLECTIVE_KINDS = {
    torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
    torch.ops._c10d_functional.all_gather_into_tensor_out.default: "all_gather",  # buffer_reuse's
    torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
    torch.ops._c10d_functional.all_reduce.default: "all_reduce",
    # Config.reduce_quantization's reduce-scatter: an all-to-all of quantized chunks, summed by the
    # receiver (its input is the full buffer, as a reduce-scatter's)
    torch.ops._c10d_functional.all_to_all_single.default: "reduce_scatter",
}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")

# The mesh dims a collective runs over (hybrid sharding, FSDP2's 2-D mesh ``(replicate, shard)``):
# gathers and reduce-scatters within the shard group, the gradient all-reduce across replicas. A
# 1-D group (no mesh, or a 1-D one) is the shard dim, whatever the stage.
SHARD_DIM = "shard"
REPLICATE_DIM = "replicate"
MESH_DIMS = (REPLICATE_DIM, SHARD_DIM)
SECONDARY_DIM = "secondary"  # hpZ's node group, inside the shard dim (counted apart)


def group_name_of(collective: fx.Node) -> str | None:
    """The process-group name a functional collective node runs over (its last argument)."""
    if "group_name" in collective.kwargs:
        return collective.kwargs["group_name"]
    return collective.args[-1] if collective.args and isinstance(collective.args[-1], str) else None
WAIT = torch.ops._c10d_functional.wait_tensor.default


def full_buffer(collective: fx.Node) -> torch.Tensor:
    """The fake value of the full (unsharded) buffer a collective node moves: the output of an
    all-gather, the input of a reduce-scatter or all-reduce (the ZeRO paper's volume, section 7)."""
    if COLLECTIVE_KINDS[collective.target] == "all_gather":
        return collective.meta["val"]
    return collective.args[0].meta["val"]


# What the backward of the running forward does with each full gradient (the markers' grad_mode):
GRAD_SYNC = "sync"              # reduce it into this rank's shard of .grad (the default)
GRAD_ACCUMULATE = "accumulate"  # requires_gradient_sync off: add it to the runtime's full-size buffer
GRAD_FLUSH = "flush"            # sync after unsynced micro-batches: add the buffer, then reduce once
GRAD_MODES = (GRAD_SYNC, GRAD_ACCUMULATE, GRAD_FLUSH)

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
