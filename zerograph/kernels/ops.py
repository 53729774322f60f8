"""The pack and unpack kernels as PyTorch operators, so graph passes can put one node per bucket in
a graph ([Note: the copy-in layout], below).

``zerograph::pack_shards(Tensor[] shards, int[] chunk_rows, int world_size, ScalarType dtype) -> Tensor``
is a collective's copy-in: every tensor is cast to ``dtype``, zero-padded on dim 0 to
``world_size * chunk_rows[i]`` rows and cut into ``world_size`` chunks of ``chunk_rows[i]`` rows,
laid rank-major::

    out.view(world_size, -1)[r] = cat_i(flatten(padded_i[r*c_i : (r+1)*c_i]))   # (N, sum_i c_i * row_numel_i)

``zerograph::unpack_gathered(Tensor gathered, int world_size, int[] chunk_rows, int[] rows,
int[] row_numels) -> Tensor`` is the all-gather's copy-out, the inverse: every parameter's full,
unpadded rows, parameter-major, in one new allocation (the gathered buffer can die after it)::

    out[o_i : o_i + rows_i * n_i].view(rows_i, n_i) =
        gathered.view(N, -1)[:, col_i : col_i + c_i * n_i].reshape(N * c_i, n_i)[:rows_i]

with ``n_i = row_numels[i]``, ``c_i = chunk_rows[i]``, ``col_i = sum_{j<i} c_j * n_j``, ``o_i =
sum_{j<i} rows_j * n_j``. Kernels of each op: fake (shape and dtype, for tracing); CPU and every
device but CUDA, :func:`~zerograph.kernels.pack_reference` / ``unpack_reference`` (bit-identical to
``Tensor.to`` + ``F.pad`` + ``reshape`` + ``torch.cat`` and its inverse); CUDA, the Triton
:func:`~zerograph.kernels.pack` / ``unpack`` for fp32/bf16/fp16, else the reference. Why
``custom_op`` and not ``triton_op``: docs/design.md, section "Kernels as operators".

Source: FSDP2's ``foreach_all_gather`` copy-in, ``foreach_all_gather_copy_out``
(``split_with_sizes_copy``) and ``foreach_reduce`` reduce-scatter input; ``torch.library.custom_op``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .packing import pack, pack_reference, unpack, unpack_reference

__all__ = ["PACK_SHARDS", "UNPACK_GATHERED", "pack_shards", "pack_shards_numel", "unpack_gathered",
           "unpack_gathered_numel"]

# [Note: the copy-in layout]
# A collective's send buffer holds, per rank, that rank's chunk of every parameter of the bucket,
# back to back: parameter i's chunk is ``chunk_rows[i]`` rows, its rows first and zero padding after
# (the last ranks of an uneven ``Shard(0)`` split hold fewer rows, or none). ``pack_shards`` is
# :func:`zerograph.kernels.pack` over the row slices ``shard[r*c : (r+1)*c]``, each padded to
# ``c * row_numel`` elements.
# - all-gather copy-in: ``world_size=1``; each rank packs its own padded shards, so the gathered
#   buffer ``(N, sum_i c_i * n_i)`` holds each parameter's rows rank by rank;
# - reduce-scatter copy-in: ``world_size=N``; each full gradient is padded to ``N * chunk_rows``
#   rows and the ranks' chunks are laid side by side, so rank ``r`` receives its rows of every
#   gradient.
# A templated unit's flat shard (``shard/flat.py``) is this rank's all-gather copy-in kept as the
# parameters' storage, so its gather needs no copy-in; qwZ and qgZ (``quantize.py``) keep the
# layout with int8 blocks and their scales in place of a chunk's values.


def _check(shards: Sequence[torch.Tensor], chunk_rows: Sequence[int], world_size: int) -> None:
    if len(shards) == 0:
        raise ValueError("pack_shards: needs at least one tensor")
    if len(chunk_rows) != len(shards):
        raise ValueError(f"pack_shards: {len(shards)} tensors but {len(chunk_rows)} chunk_rows")
    if world_size < 1:
        raise ValueError(f"pack_shards: world_size must be >= 1, got {world_size}")
    for i, (t, c) in enumerate(zip(shards, chunk_rows)):
        if t.dim() == 0:
            raise ValueError(f"pack_shards: tensor {i} is 0-d; pass t.reshape(-1) (rows are cut on dim 0)")
        if c < 0 or t.shape[0] > world_size * c:
            raise ValueError(f"pack_shards: tensor {i} has {t.shape[0]} rows, more than "
                             f"world_size {world_size} x chunk_rows {c}")


def pack_shards_numel(shards: Sequence[torch.Tensor], chunk_rows: Sequence[int], world_size: int) -> int:
    """Elements of the packed buffer: ``world_size * sum_i chunk_rows[i] * prod(shards[i].shape[1:])``."""
    return world_size * sum(c * math.prod(t.shape[1:]) for t, c in zip(shards, chunk_rows))


def _pieces(shards: Sequence[torch.Tensor], chunk_rows: Sequence[int], world_size: int):
    """The rank-major ``pack`` arguments: row slices (views, no copy) and their padded lengths."""
    pieces, padded = [], []
    for r in range(world_size):
        for t, c in zip(shards, chunk_rows):
            pieces.append(t[r * c : (r + 1) * c])  # (<= c, *rest); empty past the last row
            padded.append(c * math.prod(t.shape[1:]))
    return pieces, padded


@torch.library.custom_op("zerograph::pack_shards", mutates_args=())
def pack_shards(shards: list[torch.Tensor], chunk_rows: list[int], world_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Cast, zero-pad and lay out tensors rank-major in one new 1-D buffer (module docstring).

    Args:
        shards: tensors of at least one dimension, any float dtype, all on one device; tensor ``i``
            has at most ``world_size * chunk_rows[i]`` rows. Not modified.
        chunk_rows: rows per rank chunk of each tensor (its padded shard rows).
        world_size: chunks per tensor N (1 for an all-gather's send buffer).
        dtype: output dtype; the cast rounds to nearest even, as ``Tensor.to``.

    Returns:
        A new contiguous tensor of ``pack_shards_numel(shards, chunk_rows, world_size)`` elements
        and ``dtype``; view it as ``(world_size, -1)`` for the rank rows.

    Raises:
        ValueError: no tensors, a 0-d tensor, mismatched lengths, more rows than ``N * chunk_rows``,
            or tensors on several devices.
    """
    _check(shards, chunk_rows, world_size)
    pieces, padded = _pieces(shards, chunk_rows, world_size)
    return pack_reference(pieces, padded, dtype)


