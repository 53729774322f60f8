"""One rank of a large world in one process: PyTorch's ``fake`` process group.

``with zerograph.fake_world(64): ...`` initialises the default process group with the ``fake``
backend as rank ``rank`` of ``world_size``, with no peers. Inside it, ``zerograph.compile`` shards
the model as that rank of N (each shard ``ceil(rows/N)`` rows), the passes build the same graphs
they build on a real world, and a training step runs its real compute on real tensors of the real
sizes, so memory and compute time are this rank's. Collectives move no data: an all-gather leaves
the other ranks' rows as they were (uninitialised), a reduce-scatter does not sum. Losses,
gradients and parameters are numerically meaningless; ``zerograph.stats`` marks its results
(``Stats.fake_world``), and ``zerograph.checkpoint.save`` refuses to persist them.

Layer: base (imports only ``torch.distributed`` and ``zerograph.errors``), so the runtime, the
reporting and the checkpoint can ask ``is_fake_world(group)``.

Source: ``torch.testing._internal.distributed.fake_pg`` (``FakeStore``; the backend is
``torch.distributed.Backend.FAKE``), as torchtitan's memory estimation uses it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from ..errors import ConfigError, ProcessGroupError

FAKE_BACKEND = "fake"


class FakeWorldError(ProcessGroupError):
    """An action that needs real peers (persisting values, for one) was asked of a fake world."""


def is_fake_world(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the default process group) uses the ``fake`` backend.

    False when no process group is initialised.
    """
    if not dist.is_initialized():
        return False
    try:
        return dist.get_backend(group) == FAKE_BACKEND
    except (RuntimeError, ValueError):  # a group this process is not part of, or a destroyed one
        return False


def refuse_in_fake_world(what: str, group: dist.ProcessGroup | None = None) -> None:
    """Raise ``FakeWorldError`` naming ``what`` when ``group`` is a fake world.

    For actions whose result would be wrong in a way nothing downstream can see, e.g. writing the
    meaningless parameters of a fake world into a checkpoint.
    """
    if is_fake_world(group):
        raise FakeWorldError(
            f"{what} refused in a fake world (zerograph.fake_world, world size {dist.get_world_size(group)}): "
            "its collectives move no data, so the model's values are meaningless; run on a real process group")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Run this process as rank ``rank`` of a world of ``world_size`` ranks with no peers.

    Initialises the default process group with PyTorch's ``fake`` backend (collectives return at
    once and move no data) and destroys it on exit; yields the group. Compile and step models
    inside: shards, graphs, memory and compute are those of that rank of the real world; every
    value that went through a collective is meaningless (see the module docstring). Models
    compiled inside must not be used after the block.

    Raises:
        ConfigError: ``world_size`` < 1 or ``rank`` outside ``[0, world_size)``.
        ProcessGroupError: a default process group is already initialised (destroy it first with
            ``torch.distributed.destroy_process_group()``; a fake world cannot share a process
            with a real one).

    Source: ``torch.distributed.init_process_group("fake", store=FakeStore(), ...)``
    (``torch.testing._internal.distributed.fake_pg``).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"fake_world: world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"fake_world: rank must be an int in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise ProcessGroupError(
            f"fake_world: a default process group is already initialised (backend {dist.get_backend()}, "
            f"world size {dist.get_world_size()}); destroy it first (torch.distributed.destroy_process_group())")
    # importing this module registers the "fake" backend with c10d (a function-level import: it
    # lives in torch.testing, which a process that never fakes a world has no reason to load)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
