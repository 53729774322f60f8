"""This rank's process groups and its place in them: the runtime's topology.

A model compiled over one process group has one group; hybrid sharding (a 2-D mesh, ``hybrid.py``)
adds the replicate group and the mesh's world; hpZ (``Config.secondary_partition_size``) adds the
node group of this rank. ``Topology`` holds them, their sizes and registered names (what the
graphs' functional collectives name), this rank's rank in them, and answers which mesh dim a
collective over a named group runs on. It decides nothing and moves no data.

Layer: execution (it holds process groups; passes never do).

Source: FSDP2's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` (shard and replicate groups of a mesh).
"""
from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..errors import CollectiveError, ProcessGroupError
from ..graph.vocab import REPLICATE_DIM, SECONDARY_DIM, SHARD_DIM
from .fake import is_fake_world

# [Note: a failed collective leaves the group out of step]
# gloo and NCCL pair a rank's collectives with its peers' by their order on the group, not by what
# they are. When one of this rank's collectives fails (a timeout, a peer gone) while a peer's went
# through, the two ranks' counts differ from then on, and the next collective of each would pair
# with a different one of the other: gloo then reads and writes the buffers of another collective
# (a crash in the allocator much later, or wrong values), NCCL hangs or reduces the wrong data. So a
# group on which a collective of this rank failed runs no further zerograph collective: each
# raises ``CollectiveError`` at once, until a new group is made. Keyed by the group object: a group
# created after ``destroy_process_group`` reuses the old one's name.
_OUT_OF_STEP: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()


class Topology:
    """The groups one compiled model communicates over, seen from this rank.

    Attributes:
        group, group_name, world_size, rank: the shard group (the model's process group, or a
            2-D mesh's shard dim): the layouts' ``N`` and this rank's rows follow it.
        replicate_group, replicate_group_name, replicate_size: hybrid sharding: the ranks holding
            the same shards, across which reduced gradient shards are all-reduced; ``None`` / 1
            without a mesh or with a replicate dim of one rank (it reduces nothing).
        secondary_group, secondary_group_name, secondary_size: hpZ: this rank's node, over which
            backward re-gathers from the secondary partition; ``None`` / 1 without hpZ.
        world_group, mesh_rank: every rank of the mesh (the schedule check and checkpoints run
            over it) and this rank in it (the dump's ``rank<r>`` folders: under hybrid sharding
            ``rank`` is the shard group's, which two replicas share).
        dp_size: N, the ranks whose gradients are averaged (``world_size * replicate_size``).
        fake_world: ``zerograph.fake_world``: no peers, collectives move no data.
    """

    def __init__(self, group: dist.ProcessGroup, *, replicate_group: dist.ProcessGroup | None = None,
                 world_group: dist.ProcessGroup | None = None, secondary_group: dist.ProcessGroup | None = None):
        self.group = group
        self.group_name = group.group_name
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.world_group = world_group or group
        if replicate_group is not None and dist.get_world_size(replicate_group) == 1:
            replicate_group = None  # a replicate dim of one rank: no collective, no accounting
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.replicate_group_name = None if replicate_group is None else replicate_group.group_name
        self.secondary_group = secondary_group
        self.secondary_size = 1 if secondary_group is None else dist.get_world_size(secondary_group)
        self.secondary_group_name = None if secondary_group is None else secondary_group.group_name
        self.dp_size = self.world_size * self.replicate_size
        self.mesh_rank = dist.get_rank(self.world_group)
        self.fake_world = is_fake_world(group)
        self._group_sizes: dict[str, int] = {}  # other groups a graph's collectives name (P_a's)

    @property
    def replicate_spec(self) -> tuple[str, int] | None:
        """``(name, size)`` of the replicate group, as ``PassContext.replicate_group`` and
        ``collectives.reduce_fn`` take it; ``None`` without one."""
        return None if self.replicate_group is None else (self.replicate_group_name, self.replicate_size)

    @property
    def secondary_spec(self) -> tuple[str, int] | None:
        """``(name, size)`` of hpZ's node group, as ``PassContext.secondary_group`` takes it;
        ``None`` without hpZ."""
        return None if self.secondary_group is None else (self.secondary_group_name, self.secondary_size)

    def comm_dim(self, group_name: str | None) -> tuple[str, int]:
        """``(mesh dim, group size)`` of the group a collective names: the replicate dim for the
        replicate group, hpZ's secondary dim for the node group, else the shard dim (the model's
        group, a 1-D mesh's only dim, or another group such as P_a's, sized on first sight)."""
        if group_name is not None and group_name == self.replicate_group_name:
            return REPLICATE_DIM, self.replicate_size
        if group_name is not None and group_name == self.secondary_group_name:
            return SECONDARY_DIM, self.secondary_size
        if group_name is not None and group_name != self.group_name:  # P_a's activation group
            if group_name not in self._group_sizes:
                self._group_sizes[group_name] = dist.get_world_size(_resolve_process_group(group_name))
            return SHARD_DIM, self._group_sizes[group_name]
        return SHARD_DIM, self.world_size

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group this model communicates over (shard, world, replicate, secondary)."""
        found = [self.group, self.world_group, self.replicate_group, self.secondary_group]
        return [g for i, g in enumerate(found) if g is not None and all(g is not h for h in found[:i])]

    def mark_out_of_step(self, what: str) -> None:
        """A collective of this rank failed (``what`` says which, and why): from now on its groups
        run no zerograph collective (see the Note above ``Topology``)."""
        for group in self.groups():
            _OUT_OF_STEP.setdefault(group, what)

    def check_in_step(self) -> None:
        """Raise ``CollectiveError`` when a collective of this rank failed earlier on one of the
        model's groups (``mark_out_of_step``): its next collective could pair with a different one
        of a peer. Skipped in a fake world (no peers)."""
        if self.fake_world or not _OUT_OF_STEP:
            return
        for group in self.groups():
            failed = _OUT_OF_STEP.get(group)
            if failed is not None:
                raise CollectiveError(
                    f"rank {self.mesh_rank}: a collective on process group {group.group_name!r} failed on this "
                    f"rank earlier ({failed}). Since then this rank's collectives may pair with different ones "
                    "of its peers (gloo and NCCL match collectives by their order on a group, not by what they "
                    "are), so zerograph runs none on it: destroy the process group, create a new one "
                    "(torch.distributed.destroy_process_group, init_process_group) and compile the model again")

    def check_group(self) -> None:
        """Raise ``ProcessGroupError`` when the model's process group was destroyed (e.g. by
        ``dist.destroy_process_group()``): its graphs name the group and could no longer resolve it.
        One dictionary lookup (``dist.get_rank``, which refuses an unregistered group)."""
        try:
            dist.get_rank(self.group)
        except (ValueError, RuntimeError) as exc:
            raise ProcessGroupError(
                f"the model's process group ({self.group_name!r}) was destroyed (destroy_process_group?) or "
                "never initialised here; a compiled model is bound to the group it was compiled with: compile "
                f"a fresh model after initialising a new group. Cause: {type(exc).__name__}: {exc}") from exc