@pack_shards.register_kernel("cuda")
def _pack_shards_cuda(shards, chunk_rows, world_size, dtype):
    # Triton for fp32/bf16/fp16 (one launch per piece), the reference for any other dtype. Called
    # directly on CPU tensors under TRITON_INTERPRET=1 by the tests, to run the same kernels.
    _check(shards, chunk_rows, world_size)
    pieces, padded = _pieces(shards, chunk_rows, world_size)
    return pack(pieces, padded, dtype)


@pack_shards.register_fake
def _pack_shards_fake(shards, chunk_rows, world_size, dtype):
    _check(shards, chunk_rows, world_size)
    return shards[0].new_empty(pack_shards_numel(shards, chunk_rows, world_size), dtype=dtype)


PACK_SHARDS = torch.ops.zerograph.pack_shards.default


# --------------------------------------------------------------------------------- unpack_gathered

def _check_unpack(gathered: torch.Tensor, world_size: int, chunk_rows: Sequence[int], rows: Sequence[int],
                  row_numels: Sequence[int]) -> None:
    if world_size < 1:
        raise ValueError(f"unpack_gathered: world_size must be >= 1, got {world_size}")
    if len(rows) == 0:
        raise ValueError("unpack_gathered: needs at least one parameter")
    if not len(chunk_rows) == len(rows) == len(row_numels):
        raise ValueError(f"unpack_gathered: {len(chunk_rows)} chunk_rows, {len(rows)} rows and "
                         f"{len(row_numels)} row_numels; pass one of each per parameter")
    for i, (c, r, n) in enumerate(zip(chunk_rows, rows, row_numels)):
        if c < 0 or r < 0 or n < 0:
            raise ValueError(f"unpack_gathered: parameter {i} has a negative size "
                             f"(chunk_rows {c}, rows {r}, row_numel {n})")
        if r > world_size * c:
            raise ValueError(f"unpack_gathered: parameter {i} has {r} rows, more than "
                             f"world_size {world_size} x chunk_rows {c}")
    want = world_size * sum(c * n for c, n in zip(chunk_rows, row_numels))
    if gathered.dim() != 1 or gathered.numel() != want:
        raise ValueError(f"unpack_gathered: gathered must be 1-D of world_size x sum(chunk_rows x row_numels) "
                         f"= {want} elements, got shape {tuple(gathered.shape)}")


def unpack_gathered_numel(rows: Sequence[int], row_numels: Sequence[int]) -> int:
    """Elements of the unpacked buffer: ``sum_i rows[i] * row_numels[i]`` (no padding)."""
    return sum(r * n for r, n in zip(rows, row_numels))


