"""Run-time state of one compiled model on this rank: a few parts with one job each.

The runtime never rewrites graphs. It owns what the compiled graphs need at run time, in parts:

- ``topology`` (``topology.py``): the process groups the graphs name, their sizes, this rank;
- ``accounting`` (``accounting.py``): what each step communicated, per collective kind and mesh dim;
- ``schedule_check`` (``comm_schedule.py``): before each graph call the ranks compare a digest of
  its communication schedule, and a communication failure inside a graph becomes a
  ``CollectiveError`` naming it, instead of a hang;
- ``gradients`` (``grad_buffers.py``): the full gradients held while ``requires_gradient_sync`` is off;
- ``eager`` (``eager.py``): the markers' eager fallback (graph breaks, islands), which runs the
  passes' own gather and reduce functions (``collectives.py``);
- ``buffer_pool`` (``buffer_pool.py``): the comm buffers ``buffer_reuse`` assigns graphs to;

and, itself, the parameters' layouts (what the markers' fake implementations read), the units,
the shards and the units' flat shards. The names many modules read (``world_size``, ``rank``,
``mesh_rank``, ``requires_gradient_sync``...) stay readable on the runtime itself.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..graph import registry
from ..graph.vocab import GRAD_SYNC
from ..shard.flat import FlatShard, accumulate_grad
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


def _part(part: str, name: str, settable: bool = False) -> property:
    """A read-through (``settable``: and write-through) property for ``self.<part>.<name>``."""
    def get(self: Runtime) -> Any:
        return getattr(getattr(self, part), name)

    def put(self: Runtime, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put if settable else None, doc=f"``{part}.{name}``")


class Runtime:
    """Per-compiled-model run-time state on this rank (module docstring: its parts).

    ``timeout_s`` (seconds) bounds the wait of the schedule check; ``device`` holds its tensors
    (CPU for gloo, the rank's GPU for NCCL). ``replicate_group``, ``world_group`` and
    ``secondary_group``: hybrid sharding's and hpZ's groups (``Topology``).
    """

    def __init__(self, group: dist.ProcessGroup, stage: int, layouts: list[ParamLayout], units: list[Unit], *,
                 timeout_s: float = 300.0, device: torch.device | str = "cpu",
                 replicate_group: dist.ProcessGroup | None = None, world_group: dist.ProcessGroup | None = None,
                 secondary_group: dist.ProcessGroup | None = None):
        self.stage = stage
        self.device = torch.device(device)
        self.units = units
        self.layouts = {layout.key: layout for layout in layouts}  # the model's parameters
        # every key a marker may carry: the parameters' and the units' flat shards' (``add_flat_shards``)
        self.marker_layouts: dict[int, ParamLayout] = dict(self.layouts)
        self.flat_shards: dict[int, FlatShard] = {}  # flat shard key -> the unit's FlatShard (flat.py)
        self.shards: dict[int, torch.Tensor] = {}  # key -> the model's parameter (DTensor shard); set by compile
        self.topology = Topology(group, replicate_group=replicate_group, world_group=world_group,
                                 secondary_group=secondary_group)
        self.accounting = StepAccounting()
        self.schedule_check = ScheduleCheck(self.topology, units, timeout_s, self.device)
        self.gradients = GradientBuffers(self.marker_layouts, self.topology, self.accounting, self._reduce_leftover,
                                         lambda grad, key: self.eager.reduce_grad(grad, key, GRAD_SYNC),
                                         self.shards, self.flat_shards)
        self.eager = EagerCollectives(self.marker_layouts, self.topology, self.accounting, self.gradients,
                                      self.device)
        self.buffer_pool = BufferPool()  # the comm buffers ``buffer_reuse`` assigns graphs to
        # ZEROGRAPH_DEBUG_COLLECTIVES: each collective's buffers checked from issue to wait (collective_watch.py)
        self.watch_collectives = collective_watch.enabled()
        self.eager.watch_collectives = self.watch_collectives
        registry.register(layouts, self)  # what the markers' implementations look their keys up in

    # read through: many modules (dump, init, loading, checkpoint, stats, bench) and tests use these
    group = _part("topology", "group")
    group_name = _part("topology", "group_name")
    world_size = _part("topology", "world_size")
    rank = _part("topology", "rank")
    dp_size = _part("topology", "dp_size")
    world_group = _part("topology", "world_group")
    mesh_rank = _part("topology", "mesh_rank")
    replicate_group = _part("topology", "replicate_group")
    replicate_group_name = _part("topology", "replicate_group_name")
    replicate_size = _part("topology", "replicate_size")
    secondary_group = _part("topology", "secondary_group")
    secondary_group_name = _part("topology", "secondary_group_name")
    secondary_size = _part("topology", "secondary_size")
    fake_world = _part("topology", "fake_world")
    comm_dim = _part("topology", "comm_dim")
    check_group = _part("topology", "check_group")
    graph_memory = _part("accounting", "graph_memory")
    finished_step = _part("accounting", "finished_step")
    schedule = _part("schedule_check", "schedule")
    check_schedule = _part("schedule_check", "check_schedule")
    requires_gradient_sync = _part("gradients", "requires_gradient_sync", settable=True)
    grad_mode = _part("gradients", "grad_mode")
    unsynced_bytes = _part("gradients", "unsynced_bytes")
    flush_leftovers_after_backward = _part("gradients", "flush_leftovers_after_backward")
    prepare_backward = _part("gradients", "prepare_backward")

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

    def local_shape(self, key: int) -> tuple[int, ...]:
        """This rank's shape of the shard marker key ``key`` names."""
        return self.marker_layouts[key].local_shape(self.topology.rank)

    def add_flat_shards(self, flat_shards: list[FlatShard]) -> None:
        """Make the units' flat shards (``flat.py``) keys the markers may carry."""
        for flat in flat_shards:
            self.marker_layouts[flat.layout.key] = flat.layout
            self.flat_shards[flat.layout.key] = flat
        registry.register([flat.layout for flat in flat_shards], self)

    def _reduce_leftover(self, grad: torch.Tensor, key: int) -> None:
        """Reduce one gradient held while unsynced into its shard's ``.grad`` (``GradientBuffers``)."""
        local = self.eager.reduce_grad(grad, key, GRAD_SYNC)  # (local rows, *rest)
        if key in self.flat_shards:
            self.flat_shards[key].add_grad(local)
            return
        accumulate_grad(self.shards[key], local)
