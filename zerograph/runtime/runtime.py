"""Run-time state of one compiled model on this rank: a few parts with one job each.

The runtime never rewrites graphs. It owns what the compiled graphs need at run time, in parts,
each reached by name (``runtime.topology.rank``, ``runtime.grad_buffers.unsynced``):

- ``topology`` (``topology.py``): the process groups the graphs name, their sizes, this rank;
- ``accounting`` (``accounting.py``): what each step communicated, per collective kind and mesh dim;
- ``schedule_check`` (``comm_schedule.py``): before each graph call the ranks compare a digest of
  its communication schedule, and a communication failure inside a graph becomes a
  ``CollectiveError`` naming it, instead of a hang;
- ``eager`` (``eager.py``): the markers' eager fallback (graph breaks, islands), which runs the
  passes' own gather and reduce functions (``collectives.py``);
- ``grad_buffers`` (``grad_buffers.py``): the full gradients held while ``requires_gradient_sync``
  is off, reduced through ``eager`` when sync comes back;
- ``buffer_pool`` (``buffer_pool.py``): the comm buffers ``buffer_reuse`` assigns graphs to;

and, itself, the parameters' layouts (what the markers' fake implementations read), the units,
the shards and the units' flat shards. The parts are built in that order, each from the ones
before it: no part refers back to the runtime.

Source: FSDP2's ``torch/distributed/fsdp/_fully_shard/`` (one object per file, held by name).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..graph import registry
from ..graph.vocab import GRAD_ACCUMULATE, GRAD_FLUSH, GRAD_SYNC
from ..shard.flat import FlatShard
from ..shard.sharding import ParamLayout, Unit
from . import collective_watch
from .accounting import CommCounter, StepAccounting
from .buffer_pool import BufferPool
from .comm_schedule import CommSchedule, ScheduleCheck, ScheduleEntry, is_communication_failure, schedule_of
from .eager import EagerCollectives
from .grad_buffers import GradientBuffers
from .topology import Topology

# re-exported: tests and checkpoint.py import these from here
__all__ = ["CommCounter", "CommSchedule", "Runtime", "ScheduleEntry", "is_communication_failure", "schedule_of"]


class Runtime:
    """Per-compiled-model run-time state on this rank (module docstring: its parts).

    ``timeout_s`` (seconds) bounds the wait of the schedule check; ``device`` holds its tensors
    (CPU for gloo, the rank's GPU for NCCL). ``replicate_group``, ``world_group`` and
    ``secondary_group``: hybrid sharding's and hpZ's groups (``Topology``).
    """

    # slots: a write to a name the runtime does not hold (one its parts hold, such as
    # ``requires_gradient_sync``) raises instead of setting an attribute nothing reads
    __slots__ = ("stage", "device", "units", "layouts", "marker_layouts", "flat_shards", "shards", "topology",
                 "accounting", "schedule_check", "eager", "grad_buffers", "buffer_pool", "watch_collectives",
                 "__weakref__")

    stage: int  # the ZeRO stage, 0-3
    device: torch.device
    units: list[Unit]
    layouts: dict[int, ParamLayout]  # parameter key -> its layout (the model's parameters)
    # every key a marker may carry: the parameters' and the units' flat shards' (``add_flat_shards``)
    marker_layouts: dict[int, ParamLayout]
    flat_shards: dict[int, FlatShard]  # flat shard key -> the unit's FlatShard (flat.py)
    shards: dict[int, torch.Tensor]  # parameter key -> the model's parameter (DTensor shard); set by compile
    topology: Topology
    accounting: StepAccounting
    schedule_check: ScheduleCheck
    eager: EagerCollectives
    grad_buffers: GradientBuffers
    buffer_pool: BufferPool
    watch_collectives: bool  # ZEROGRAPH_DEBUG_COLLECTIVES: buffers checked from issue to wait (collective_watch.py)

    def __init__(self, group: dist.ProcessGroup, stage: int, layouts: list[ParamLayout], units: list[Unit], *,
                 timeout_s: float = 300.0, device: torch.device | str = "cpu",
                 replicate_group: dist.ProcessGroup | None = None, world_group: dist.ProcessGroup | None = None,
                 secondary_group: dist.ProcessGroup | None = None):
        self.stage = stage
        self.device = torch.device(device)
        self.units = units
        self.layouts = {layout.key: layout for layout in layouts}
        self.marker_layouts = dict(self.layouts)
        self.flat_shards = {}
        self.shards = {}
        self.watch_collectives = collective_watch.enabled()
        self.topology = Topology(group, replicate_group=replicate_group, world_group=world_group,
                                 secondary_group=secondary_group)
        self.accounting = StepAccounting()
        self.schedule_check = ScheduleCheck(self.topology, units, timeout_s, self.device)
        self.eager = EagerCollectives(self.marker_layouts, self.topology, self.accounting, self.device,
                                      watch_collectives=self.watch_collectives)
        self.grad_buffers = GradientBuffers(self.marker_layouts, self.topology, self.accounting, self.eager,
                                            self.shards, self.flat_shards)
        self.buffer_pool = BufferPool()
        registry.register(layouts, self)  # what the markers' implementations look their keys up in

    def start_forward(self) -> None:
        """A forward after a finished backward opens a new step (on a live process group)."""
        self.topology.check_group()
        self.accounting.start_forward()

    def run_graph(self, schedule: CommSchedule, compiled: Callable[[list], Any], args: list) -> Any:
        """``ScheduleCheck.run_graph``, then every pooled buffer of the graph is free (dead once it returns).
        Under ``ZEROGRAPH_DEBUG_COLLECTIVES`` its collectives' buffers are checked (``collective_watch``)."""
        try:
            with collective_watch.watching(f"rank {self.topology.rank}, {schedule.label}", self.watch_collectives):
                return self.schedule_check.run_graph(schedule, compiled, args)
        finally:
            self.buffer_pool.release_all()

    def reduce_grad(self, grad: torch.Tensor, key: int, grad_mode: str = GRAD_SYNC) -> torch.Tensor:
        """The eager ``zerograph::reduce_grad`` (a graph break's, an island's): under
        ``"accumulate"`` the gradient is held (``grad_buffers``), else reduced (``eager``; under
        ``"flush"`` with the held one added). ``grad``: full shape -> local shard shape in the
        parameter's dtype (zeros when held). At world size 1 nothing is worth holding: every mode
        hands the gradient straight to the shard."""
        if grad_mode == GRAD_ACCUMULATE and self.topology.dp_size > 1:
            return self.grad_buffers.accumulate(grad, key)
        return self.eager.reduce_grad(grad, key, flush=grad_mode == GRAD_FLUSH)

    def local_shape(self, key: int) -> tuple[int, ...]:
        """This rank's shape of the shard marker key ``key`` names."""
        return self.marker_layouts[key].local_shape(self.topology.rank)

    def add_flat_shards(self, flat_shards: list[FlatShard]) -> None:
        """Make the units' flat shards (``flat.py``) keys the markers may carry."""
        for flat in flat_shards:
            self.marker_layouts[flat.layout.key] = flat.layout
            self.flat_shards[flat.layout.key] = flat
        registry.register([flat.layout for flat in flat_shards], self)
