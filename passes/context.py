"""What every pass receives: plain data about the run, never a tensor or a process group."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import torch.fx as fx

from zerograph.policies import ActivationPolicy, MemoryPolicy, SchedulePolicy
from zerograph.shard.sharding import ParamLayout, Unit

GraphKind = Literal["joint", "partitioned", "forward", "backward", "inference"]


@dataclasses.dataclass(frozen=True)
class PassContext:
    """Inputs of a pass besides the graph: plain data about the run, never a tensor or a process group.

    Attributes:
        graph_kind: which graph the pass sees (the AOTAutograd joint graph; "partitioned": the
            forward / backward pair the partitioner returns, as ``PartitionedGraphs``; the
            partitioned forward / backward, each on its own; or a no-grad inference graph).
        stage: ZeRO stage 0-3.
        world_size: N, ranks in ``group_name``.
        group_name: the process group's registered name, as functional collectives take it.
        layouts: marker key -> where that parameter's elements live.
        units: the sharding units; ``units[0]`` is the root unit.
        schedule: ``Config.schedule`` as given (bucket_bytes, prefetch_depth, max_inflight_bytes).
        memory: ``Config.memory`` as given (unshard_budget_bytes, reshard_root_after_forward).
        activations: ``Config.activations`` with its process group left out (budget_bytes,
            offload, cost_model); the group is ``activation_group``. With a budget, its
            cost_model is always set (``Config`` fills in clusters.json's nominal cluster): the
            hardware rates a pass prices with arrive here, never from a file or a constant.
        activation_group: ``(group_name, size)`` of the group over which activations are
            replicated (P_a may partition them across it); ``None``: none.
        gather_quantization: ``Config.gather_quantization`` (``None`` or ``"int8"``): how
            ``insert_allgather`` encodes parameters on the wire.
        reduce_quantization: ``Config.reduce_quantization``: how ``insert_reduce_scatter``
            reduces gradients (``"int8"``: quantized all-to-all + fp32 sum).
        buffer_pool: the number of the runtime's ``BufferPool`` that ``buffer_reuse`` takes comm
            buffers from (an int in the graph, never the pool itself); ``None``: no pooling.
        replicate_group: hybrid sharding (a 2-D mesh ``(replicate, shard)``): ``(group_name,
            size)`` of the replicate group, across which each reduced gradient shard is
            all-reduced; ``group_name`` / ``world_size`` are then the shard group's. ``None``:
            one group (no mesh, a 1-D one, or a replicate dim of one rank).
        secondary_group: hpZ (``Config.secondary_partition_size``): ``(group_name, M)`` of the
            group of M ranks (this rank's node) over which ``secondary_partition`` keeps each
            re-gathered unit from forward to backward; ``None``: plain stage 3.
    """

    graph_kind: GraphKind
    stage: int
    world_size: int
    group_name: str
    layouts: Mapping[int, ParamLayout]
    units: tuple[Unit, ...]
    schedule: SchedulePolicy = SchedulePolicy()
    memory: MemoryPolicy = MemoryPolicy()
    activations: ActivationPolicy = ActivationPolicy()
    activation_group: tuple[str, int] | None = None
    buffer_pool: int | None = None
    replicate_group: tuple[str, int] | None = None
    gather_quantization: str | None = None
    reduce_quantization: str | None = None
    secondary_group: tuple[str, int] | None = None

    @property
    def communicates(self) -> bool:
        return self.world_size > 1


@dataclasses.dataclass
class PassResult:
    """``torch.fx.passes.infra.pass_base.PassResult`` plus counts for the log; a pass of the
    "partitioned" pipeline returns its ``PartitionedGraphs`` as ``graph_module``."""

    graph_module: fx.GraphModule | PartitionedGraphs
    modified: bool
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PartitionedGraphs:
    """The forward / backward pair AOTAutograd's partitioner returns: what a pass of the
    "partitioned" pipeline receives and returns (as ``PassResult.graph_module``).

    AOTAutograd's convention binds the two graphs: the forward returns its ``num_fwd_outputs``
    outputs, then the saved tensors, then saved opaque objects and symbols; the backward takes the
    saved symbols, the saved tensors in the same order, then the tangents. A pass that hands a value
    over from one graph to the other changes both sides alike (``passes._fx.save_for_backward``).
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int
    meta: dict = dataclasses.field(default_factory=dict)  # as ``GraphModule.meta``: the manager's record


def graph_modules(graphs: fx.GraphModule | PartitionedGraphs) -> tuple[fx.GraphModule, ...]:
    """The graph modules a pass's input holds: one, or the partitioned pair (forward first)."""
    return (graphs.forward, graphs.backward) if isinstance(graphs, PartitionedGraphs) else (graphs,)