def _unpack_views(gathered, rows, row_numels):
    """The output buffer and one ``(rows_i, row_numel_i)`` view of it per parameter."""
    out = gathered.new_empty(unpack_gathered_numel(rows, row_numels))  # (sum rows_i * n_i,)
    views, offset = [], 0
    for r, n in zip(rows, row_numels):
        views.append(out[offset : offset + r * n].view(r, n))  # (rows_i, n_i), contiguous
        offset += r * n
    return out, views


@torch.library.custom_op("zerograph::unpack_gathered", mutates_args=())
def unpack_gathered(gathered: torch.Tensor, world_size: int, chunk_rows: list[int], rows: list[int],
                    row_numels: list[int]) -> torch.Tensor:
    """Lay an all-gathered rank-major buffer out parameter-major, padding dropped (module docstring).

    Args:
        gathered: 1-D, ``world_size * sum_i chunk_rows[i] * row_numels[i]`` elements, any dtype: the
            ranks' send buffers as ``pack_shards(..., world_size=1)`` built them, rank ``r``'s
            ``r``-th. Not modified.
        world_size: ranks N in the all-gather.
        chunk_rows: padded rows per rank of each parameter (``ParamLayout.chunk_rows``).
        rows: full (unpadded) rows of each parameter, at most ``world_size * chunk_rows[i]``.
        row_numels: elements per row of each parameter, ``prod(shape[1:])`` (1 for a 1-D one).

    Returns:
        A new contiguous tensor of ``unpack_gathered_numel(rows, row_numels)`` elements and
        ``gathered``'s dtype (the cast to ``param_dtype`` happened at copy-in); parameter ``i`` is
        ``out[o_i : o_i + rows[i] * row_numels[i]].view(shape_i)``, ``o_i = sum_{j<i} rows[j] * row_numels[j]``.

    Raises:
        ValueError: no parameters, lists of different lengths, a negative size, more rows than
            ``N * chunk_rows``, or ``gathered`` not 1-D of the size the lists give.
    """
    _check_unpack(gathered, world_size, chunk_rows, rows, row_numels)
    out, views = _unpack_views(gathered, rows, row_numels)
    if out.numel():  # gathered.view(N, -1) cannot infer -1 of an empty buffer
        unpack_reference(gathered, [v.shape for v in views], world_size, chunk_rows, out=views)
    return out


@unpack_gathered.register_kernel("cuda")
def _unpack_gathered_cuda(gathered, world_size, chunk_rows, rows, row_numels):
    # Triton for fp32/bf16/fp16 (one launch per parameter), the reference for any other dtype. Called
    # directly on CPU tensors under TRITON_INTERPRET=1 by the tests, to run the same kernel.
    _check_unpack(gathered, world_size, chunk_rows, rows, row_numels)
    out, views = _unpack_views(gathered, rows, row_numels)
    if out.numel():
        unpack(gathered, [v.shape for v in views], world_size, chunk_rows, out=views)
    return out


@unpack_gathered.register_fake
def _unpack_gathered_fake(gathered, world_size, chunk_rows, rows, row_numels):
    _check_unpack(gathered, world_size, chunk_rows, rows, row_numels)
    return gathered.new_empty(unpack_gathered_numel(rows, row_numels))


UNPACK_GATHERED = torch.ops.zerograph.unpack_gathered.default


# ------------------------------------------------------------------------------ the wire dtype

def to_wire(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D comm buffer as the functional collectives move it, a view (no copy): complex as its
    real view (``2 * numel`` reals: a sum reduces real and imaginary parts apart, which is the
    complex sum), bool as ``uint8`` (the same bytes; the process groups have no bool), every
    other dtype as it is. ``from_wire`` undoes it on the received buffer.

    Why: ``torch.distributed``'s Python collectives view complex tensors as real before calling
    the backend, but the C++ functional collectives the passes emit
    (``_c10d_functional.all_gather_into_tensor_out``, ``reduce_scatter_tensor``) do not, and gloo
    and NCCL reject complex (``Invalid scalar type``). Source: ``torch.distributed.all_gather_into_tensor``
    and ``all_reduce`` (their ``view_as_real`` of complex tensors)."""
    if flat.is_complex():
        return torch.view_as_real(flat).reshape(-1)  # (2 * numel,)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat


def from_wire(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The received 1-D buffer of a collective back in ``dtype``, the dtype ``to_wire`` was given (a view)."""
    if dtype.is_complex:
        return torch.view_as_complex(flat.view(-1, 2))  # (numel,)
    if dtype == torch.bool:
        return flat.view(torch.bool)
    return flat
