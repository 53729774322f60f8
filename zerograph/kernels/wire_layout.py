"""The byte layout of a quantized collective's buffer (ZeRO++'s qwZ and qgZ; the kernels are
``quantize.py``): where each parameter's raw shard, scales and int8 payload sit, and which
buckets are worth quantizing.

One rank's buffer (``rank_bytes`` bytes, a multiple of 4; the gathered or received buffer is
``world_size`` of them, rank-major)::

    [ raw: small shards in `dtype` | pad to 4 | scales: fp32, one per block | int8 payload | pad to 4 ]

A parameter whose padded shard holds at least one block is quantized, in blocks that start at
the shard's first element; a smaller one is sent raw, in ``dtype`` (quantize.py says why).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ._common import TRITON_FLOAT_DTYPES

QUANTIZATIONS = ("int8",)  # Config.gather_quantization's and reduce_quantization's values besides None
BLOCK = 256  # elements per quantization block (one fp32 scale each); the Triton kernels' QUANT_BLOCK
SCALE_BYTES = 4  # fp32 scales
QMAX = 127.0  # symmetric int8: [-127, 127], -128 unused
QUANTIZABLE_DTYPES = TRITON_FLOAT_DTYPES  # fp32, bf16, fp16: what the kernels read and write


def align4(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 4 (the buffer's sections start 4-aligned for the fp32 scales)."""
    return -(-nbytes // 4) * 4


@dataclasses.dataclass(frozen=True)
class WireLayout:
    """Where each parameter's bytes sit in one rank's quantized send buffer (the module docstring's picture).

    Attributes:
        shard_numels: per parameter, elements of its padded shard (``chunk_rows * row_numel``).
        itemsize: bytes per element of ``dtype`` (the raw shards' dtype), at most 4.
        block: elements per quantization block.
        quantized: per parameter, whether it is sent as int8 (``shard_numel >= block``).
        offsets: per parameter, the byte offset of its data in the rank's chunk: the raw shard,
            or the int8 payload.
        scale_offsets: per parameter, the byte offset of its first fp32 scale (``-1`` for raw).
        rank_bytes: bytes of one rank's send buffer, a multiple of 4.
    """

    shard_numels: tuple[int, ...]
    itemsize: int
    block: int
    quantized: tuple[bool, ...]
    offsets: tuple[int, ...]
    scale_offsets: tuple[int, ...]
    rank_bytes: int

    def blocks(self, i: int) -> int:
        return -(-self.shard_numels[i] // self.block)


def wire_layout(shard_numels: Sequence[int], itemsize: int, block: int = BLOCK) -> WireLayout:
    """The send-buffer layout of a bucket whose shards have ``shard_numels`` padded elements."""
    if block < 1:
        raise ValueError(f"wire_layout: block must be >= 1 element, got {block}")
    if itemsize not in (1, 2, 4):
        raise ValueError(f"wire_layout: raw shards need an itemsize of 1, 2 or 4 bytes, got {itemsize}")
    numels = tuple(int(n) for n in shard_numels)
    quantized = tuple(n >= block for n in numels)
    offsets, scale_offsets = [-1] * len(numels), [-1] * len(numels)
    raw = 0
    for i, n in enumerate(numels):
        if not quantized[i]:
            offsets[i], raw = raw, raw + n * itemsize
    scales = align4(raw)
    for i, n in enumerate(numels):
        if quantized[i]:
            scale_offsets[i], scales = scales, scales + SCALE_BYTES * -(-n // block)
    payload = scales
    for i, n in enumerate(numels):
        if quantized[i]:
            offsets[i], payload = payload, payload + n
    return WireLayout(numels, itemsize, block, quantized, tuple(offsets), tuple(scale_offsets), align4(payload))


def quantizes(shard_numels: Sequence[int], dtype: torch.dtype, block: int = BLOCK) -> bool:
    """Whether a bucket of ``dtype`` shards is worth a quantized all-gather: a float dtype the
    kernels handle (fp32, bf16, fp16) and at least one shard of a block or more. Otherwise the
    all-gather moves ``dtype`` as without quantization (integer, bool, complex, fp64 untouched)."""
    return dtype in QUANTIZABLE_DTYPES and any(int(n) >= block for n in shard_numels)
