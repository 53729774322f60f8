"""What every pass receives: plain data about the run, never a tensor or a process group."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import torch.fx as fx

from zerograph.sharding import ParamLayout, Unit

GraphKind = Literal["joint", "forward", "backward", "inference"]


@dataclasses.dataclass(frozen=True)
class PassContext:
    """Inputs of a pass besides the graph.

    Attributes:
        graph_kind: which graph the pass sees (the AOTAutograd joint graph, the partitioned
            forward / backward, or a no-grad inference graph).
        stage: ZeRO stage 0-3.
        world_size: N, ranks in ``group_name``.
        group_name: the process group's registered name, as functional collectives take it.
        layouts: marker key -> where that parameter's elements live.
        units: the sharding units; ``units[0]`` is the root unit.
        bucket_bytes, prefetch_depth, max_inflight_bytes, unshard_budget_bytes,
            reshard_root_after_forward: the schedule and memory knobs of ``Config`` (bytes, units,
            bytes, bytes, bool).
        buffer_pool: the number of the runtime's ``BufferPool`` that ``buffer_reuse`` takes comm
            buffers from (an int in the graph, never the pool itself); ``None``: no pooling.
        activation_budget_bytes: ``Config.activation_budget_bytes`` (bytes of saved activations
            per rank per graph; ``None``: no budget, ``activation_partition`` does nothing).
        activation_offload: ``Config.activation_offload`` (saved activations may go to host memory).
        activation_group: ``(group_name, size)`` of ``Config.activation_group``, the group over
            which activations are replicated (P_a may partition them across it); ``None``: none.
        activation_cost_model: ``Config.activation_cost_model`` (plain data; ``None``: nominal rates).
    """

    graph_kind: GraphKind
    stage: int
    world_size: int
    group_name: str
    layouts: Mapping[int, ParamLayout]
    units: tuple[Unit, ...]
    bucket_bytes: int = 0
    prefetch_depth: int = 1
    max_inflight_bytes: int | None = None
    unshard_budget_bytes: int = 0
    reshard_root_after_forward: bool = True
    buffer_pool: int | None = None
    activation_budget_bytes: int | None = None
    activation_offload: bool = False
    activation_group: tuple[str, int] | None = None
    activation_cost_model: Any = None  # zerograph.costmodel.CostModel (not imported: it imports the passes)

    @property
    def communicates(self) -> bool:
        return self.world_size > 1


@dataclasses.dataclass
class PassResult:
    """``torch.fx.passes.infra.pass_base.PassResult`` plus counts for the log."""

    graph_module: fx.GraphModule
    modified: bool
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
