"""Hybrid sharding over a 2-D ``DeviceMesh``: which groups shard and which replicate.

``zerograph.compile(model, stage, mesh=mesh)`` with a 2-D mesh of dims ``(replicate, shard)``
(FSDP2's HSDP, DeepSpeed's MiCS): the model is sharded over the shard dim exactly as over a 1-D
process group of that size, and the ranks at the same shard coordinate (one per replica) hold the
same shards. Gathers and reduce-scatters stay inside the shard group; each reduced gradient shard
is all-reduced across the replicate group (``collectives.reduce_fn``, in graphs and eagerly), so gradients are
averaged over all N = R x S ranks. This module only checks the mesh and names the two groups; the
runtime and the passes do the rest.

Layer: api (it reads process groups; passes never do).

Source: ``torch.distributed.fsdp.fully_shard(mesh=...)`` (a 2-D mesh means HSDP, dim 0 replicate,
dim 1 shard); torchtitan names the dims ``("dp_replicate", "dp_shard")``.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ConfigError, ProcessGroupError

# accepted names of (dim 0, dim 1): FSDP2's documented meaning and torchtitan's names
REPLICATE_NAMES = ("replicate", "dp_replicate")
SHARD_NAMES = ("shard", "dp_shard")


def hybrid_groups(mesh: DeviceMesh, device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(shard group, replicate group)`` of this rank in the 2-D ``mesh``, after checking it (the
    stage it may serve is ``config.check_stage_options``'s: stages 1-3).

    Raises:
        ConfigError: ``mesh`` is not 2-D; its dims are named, but not ``(replicate, shard)`` in
            that order (see ``REPLICATE_NAMES`` / ``SHARD_NAMES``); its device type is not the
            model's; its shard dim has one rank while
            the replicate dim has more (nothing is sharded: that is stage 0 over the world).
        ProcessGroupError: the mesh does not span the default process group (its size is not
            the world size), or this rank is not in it.
    """
    if mesh.ndim != 2:
        raise ConfigError(f"mesh must be 1-D (sharding) or 2-D (replicate, shard) for hybrid sharding; got a "
                          f"{mesh.ndim}-D mesh {mesh}")
    names = mesh.mesh_dim_names
    if names is not None and (names[0] not in REPLICATE_NAMES or names[1] not in SHARD_NAMES):
        raise ConfigError(f"a 2-D mesh's dims are (replicate, shard), in that order (FSDP2's HSDP convention); "
                          f"this mesh names them {tuple(names)}. Build it as init_device_mesh(device_type, (R, S), "
                          "mesh_dim_names=('replicate', 'shard')) (or leave the names out, or use torchtitan's "
                          "'dp_replicate' / 'dp_shard')")
    if mesh.device_type != device.type:
        raise ConfigError(f"the mesh is on {mesh.device_type!r} but the model's shards live on {device.type!r}: "
                          "build the mesh for the model's device type (CPU with gloo, CUDA with NCCL)")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ProcessGroupError(f"the mesh has {mesh.size()} ranks ({mesh}) but the default process group has "
                                f"{world}: a hybrid-sharding mesh must span every rank (e.g. "
                                f"init_device_mesh(device_type, (R, S)) with R * S = {world})")
    if mesh.get_coordinate() is None:
        raise ProcessGroupError(f"rank {dist.get_rank()} is not in the mesh {mesh}")
    replicas, shards = mesh.size(0), mesh.size(1)
    if shards == 1 and replicas > 1:
        raise ConfigError(f"the mesh's shard dim has 1 rank (mesh {mesh}): nothing would be sharded; use stage 0 "
                          "(DDP) over process_group for plain replication, or a shard dim of 2 or more ranks")
    return mesh.get_group(1), mesh.get_group(0)


def secondary_group(group: dist.ProcessGroup, size: int | None, timeout_s: float) -> dist.ProcessGroup | None:
    """hpZ's node group of this rank: ranks ``[k*M, (k+1)*M)`` of ``group`` (in its rank order)
    that hold this rank, M = ``size`` (``Config.secondary_partition_size``); ``None`` when
    ``size`` is ``None``. Every rank of ``group`` creates every node group, in one order (what
    ``dist.new_group`` requires). Where hpZ applies (stage 3, no 2-D mesh, no activation budget)
    is ``config.check_stage_options``'s.

    Source: ZeRO++ (arXiv 2306.10209) section 3.2: the secondary partition spans one node.

    Raises:
        ConfigError: M not a divisor of the world size N, or M = N (the node is the world:
            plain stage 3).
    """
    if size is None:
        return None
    n = dist.get_world_size(group)
    if n % size or size >= n:
        raise ConfigError(f"Config.secondary_partition_size must divide the world size {n} and be smaller than it "
                          f"(ranks of a node), got {size}")
    ranks = dist.get_process_group_ranks(group)
    mine = None
    for k in range(n // size):
        members = ranks[k * size:(k + 1) * size]
        node = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
        if dist.get_rank() in members:
            mine = node
    return mine


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """``"RxS"`` -> ``(R, S)``, both positive: the ``--mesh`` flag of the examples.

    Raises:
        ConfigError: ``text`` is not two positive integers joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ConfigError(f"expected RxS with positive integers (e.g. 2x2), got {text!r}")
    return int(parts[0]), int(parts[1])
