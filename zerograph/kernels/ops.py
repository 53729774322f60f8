"""The pack kernel as a PyTorch operator, so graph passes can put one node per bucket in a graph.

``zerograph::pack_shards(Tensor[] shards, int[] chunk_rows, int world_size, ScalarType dtype) -> Tensor``
is the copy-in of a collective (FSDP2's copy-in before all-gather / reduce-scatter): every tensor
is cast to ``dtype``, zero-padded on dim 0 to ``world_size * chunk_rows[i]`` rows, and cut into
``world_size`` chunks of ``chunk_rows[i]`` rows; the output lays the chunks rank-major::

    out.view(world_size, -1)[r] = cat_i(flatten(padded_i[r*c_i : (r+1)*c_i]))   # (N, sum_i c_i * row_numel_i)

- all-gather copy-in: ``world_size=1``, ``chunk_rows[i]`` = the padded shard rows (each local shard
  padded to ``chunk_rows``, flattened, concatenated);
- reduce-scatter copy-in: ``world_size=N``, each full gradient padded to ``N * chunk_rows`` rows and
  the ranks' chunks laid side by side, so rank ``r`` receives its rows of every gradient.

It is the rank-major arrangement of :func:`zerograph.kernels.pack`'s arguments: the pieces are the
row slices ``shard[r*c : (r+1)*c]`` (short or empty for the last ranks), each padded to
``c * row_numel`` elements. Implementations:

- fake (meta): the output's shape and dtype only, for tracing (``splice``'s ``make_fx``, AOTAutograd);
- CPU (and every device but CUDA): :func:`~zerograph.kernels.pack_reference` (``copy_`` per piece,
  ``zero_`` per padding), bit-identical to ``Tensor.to`` + ``F.pad`` + ``reshape`` + ``torch.cat``;
- CUDA: :func:`~zerograph.kernels.pack`, one Triton launch per piece for fp32/bf16/fp16, else the
  same reference.

``torch.library.custom_op`` with a CUDA kernel registered apart, rather than
``torch.library.triton_op``: a ``triton_op``'s one function is every device's kernel and its fake
kernel, so the CPU path would have to branch inside a function that must also trace on fake
tensors; here each device gets a plain function and Inductor calls the op as an opaque kernel.

Source: FSDP2's ``foreach_all_gather`` copy-in and ``foreach_reduce`` reduce-scatter input;
``torch.library.custom_op`` / ``register_fake`` / ``register_kernel`` (PyTorch custom operators).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .packing import pack, pack_reference

__all__ = ["PACK_SHARDS", "pack_shards", "pack_shards_numel"]


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
