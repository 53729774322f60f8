"""Block-wise int8 collectives (ZeRO++'s qwZ and qgZ): quantize in the copy-in, dequantize in the copy-out.

Each rank quantizes its own shards ([Note: the copy-in layout] in ``ops.py``), so every rank's
chunk of a gathered buffer carries its own scales; for a reduce-scatter (qgZ) each rank builds one
chunk per destination rank (its rows of every gradient) and an all-to-all exchanges them. Where
each parameter's bytes sit: ``wire_layout.py`` (``WireLayout`` and its constants re-exported here).

A parameter whose padded shard (``chunk_rows * row_numel`` elements) holds at least one block
(``block`` = 256 elements) is *quantized*: cut into ``ceil(shard_numel / block)`` blocks from the
shard's first element (no block straddles two parameters), each sent as ``block`` int8 values
``q = floor(x * 127 / absmax + 0.5)`` in ``[-127, 127]`` plus ``scale = absmax / 127`` in fp32. A
smaller shard is sent unquantized, in ``dtype``, and counted so. Dequantized values are
``q * scale`` in fp32, cast to ``dtype``; ``|x - q * scale| <= absmax / 254`` (plus fp32 rounding)
per block. Why per parameter, why the fallback: docs/design.md, section "Kernels as operators".

Functions, each with a plain-torch ``*_reference`` of the same signature (Triton on CUDA or under
``TRITON_INTERPRET=1``): :func:`pack_quantized` (shards -> send buffer, pad and quantize fused),
:func:`unpack_dequantized` (gathered buffer -> full parameters, dequantize and unpack fused),
:func:`dequantize_sum` (qgZ's received chunks -> their fp32 sum). As operators, with ``ops.py``'s
argument conventions (CPU: the references; CUDA: Triton; fake: shapes): ``zerograph::pack_quantized``
and ``zerograph::unpack_dequantized`` around ``insert_allgather``'s all-gather;
``zerograph::pack_quantized`` (a chunk per destination rank) and ``zerograph::dequantize_sum``
around ``insert_reduce_scatter``'s all-to-all.

Source: ZeRO++ (Wang et al., arXiv 2306.10209) sections 3.1 (qwZ, block-based symmetric int8
quantization of the weights for the forward all-gather) and 3.3 (qgZ, quantized gradients
exchanged by all-to-all and reduced at full precision; here in one hop, not hierarchically).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ._common import TRITON_FLOAT_DTYPES, check_launchable, same_device, triton_kernels, want_triton
from .wire_layout import BLOCK, QMAX, QUANTIZABLE_DTYPES, QUANTIZATIONS, SCALE_BYTES, WireLayout, align4, quantizes, wire_layout

__all__ = ["BLOCK", "DEQUANTIZE_SUM", "QUANTIZATIONS", "PACK_QUANTIZED", "QUANTIZABLE_DTYPES",
           "UNPACK_DEQUANTIZED", "WireLayout", "dequantize_sum", "dequantize_sum_reference", "pack_quantized",
           "pack_quantized_reference", "quantizes", "unpack_dequantized", "unpack_dequantized_reference",
           "wire_layout"]


# -------------------------------------------------------------------------------------- copy-in

def _check_pack(shards, layout: WireLayout, dtype: torch.dtype, out) -> None:
    if len(shards) != len(layout.shard_numels):
        raise ValueError(f"pack_quantized: {len(shards)} shards but a layout of {len(layout.shard_numels)}")
    for i, (s, n) in enumerate(zip(shards, layout.shard_numels)):
        if s.numel() > n:
            raise ValueError(f"pack_quantized: shard {i} has {s.numel()} elements, more than its padded {n}")
        if not (s.dtype.is_floating_point and s.dtype.itemsize <= 4):
            raise TypeError(f"pack_quantized: shard {i} is {s.dtype}; quantized gathers take fp32/bf16/fp16")
    if dtype.itemsize != layout.itemsize:
        raise ValueError(f"pack_quantized: dtype {dtype} has {dtype.itemsize} bytes, the layout {layout.itemsize}")
    if out is not None and (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != layout.rank_bytes):
        raise ValueError(f"pack_quantized: out must be 1-D uint8 of {layout.rank_bytes} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    same_device(list(shards) + ([out] if out is not None else []), "pack_quantized")


def quantize_reference(src: torch.Tensor, padded: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``src`` (any float, flattened, zero-padded to ``padded`` elements) as int8 values
    ``(padded,)`` and fp32 scales ``(ceil(padded / block),)`` (module docstring's formulas)."""
    nblocks = -(-padded // block)
    x = torch.zeros(nblocks * block, dtype=torch.float32, device=src.device)
    x[: src.numel()] = src.reshape(-1)
    x = x.view(nblocks, block)  # (blocks, block)
    absmax = x.abs().amax(dim=1)  # (blocks,)
    den = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    q = torch.floor((x * QMAX) / den[:, None] + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(-1)[:padded], absmax / QMAX


def pack_quantized_reference(shards: Sequence[torch.Tensor], layout: WireLayout, dtype: torch.dtype,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch :func:`pack_quantized` (same arguments and result)."""
    _check_pack(shards, layout, dtype, out)
    if out is None:
        out = torch.empty(layout.rank_bytes, dtype=torch.uint8, device=shards[0].device)
    out.zero_()  # alignment padding included: the bytes on the wire are all defined
    for i, shard in enumerate(shards):
        n, at = layout.shard_numels[i], layout.offsets[i]
        if layout.quantized[i]:
            q, scales = quantize_reference(shard, n, layout.block)
            out[at : at + n].view(torch.int8).copy_(q)
            s = layout.scale_offsets[i]
            out[s : s + SCALE_BYTES * scales.numel()].view(torch.float32).copy_(scales)
        else:
            out[at : at + n * layout.itemsize].view(dtype)[: shard.numel()].copy_(shard.reshape(-1))
    return out


def pack_quantized(shards: Sequence[torch.Tensor], layout: WireLayout, dtype: torch.dtype,
                   out: torch.Tensor | None = None, *, use_triton: bool | None = None) -> torch.Tensor:
    """This rank's quantized send buffer.

    Args:
        shards: this rank's shard of each parameter (any shape, flattened row-major; fewer
            elements than the padded ``layout.shard_numels[i]`` are zero-padded), fp32/bf16/fp16,
            on one device. Not modified.
        layout: ``wire_layout(shard_numels, dtype.itemsize)``.
        dtype: the dtype raw (small) shards are sent in (``param_dtype``).
        out: optional 1-D uint8 buffer of ``layout.rank_bytes`` (contiguous for Triton).
        use_triton: as :func:`zerograph.kernels.pack`'s.

    Returns:
        ``(layout.rank_bytes,)`` uint8.

    Raises:
        ValueError: sizes that do not match the layout, or tensors on several devices.
        TypeError: a shard that is not fp32/bf16/fp16.
        RuntimeError: Triton forced on CPU tensors without the Triton interpreter.
    """
    tensors = list(shards) + ([out] if out is not None else [])
    eligible = (dtype in TRITON_FLOAT_DTYPES and all(s.dtype in TRITON_FLOAT_DTYPES for s in shards)
                and (out is None or out.is_contiguous()))
    if not want_triton(tensors, use_triton, eligible, "dtypes must be fp32/bf16/fp16 and out contiguous"):
        return pack_quantized_reference(shards, layout, dtype, out)
    _check_pack(shards, layout, dtype, out)
    kernels = triton_kernels()
    assert layout.block == kernels.QUANT_BLOCK, "the Triton kernels are built for BLOCK-element blocks"
    check_launchable(kernels._quantize_kernel, tensors)
    if out is None:
        out = torch.empty(layout.rank_bytes, dtype=torch.uint8, device=shards[0].device)
    _zero_gaps(out, layout)
    q, s, raw = out.view(torch.int8), out.view(torch.float32), out.view(dtype)
    for i, shard in enumerate(shards):
        src = shard.reshape(-1).contiguous()  # a non-contiguous shard is copied once
        n, at = layout.shard_numels[i], layout.offsets[i]
        if layout.quantized[i]:
            kernels.launch_quantize(src, q, s, n, at, layout.scale_offsets[i] // SCALE_BYTES)
        else:
            kernels.launch_pack(src, raw, n, at // layout.itemsize)
    return out


def _zero_gaps(out: torch.Tensor, layout: WireLayout) -> None:
    """Zero the alignment padding (at most 3 bytes after the raw shards and after the payload),
    which no kernel writes."""
    raw_end = sum(n * layout.itemsize for n, qz in zip(layout.shard_numels, layout.quantized) if not qz)
    out[raw_end : align4(raw_end)].zero_()
    payload_end = max((o + n for o, n, qz in zip(layout.offsets, layout.shard_numels, layout.quantized) if qz),
                      default=align4(raw_end))
    out[payload_end:].zero_()


# ------------------------------------------------------------------------------------- copy-out

def _check_unpack(gathered, world_size: int, layout: WireLayout, numels, dtype, out) -> None:
    if world_size < 1:
        raise ValueError(f"unpack_dequantized: world_size must be >= 1, got {world_size}")
    if gathered.dtype != torch.uint8 or gathered.dim() != 1 or gathered.numel() != world_size * layout.rank_bytes:
        raise ValueError(f"unpack_dequantized: gathered must be 1-D uint8 of world_size x {layout.rank_bytes} "
                         f"bytes, got {gathered.dtype} {tuple(gathered.shape)}")
    if len(out) != len(layout.shard_numels) or len(numels) != len(out):
        raise ValueError(f"unpack_dequantized: {len(out)} outputs and {len(numels)} numels for a layout of "
                         f"{len(layout.shard_numels)} parameters")
    for i, (o, n, sn) in enumerate(zip(out, numels, layout.shard_numels)):
        if o.numel() != n or n > world_size * sn or o.dtype != dtype:
            raise ValueError(f"unpack_dequantized: output {i} is {o.dtype} of {o.numel()} elements; want {dtype} "
                             f"of {n} <= world_size x {sn}")
    same_device([gathered, *out], "unpack_dequantized")


def unpack_dequantized_reference(gathered: torch.Tensor, world_size: int, layout: WireLayout, dtype: torch.dtype,
                                 out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Plain-torch :func:`unpack_dequantized` (same arguments and result)."""
    numels = [o.numel() for o in out]
    _check_unpack(gathered, world_size, layout, numels, dtype, out)
    by_rank = gathered.view(world_size, layout.rank_bytes)  # (N, rank_bytes)
    for i, dst in enumerate(out):
        n, at = layout.shard_numels[i], layout.offsets[i]
        if layout.quantized[i]:
            nblocks, s = layout.blocks(i), layout.scale_offsets[i]
            q = by_rank[:, at : at + n].view(torch.int8).to(torch.float32)  # (N, shard_numel)
            scales = by_rank[:, s : s + SCALE_BYTES * nblocks].view(torch.float32)  # (N, blocks)
            q = F.pad(q, [0, nblocks * layout.block - n]).view(world_size, nblocks, layout.block)
            full = (q * scales[:, :, None]).view(world_size, -1)[:, :n]  # (N, shard_numel) fp32
        else:
            full = by_rank[:, at : at + n * layout.itemsize].view(dtype)  # (N, shard_numel)
        dst.view(-1).copy_(full.reshape(-1)[: dst.numel()])
    return list(out)


def unpack_dequantized(gathered: torch.Tensor, world_size: int, layout: WireLayout, dtype: torch.dtype,
                       out: Sequence[torch.Tensor], *, use_triton: bool | None = None) -> list[torch.Tensor]:
    """Dequantize an all-gathered buffer of :func:`pack_quantized` send buffers into ``out``.

    Args:
        gathered: 1-D uint8 of ``world_size * layout.rank_bytes``; rank ``r``'s send buffer ``r``-th.
        world_size: ranks N in the all-gather.
        layout: the send buffers' ``WireLayout`` (the same on every rank).
        dtype: the outputs' dtype (``param_dtype``; raw parameters were sent in it).
        out: one contiguous tensor per parameter, of ``dtype`` and of its full (unpadded) numel;
            element ``r * shard_numel + k`` is rank ``r``'s element ``k``, the padding dropped.
        use_triton: as :func:`zerograph.kernels.unpack`'s.

    Returns:
        ``out``, written.

    Raises:
        ValueError: sizes that do not match the layout, or tensors on several devices.
        TypeError: ``use_triton=True`` with a dtype other than fp32/bf16/fp16 or non-contiguous outputs.
        RuntimeError: Triton forced on CPU tensors without the Triton interpreter.
    """
    tensors = [gathered, *out]
    eligible = dtype in TRITON_FLOAT_DTYPES and all(t.is_contiguous() for t in tensors)
    if not want_triton(tensors, use_triton, eligible, "dtype must be fp32/bf16/fp16 and tensors contiguous"):
        return unpack_dequantized_reference(gathered, world_size, layout, dtype, out)
    _check_unpack(gathered, world_size, layout, [o.numel() for o in out], dtype, out)
    kernels = triton_kernels()
    assert layout.block == kernels.QUANT_BLOCK, "the Triton kernels are built for BLOCK-element blocks"
    check_launchable(kernels._dequantize_kernel, tensors)
    q, s, raw = gathered.view(torch.int8), gathered.view(torch.float32), gathered.view(dtype)
    for i, dst in enumerate(out):
        n, at = layout.shard_numels[i], layout.offsets[i]
        if layout.quantized[i]:
            kernels.launch_dequantize(q, s, dst, world_size, layout.rank_bytes, at, layout.scale_offsets[i], n)
        else:
            kernels.launch_unpack(raw, dst, world_size, layout.rank_bytes // layout.itemsize, at // layout.itemsize, n)
    return list(out)


# ------------------------------------------------------------------------------------ operators

def _layout_of(shapes_rest: Sequence[int], chunk_rows: Sequence[int], dtype: torch.dtype, block: int) -> WireLayout:
    return wire_layout([c * n for c, n in zip(chunk_rows, shapes_rest)], dtype.itemsize, block)


def _check_op(shards: Sequence[torch.Tensor], chunk_rows: Sequence[int], world_size: int) -> list[int]:
    if len(shards) == 0 or len(chunk_rows) != len(shards) or world_size < 1:
        raise ValueError(f"pack_quantized: {len(shards)} tensors, {len(chunk_rows)} chunk_rows, world_size "
                         f"{world_size}; pass one chunk_rows per tensor, at least one, and world_size >= 1")
    for i, (t, c) in enumerate(zip(shards, chunk_rows)):
        if t.dim() == 0 or t.shape[0] > world_size * c:
            raise ValueError(f"pack_quantized: tensor {i} has shape {tuple(t.shape)}: want 1-D or more, "
                             f"at most world_size x chunk_rows = {world_size} x {c} rows")
    return [math.prod(t.shape[1:]) for t in shards]


def _pieces(shards: Sequence[torch.Tensor], chunk_rows: Sequence[int], world_size: int) -> list[list[torch.Tensor]]:
    """Per destination rank ``r``, its row chunk ``t[r*c : (r+1)*c]`` of every tensor (views, maybe short or empty)."""
    return [[t[r * c : (r + 1) * c] for t, c in zip(shards, chunk_rows)] for r in range(world_size)]


@torch.library.custom_op("zerograph::pack_quantized", mutates_args=())
def pack_quantized_op(shards: list[torch.Tensor], chunk_rows: list[int], world_size: int, dtype: torch.dtype,
                      block: int) -> torch.Tensor:
    """Quantized send buffers, rank-major: for each ``r < world_size``, the row chunk ``r`` (of
    ``chunk_rows[i]`` rows, zero-padded) of every tensor, quantized by blocks of ``block`` elements
    or sent raw in ``dtype`` (``wire_layout``). ``world_size=1``: an all-gather's send buffer (the
    tensors are this rank's shards); ``N``: an all-to-all's (the tensors are full gradients, chunk
    ``r`` goes to rank ``r``), as ``zerograph::pack_shards`` lays out plain buffers.

    Returns:
        ``(world_size * wire_layout([chunk_rows[i] * row_numel_i], dtype.itemsize, block).rank_bytes,)`` uint8.

    Raises:
        ValueError: no tensors, a 0-d tensor, more rows than ``world_size * chunk_rows``, mismatched lengths.
        TypeError: a tensor that is not fp32/bf16/fp16.
    """
    layout = _layout_of(_check_op(shards, chunk_rows, world_size), chunk_rows, dtype, block)
    out = torch.empty(world_size * layout.rank_bytes, dtype=torch.uint8, device=shards[0].device)
    for r, pieces in enumerate(_pieces(shards, chunk_rows, world_size)):
        pack_quantized_reference(pieces, layout, dtype, out=out[r * layout.rank_bytes : (r + 1) * layout.rank_bytes])
    return out


@pack_quantized_op.register_kernel("cuda")
def _pack_quantized_cuda(shards, chunk_rows, world_size, dtype, block):
    # Triton for fp32/bf16/fp16; called directly on CPU tensors under TRITON_INTERPRET=1 by the tests.
    layout = _layout_of(_check_op(shards, chunk_rows, world_size), chunk_rows, dtype, block)
    out = torch.empty(world_size * layout.rank_bytes, dtype=torch.uint8, device=shards[0].device)
    for r, pieces in enumerate(_pieces(shards, chunk_rows, world_size)):
        pack_quantized(pieces, layout, dtype, out=out[r * layout.rank_bytes : (r + 1) * layout.rank_bytes])
    return out


@pack_quantized_op.register_fake
def _pack_quantized_fake(shards, chunk_rows, world_size, dtype, block):
    layout = _layout_of(_check_op(shards, chunk_rows, world_size), chunk_rows, dtype, block)
    return shards[0].new_empty(world_size * layout.rank_bytes, dtype=torch.uint8)


def _unpack_plan(gathered, world_size, chunk_rows, rows, row_numels, dtype, block):
    if not len(chunk_rows) == len(rows) == len(row_numels) or not rows:
        raise ValueError(f"unpack_dequantized: {len(chunk_rows)} chunk_rows, {len(rows)} rows and "
                         f"{len(row_numels)} row_numels; pass one of each per parameter, at least one")
    layout = _layout_of(row_numels, chunk_rows, dtype, block)
    if gathered.dim() != 1 or gathered.numel() != world_size * layout.rank_bytes:
        raise ValueError(f"unpack_dequantized: gathered must be 1-D of world_size x {layout.rank_bytes} bytes, "
                         f"got {tuple(gathered.shape)}")
    numels = [r * n for r, n in zip(rows, row_numels)]
    out = gathered.new_empty(sum(numels), dtype=dtype)  # (sum numel,) parameter-major
    views, offset = [], 0
    for n in numels:
        views.append(out[offset : offset + n])
        offset += n
    return layout, out, views


@torch.library.custom_op("zerograph::unpack_dequantized", mutates_args=())
def unpack_dequantized_op(gathered: torch.Tensor, world_size: int, chunk_rows: list[int], rows: list[int],
                          row_numels: list[int], dtype: torch.dtype, block: int) -> torch.Tensor:
    """The quantized all-gather's copy-out: ``unpack_gathered``'s parameter-major, unpadded layout
    (``out[o_i : o_i + rows_i * row_numels_i]`` is parameter ``i``), dequantized into ``dtype``.

    Args:
        gathered: 1-D uint8, ``world_size`` send buffers of ``zerograph::pack_quantized`` (same
            ``chunk_rows``, ``dtype``, ``block``), rank-major.
        rows: full (unpadded) rows per parameter; row_numels: ``prod(shape[1:])`` per parameter.

    Raises:
        ValueError: lists of different lengths or empty, or ``gathered`` not of the layout's size.
    """
    layout, out, views = _unpack_plan(gathered, world_size, chunk_rows, rows, row_numels, dtype, block)
    unpack_dequantized_reference(gathered, world_size, layout, dtype, views)
    return out


@unpack_dequantized_op.register_kernel("cuda")
def _unpack_dequantized_cuda(gathered, world_size, chunk_rows, rows, row_numels, dtype, block):
    layout, out, views = _unpack_plan(gathered, world_size, chunk_rows, rows, row_numels, dtype, block)
    unpack_dequantized(gathered, world_size, layout, dtype, views)
    return out


@unpack_dequantized_op.register_fake
def _unpack_dequantized_fake(gathered, world_size, chunk_rows, rows, row_numels, dtype, block):
    _, out, _ = _unpack_plan(gathered, world_size, chunk_rows, rows, row_numels, dtype, block)
    return out


# ---------------------------------------------------------------- reduction (qgZ): dequantize + sum

def dequantize_sum_reference(received: torch.Tensor, world_size: int, layout: WireLayout, dtype: torch.dtype,
                             out: torch.Tensor) -> torch.Tensor:
    """Plain-torch :func:`dequantize_sum` (same arguments and result)."""
    _check_sum(received, world_size, layout, out)
    by_rank = received.view(world_size, layout.rank_bytes)  # (N sources, rank_bytes)
    offset = 0
    for i, n in enumerate(layout.shard_numels):
        at = layout.offsets[i]
        if layout.quantized[i]:
            nblocks, s = layout.blocks(i), layout.scale_offsets[i]
            q = by_rank[:, at : at + n].view(torch.int8).to(torch.float32)  # (N, shard_numel)
            scales = by_rank[:, s : s + SCALE_BYTES * nblocks].view(torch.float32)  # (N, blocks)
            q = F.pad(q, [0, nblocks * layout.block - n]).view(world_size, nblocks, layout.block)
            parts = (q * scales[:, :, None]).view(world_size, -1)[:, :n]  # (N, shard_numel) fp32
        else:
            parts = by_rank[:, at : at + n * layout.itemsize].view(dtype).to(torch.float32)  # (N, shard_numel)
        total = torch.zeros(n, dtype=torch.float32, device=received.device)
        for r in range(world_size):  # in rank order, as the kernel adds
            total = total + parts[r]
        out[offset : offset + n].copy_(total)
        offset += n
    return out


def _check_sum(received, world_size: int, layout: WireLayout, out) -> None:
    if world_size < 1:
        raise ValueError(f"dequantize_sum: world_size must be >= 1, got {world_size}")
    if received.dtype != torch.uint8 or received.dim() != 1 or received.numel() != world_size * layout.rank_bytes:
        raise ValueError(f"dequantize_sum: received must be 1-D uint8 of world_size x {layout.rank_bytes} bytes, "
                         f"got {received.dtype} {tuple(received.shape)}")
    total = sum(layout.shard_numels)
    if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != total:
        raise ValueError(f"dequantize_sum: out must be 1-D fp32 of {total} elements, got {out.dtype} {tuple(out.shape)}")
    same_device([received, out], "dequantize_sum")


def dequantize_sum(received: torch.Tensor, world_size: int, layout: WireLayout, dtype: torch.dtype,
                   out: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """Sum, in fp32, the ranks' quantized chunks of this rank's shard (an all-to-all's output).

    Args:
        received: 1-D uint8 of ``world_size * layout.rank_bytes``: source rank ``r``'s buffer
            (its chunk ``this rank`` of every gradient, as :func:`pack_quantized` built it) ``r``-th.
        world_size: ranks N.
        layout: the buffers' ``WireLayout`` (``shard_numels``: this rank's padded shard of each parameter).
        dtype: the dtype raw (small) chunks were sent in.
        out: 1-D fp32 of ``sum(layout.shard_numels)``: parameter ``i``'s padded shard at
            ``sum(shard_numels[:i])``, the sum over ranks (in rank order) of the dequantized chunks.
        use_triton: as :func:`zerograph.kernels.pack`'s.

    Returns:
        ``out``, written.

    Raises:
        ValueError: sizes that do not match the layout, or tensors on several devices.
        TypeError: ``use_triton=True`` with a dtype other than fp32/bf16/fp16 or non-contiguous tensors.
        RuntimeError: Triton forced on CPU tensors without the Triton interpreter.
    """
    tensors = [received, out]
    eligible = dtype in TRITON_FLOAT_DTYPES and all(t.is_contiguous() for t in tensors)
    if not want_triton(tensors, use_triton, eligible, "dtype must be fp32/bf16/fp16 and tensors contiguous"):
        return dequantize_sum_reference(received, world_size, layout, dtype, out)
    _check_sum(received, world_size, layout, out)
    kernels = triton_kernels()
    assert layout.block == kernels.QUANT_BLOCK, "the Triton kernels are built for BLOCK-element blocks"
    check_launchable(kernels._dequantize_sum_kernel, tensors)
    q, s, raw = received.view(torch.int8), received.view(torch.float32), received.view(dtype)
    offset = 0
    for i, n in enumerate(layout.shard_numels):
        at = layout.offsets[i]
        if layout.quantized[i]:
            kernels.launch_dequantize_sum(q, s, out, world_size, layout.rank_bytes, at, layout.scale_offsets[i],
                                          offset, n)
        else:
            kernels.launch_sum_raw(raw, out, world_size, layout.rank_bytes // layout.itemsize, at // layout.itemsize,
                                   offset, n)
        offset += n
    return out


@torch.library.custom_op("zerograph::dequantize_sum", mutates_args=())
def dequantize_sum_op(received: torch.Tensor, world_size: int, chunk_rows: list[int], row_numels: list[int],
                      dtype: torch.dtype, block: int) -> torch.Tensor:
    """The quantized reduce-scatter's copy-out (qgZ): ``received`` holds, from each of
    ``world_size`` ranks in rank order, a ``zerograph::pack_quantized`` chunk of this rank's rows
    of every gradient; returns their sum in fp32, ``(sum_i chunk_rows[i] * row_numels[i],)``,
    parameter ``i``'s padded shard after the ones before it (``reduce_scatter_tensor``'s output layout).

    Raises:
        ValueError: lists of different lengths or empty, or ``received`` not of the layout's size.
    """
    layout = _sum_layout(received, world_size, chunk_rows, row_numels, dtype, block)
    out = received.new_empty(sum(layout.shard_numels), dtype=torch.float32)
    return dequantize_sum_reference(received, world_size, layout, dtype, out)


@dequantize_sum_op.register_kernel("cuda")
def _dequantize_sum_cuda(received, world_size, chunk_rows, row_numels, dtype, block):
    layout = _sum_layout(received, world_size, chunk_rows, row_numels, dtype, block)
    out = received.new_empty(sum(layout.shard_numels), dtype=torch.float32)
    return dequantize_sum(received, world_size, layout, dtype, out)


@dequantize_sum_op.register_fake
def _dequantize_sum_fake(received, world_size, chunk_rows, row_numels, dtype, block):
    layout = _sum_layout(received, world_size, chunk_rows, row_numels, dtype, block)
    return received.new_empty(sum(layout.shard_numels), dtype=torch.float32)


def _sum_layout(received, world_size, chunk_rows, row_numels, dtype, block) -> WireLayout:
    if len(chunk_rows) != len(row_numels) or not row_numels or world_size < 1:
        raise ValueError(f"dequantize_sum: {len(chunk_rows)} chunk_rows and {len(row_numels)} row_numels, world_size "
                         f"{world_size}; pass one of each per parameter, at least one")
    layout = _layout_of(row_numels, chunk_rows, dtype, block)
    if received.dim() != 1 or received.numel() != world_size * layout.rank_bytes:
        raise ValueError(f"dequantize_sum: received must be 1-D of world_size x {layout.rank_bytes} bytes, "
                         f"got {tuple(received.shape)}")
    return layout


PACK_QUANTIZED = torch.ops.zerograph.pack_quantized.default
DEQUANTIZE_SUM = torch.ops.zerograph.dequantize_sum.default
UNPACK_DEQUANTIZED = torch.ops.zerograph.unpack_dequantized.default
