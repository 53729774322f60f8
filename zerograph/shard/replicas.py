"""Replicas start equal: at compile, every rank takes group rank 0's parameters and buffers.

Data parallelism assumes every rank starts from the same model; a job that seeds each rank
differently or loads weights on rank 0 only breaks that silently (at stages 1-3 the sharded model
would be a mix of several initialisations that no rank ever held). So ``compile`` broadcasts, at
every stage, always, before sharding: in place, in 250 MB buckets (DDP's default), calling the very
function DDP calls. Why a broadcast rather than a check that raises: docs/design.md, section
"Capture".

Before the broadcast, the ranks compare a 63-bit digest of every parameter's and buffer's name,
shape and dtype (one all-gather of 8 bytes per rank): ranks that built different models get a
``ShardingError`` naming the first difference, instead of a broadcast of mismatched sizes.

Source: ``torch.nn.parallel.DistributedDataParallel.__init__`` (``_verify_param_shape_across_processes``
then ``_sync_module_states``); FSDP1's ``sync_module_states``.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _sync_module_states

from ..errors import CollectiveError, ShardingError
from ..graph.vocab import all_gather_single

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size


def sync_replicas(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """Overwrite every rank's parameters and buffers with group rank 0's, in place.

    Collective over ``group``; call it before sharding, while every parameter is full. ``device``
    holds the digest exchange (CUDA for NCCL). Nothing happens at world size 1.

    Raises:
        ShardingError: on every rank, when the ranks' models differ in parameter or buffer names,
            shapes or dtypes (named: the first difference and the two ranks).
        CollectiveError: a peer rank died or stopped before compiling.
    """
    if dist.get_world_size(group) == 1:
        return
    structure = _structure(model)
    try:
        _check_same_structure(structure, group, device)
        with torch.no_grad():
            _sync_module_states(model, group, BROADCAST_BUCKET_BYTES, src=0, params_and_buffers_to_ignore=set())
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(f"rank {dist.get_rank(group)}: broadcasting rank 0's parameters at compile failed: "
                              "a peer rank probably died or did not call zerograph.compile. Cause: "
                              f"{type(exc).__name__}: {exc}") from exc


def _structure(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    """``(kind, name, shape, dtype)`` of every parameter and buffer, in the order they are broadcast."""
    return ([("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
            + [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()])


def _check_same_structure(structure: list, group: dist.ProcessGroup, device: torch.device) -> None:
    size = dist.get_world_size(group)
    # Python's hash() is salted per process: a fixed hash, so equal structures agree on every rank
    digest = int.from_bytes(hashlib.blake2b(repr(structure).encode(), digest_size=8).digest(), "little") >> 1
    everyone = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_single(everyone, torch.tensor([digest], dtype=torch.int64, device=device), group=group)
    digests = everyone.tolist()
    if all(d == digests[0] for d in digests):
        return
    structures: list = [None] * size
    dist.all_gather_object(structures, structure, group=group)  # the error path only: name the difference
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    a, b = structures[0], structures[other]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def entry(s: list) -> str:
        if i >= len(s):
            return f"nothing (it has {len(s)} parameters and buffers)"
        kind, name, shape, dtype = s[i]
        return f"{kind} {name!r} of shape {shape} {dtype.removeprefix('torch.')}"

    raise ShardingError(f"ranks built different models: at parameter/buffer {i}, rank 0 has {entry(a)}, rank {other} "
                        f"has {entry(b)} (this is rank {dist.get_rank(group)}). Every rank must compile the same "
                        "model; zerograph.compile then copies rank 0's values to every rank (as DDP does)")
