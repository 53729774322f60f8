"""Pack parameter shards into one flat send buffer, and unpack a rank-major gathered buffer.

Layout (FSDP2's flat all-gather layout; see ``zerograph.shard.sharding``): a parameter of ``rows`` rows is
split on dim 0 into ``world_size`` chunks of ``c = ceil(rows / world_size)`` rows (``torch.chunk``'s
rule), the last ones short or empty. Each rank sends its chunks padded to ``c`` rows, concatenated
over the parameters of a unit, so every rank's send buffer has the same length ``S``. All-gathering
those buffers gives ``(world_size * S,)`` elements, rank-major: rank ``r``'s ``S`` elements come
``r``-th. ``pack`` builds one rank's send buffer; ``unpack`` turns the gathered buffer back into
full parameter tensors.

Both cast on the fly (e.g. fp32 master shards to a bf16 send buffer), so cast and copy cost one
read and one write of each element. The Triton versions launch one kernel per tensor.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._common import TRITON_FLOAT_DTYPES, check_launchable, same_device, triton_kernels, want_triton

__all__ = ["pack", "pack_reference", "unpack", "unpack_reference", "default_chunk_rows"]


# --------------------------------------------------------------------------------------------- pack

def _pack_plan(shards, padded_numels, dtype, out) -> tuple[list[int], torch.dtype, int]:
    if len(shards) == 0:
        raise ValueError("pack: needs at least one shard")
    numels = [s.numel() for s in shards]
    padded = list(numels) if padded_numels is None else [int(x) for x in padded_numels]
    if len(padded) != len(shards):
        raise ValueError(f"pack: {len(shards)} shards but {len(padded)} padded lengths")
    for i, (n, pn) in enumerate(zip(numels, padded)):
        if pn < n:
            raise ValueError(f"pack: shard {i} has {n} elements, more than its padded length {pn}")
    if dtype is None:
        dtype = out.dtype if out is not None else shards[0].dtype
        if out is None and any(s.dtype != dtype for s in shards):
            raise ValueError("pack: shards have several dtypes; pass dtype= for the send buffer")
    total = sum(padded)
    if out is not None:
        if out.dtype != dtype or out.dim() != 1 or out.numel() != total:
            raise ValueError(f"pack: out must be 1-D {dtype} of {total} elements, got "
                             f"{out.dtype} {tuple(out.shape)}")
    same_device(list(shards) + ([out] if out is not None else []), "pack")
    return padded, dtype, total


def pack_reference(
    shards: Sequence[torch.Tensor],
    padded_numels: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`pack` (same arguments and result): ``copy_`` each shard, zero its padding."""
    padded, dtype, total = _pack_plan(shards, padded_numels, dtype, out)
    if out is None:
        out = torch.empty(total, dtype=dtype, device=shards[0].device)
    offset = 0
    for shard, pn in zip(shards, padded):
        n = shard.numel()
        out[offset : offset + n].copy_(shard.reshape(-1))
        out[offset + n : offset + pn].zero_()
        offset += pn
    return out


def pack(
    shards: Sequence[torch.Tensor],
    padded_numels: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Concatenate flattened shards into one 1-D buffer, casting and zero-padding each shard.

    Args:
        shards: tensors of any shape (flattened in row-major order), all on one device; may be empty
            (0 elements). Not modified.
        padded_numels: per shard, the number of elements it occupies in the output (>= its numel);
            elements past the shard's numel are zeros. Default: no padding.
        dtype: output dtype (the cast rounds to nearest even, as ``Tensor.to``). Default: ``out``'s
            dtype, else the shards' common dtype.
        out: optional preallocated 1-D output of ``sum(padded_numels)`` elements and ``dtype``.
        use_triton: ``None`` = Triton for CUDA tensors or under ``TRITON_INTERPRET=1`` when all
            dtypes are fp32/bf16/fp16, else the reference; ``True``/``False`` force one.

    Returns:
        The 1-D buffer of ``sum(padded_numels)`` elements (``out`` if given). Shard ``i`` starts at
        ``sum(padded_numels[:i])``.

    Raises:
        ValueError: no shards, a padded length shorter than its shard, mixed shard dtypes without
            ``dtype``, a wrongly sized ``out``, or tensors on several devices.
        TypeError: ``use_triton=True`` with a dtype other than fp32/bf16/fp16.
        RuntimeError: Triton forced on CPU tensors without the Triton interpreter.
    """
    padded, dtype, total = _pack_plan(shards, padded_numels, dtype, out)
    eligible = dtype in TRITON_FLOAT_DTYPES and all(s.dtype in TRITON_FLOAT_DTYPES for s in shards) and (
        out is None or out.is_contiguous())
    tensors = list(shards) + ([out] if out is not None else [])
    if not want_triton(tensors, use_triton, eligible, "dtypes must be fp32/bf16/fp16 and out contiguous"):
        return pack_reference(shards, padded, dtype, out)
    if out is None:
        out = torch.empty(total, dtype=dtype, device=shards[0].device)
    kernels = triton_kernels()
    check_launchable(kernels._pack_kernel, tensors)
    offset = 0
    for shard, pn in zip(shards, padded):
        # Non-contiguous shards are copied once; the kernel reads a dense 1-D source.
        kernels.launch_pack(shard.reshape(-1).contiguous(), out, pn, offset)
        offset += pn
    return out


# ------------------------------------------------------------------------------------------- unpack

def default_chunk_rows(shape: Sequence[int], world_size: int) -> int:
    """Rows per rank of a parameter sharded on dim 0 the ``torch.chunk`` way: ``ceil(rows / N)``."""
    return -(-int(shape[0]) // world_size)


def _unpack_plan(gathered, shapes, world_size, chunk_rows, dtype, out):
    if world_size < 1:
        raise ValueError(f"unpack: world_size must be >= 1, got {world_size}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    for s in shapes:
        if len(s) == 0:
            raise ValueError("unpack: parameters must have at least one dimension (sharded on dim 0)")
    chunks = [default_chunk_rows(s, world_size) for s in shapes] if chunk_rows is None else [int(c) for c in chunk_rows]
    if len(chunks) != len(shapes):
        raise ValueError(f"unpack: {len(shapes)} shapes but {len(chunks)} chunk_rows")
    for s, c in zip(shapes, chunks):
        if c < 0 or c * world_size < s[0]:
            raise ValueError(f"unpack: chunk_rows {c} x world_size {world_size} cannot hold {s[0]} rows")
    shard_numels = [c * math.prod(s[1:]) for s, c in zip(shapes, chunks)]
    row = sum(shard_numels)
    if gathered.dim() != 1 or gathered.numel() != world_size * row:
        raise ValueError(f"unpack: gathered must be 1-D of world_size * {row} = {world_size * row} elements, "
                         f"got shape {tuple(gathered.shape)}")
    dtype = gathered.dtype if dtype is None else dtype
    if out is not None:
        if len(out) != len(shapes):
            raise ValueError(f"unpack: {len(shapes)} shapes but {len(out)} outputs")
        for o, s in zip(out, shapes):
            if tuple(o.shape) != s or o.dtype != dtype:
                raise ValueError(f"unpack: output {tuple(o.shape)} {o.dtype} does not match {s} {dtype}")
        same_device([gathered, *out], "unpack")
    return shapes, chunks, shard_numels, row, dtype


def unpack_reference(
    gathered: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    world_size: int,
    chunk_rows: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Plain-torch :func:`unpack` (same arguments and result).

    ``gathered.view(world_size, -1)``, take each parameter's columns, stack the ranks' chunks with
    ``reshape(world_size * chunk_rows, *rest)`` and drop the padding rows with ``[:rows]``.
    """
    shapes, chunks, shard_numels, _, dtype = _unpack_plan(gathered, shapes, world_size, chunk_rows, dtype, out)
    by_rank = gathered.view(world_size, -1)
    results = []
    col = 0
    for i, (shape, c, sn) in enumerate(zip(shapes, chunks, shard_numels)):
        full = by_rank[:, col : col + sn].reshape(world_size * c, *shape[1:])[: shape[0]]
        dst = out[i] if out is not None else torch.empty(shape, dtype=dtype, device=gathered.device)
        results.append(dst.copy_(full))
        col += sn
    return results


def unpack(
    gathered: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    world_size: int,
    chunk_rows: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    out: Sequence[torch.Tensor] | None = None,
    *,
    use_triton: bool | None = None,
) -> list[torch.Tensor]:
    """Split an all-gathered, rank-major flat buffer into full parameter tensors.

    Args:
        gathered: 1-D buffer of ``world_size * S`` elements, ``S = sum_i chunk_rows[i] * prod(shapes[i][1:])``;
            elements ``[r*S, (r+1)*S)`` are rank ``r``'s send buffer as built by :func:`pack`
            (parameter ``i``'s padded chunk at column ``sum_{j<i} chunk_rows[j] * prod(shapes[j][1:])``).
        shapes: full (unsharded) shape of each parameter, at least 1-D.
        world_size: number of ranks N in the gather.
        chunk_rows: padded rows per rank for each parameter. Default ``ceil(shape[0] / N)``.
        dtype: output dtype (cast on the fly). Default: ``gathered.dtype``.
        out: optional preallocated outputs, one per shape, of ``dtype`` (contiguous for Triton).
        use_triton: ``None`` = Triton for CUDA tensors or under ``TRITON_INTERPRET=1`` when the
            dtypes are fp32/bf16/fp16, else the reference; ``True``/``False`` force one.

    Returns:
        One new tensor per parameter (``out``'s tensors if given): rows ``[r*c, (r+1)*c)`` of
        parameter ``i`` are rank ``r``'s chunk, truncated to ``shapes[i][0]`` rows.

    Raises:
        ValueError: a size mismatch (``gathered``, ``chunk_rows``, ``out``), ``chunk_rows * N`` smaller
            than a parameter's rows, 0-d shapes, or tensors on several devices.
        TypeError: ``use_triton=True`` with a dtype other than fp32/bf16/fp16 or non-contiguous tensors.
        RuntimeError: Triton forced on CPU tensors without the Triton interpreter.
    """
    shapes, chunks, shard_numels, row, dtype = _unpack_plan(gathered, shapes, world_size, chunk_rows, dtype, out)
    tensors = [gathered, *(out or [])]
    eligible = (gathered.dtype in TRITON_FLOAT_DTYPES and dtype in TRITON_FLOAT_DTYPES
                and all(t.is_contiguous() for t in tensors))
    if not want_triton(tensors, use_triton, eligible, "dtypes must be fp32/bf16/fp16 and tensors contiguous"):
        return unpack_reference(gathered, shapes, world_size, chunks, dtype, out)
    kernels = triton_kernels()
    check_launchable(kernels._unpack_kernel, tensors)
    results = []
    col = 0
    for i, (shape, sn) in enumerate(zip(shapes, shard_numels)):
        dst = out[i] if out is not None else torch.empty(shape, dtype=dtype, device=gathered.device)
        kernels.launch_unpack(gathered, dst, world_size, row, col, sn)
        results.append(dst)
        col += sn
    return results
