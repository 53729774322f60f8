"""The tensor functions of zerograph's gathers and reductions: one copy, traced or run
([Note: one collective function, traced and run], below).

Functional collectives (``torch.ops._c10d_functional``) run eagerly as they run in a graph: each
returns at once and ``wait_tensor`` waits. Groups are named by their registered name, so nothing
here holds a process group.

Layer: base (tensors and functional collectives; no graph, no runtime state).

Source: FSDP2's copy-in / all-gather / copy-out and its reduce-scatter copy-in; ZeRO++ (arXiv
2306.10209) sections 3.1 (qwZ) and 3.3 (qgZ).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..graph.ops import ACCUMULATE_UNSYNCED, TAKE_UNSYNCED
from ..kernels.ops import PACK_SHARDS, UNPACK_GATHERED, from_wire, to_wire
from ..kernels.quantize import (
    BLOCK,
    DEQUANTIZE_SUM,
    PACK_QUANTIZED,
    QUANTIZABLE_DTYPES,
    UNPACK_DEQUANTIZED,
    quantizes,
    wire_layout,
)
from ..shard.sharding import ParamLayout

# [Note: one collective function, traced and run]
# Each builder here returns an ordinary tensor function over the parameters of one bucket. The
# passes trace it into the graphs (``insert_allgather`` and ``insert_reduce_scatter`` splice it in
# place of the markers; their docstrings say where and why); the runtime's eager fallback
# (``eager.py``: graph breaks, islands, the gradients a ``no_sync`` run held back) calls the very
# same function on real tensors, one parameter at a time. So a graph and an eager frame move the
# same bytes in the same layout, with the same copy-in and copy-out, the same quantization
# (ZeRO++'s qwZ / qgZ) and the same hybrid-sharding all-reduce across replicas: a change to a
# gather or a reduction is made once.

funcol = torch.ops._c10d_functional

TensorsFn = Callable[..., list[torch.Tensor]]


# -- all-gather of parameters ---------------------------------------------------------------------

def gather_copy_in(shards: tuple[torch.Tensor, ...], layouts: list[ParamLayout]) -> torch.Tensor:
    """This rank's send buffer, ``(sum shard_numel,)`` in ``param_dtype`` (mixed precision sends
    the compute dtype): each shard padded to ``chunk_rows``, flattened, concatenated.

    A bucket of several parameters is one ``zerograph::pack_shards`` node (the Triton pack kernel
    on CUDA: one read and one write per element instead of a cast, a pad and a cat); a single
    parameter keeps the plain ops (often no copy at all)."""
    if len(shards) > 1:
        return PACK_SHARDS(list(shards), [layout.chunk_rows for layout in layouts], 1, layouts[0].param_dtype)
    (shard,), (layout,) = shards, layouts
    shard = shard.to(layout.param_dtype)
    missing = layout.chunk_rows - shard.shape[0]
    padded = F.pad(shard, [0, 0] * (shard.dim() - 1) + [0, missing]) if missing else shard
    return padded.reshape(-1)


def gather_copy_out(gathered: torch.Tensor, layouts: list[ParamLayout], world_size: int) -> list[torch.Tensor]:
    """Every full parameter of the bucket from the gathered buffer ``(N * sum shard_numel,)``,
    rank-major.

    A bucket of several parameters is one ``zerograph::unpack_gathered`` node (the Triton unpack
    kernel on CUDA): one new buffer, parameter-major and unpadded, of which each parameter is a
    slice and a view, so the gathered buffer dies right after it (FSDP2's copy-out). A single
    parameter keeps views of the gathered buffer: its rank chunks are whole rows of the buffer, so
    the ``reshape`` and the ``[:rows]`` that drops the padding copy nothing."""
    if len(layouts) > 1:
        rows = [layout.shape[0] for layout in layouts]
        flat = UNPACK_GATHERED(gathered, world_size, [layout.chunk_rows for layout in layouts], rows,
                               [layout.row_numel for layout in layouts])  # (sum numel,)
        return _split_params(flat, layouts)
    (layout,) = layouts
    block = gathered.view(world_size, -1)[:, : layout.shard_numel]  # (N, chunk_rows * row_numel)
    full = block.reshape(world_size * layout.chunk_rows, *layout.shape[1:])
    return [full[: layout.shape[0]]]


def _split_params(flat: torch.Tensor, layouts: list[ParamLayout]) -> list[torch.Tensor]:
    """Each parameter of a parameter-major buffer ``(sum numel,)``: a slice and a view."""
    outs, offset = [], 0
    for layout in layouts:
        outs.append(flat[offset : offset + layout.numel].view(layout.shape))
        offset += layout.numel
    return outs


def _quantized_gather_fn(layouts: list[ParamLayout], world_size: int, group_name: str) -> TensorsFn:
    """qwZ: the copy-in quantizes each shard by blocks (``zerograph::pack_quantized``: int8 values
    and fp32 scales in one uint8 send buffer, small shards raw), the all-gather moves those bytes,
    the copy-out dequantizes each rank's chunk with its own scales into ``param_dtype``
    (``zerograph::unpack_dequantized``), parameter-major, then a slice and a view per parameter."""
    dtype = layouts[0].param_dtype
    chunk_rows = [layout.chunk_rows for layout in layouts]

    def gather(*shards: torch.Tensor) -> list[torch.Tensor]:
        send = PACK_QUANTIZED(list(shards), chunk_rows, 1, dtype, BLOCK)  # (rank_bytes,) uint8
        gathered = funcol.wait_tensor(funcol.all_gather_into_tensor(send, world_size, group_name))
        flat = UNPACK_DEQUANTIZED(gathered, world_size, chunk_rows, [layout.shape[0] for layout in layouts],
                                  [layout.row_numel for layout in layouts], dtype, BLOCK)  # (sum numel,)
        return _split_params(flat, layouts)

    return gather


def gather_fn(layouts: list[ParamLayout], world_size: int, group_name: str,
              quantization: str | None = None) -> TensorsFn:
    """``(*shards) -> [full parameter, ...]``: one all-gather of a bucket of sharded parameters
    over the ``world_size`` ranks of the group named ``group_name``, quantized (qwZ) when
    ``quantization`` is set and the bucket holds a block. Shards: ``(local_rows, *rest)`` in the
    parameters' dtype; full parameters: ``layout.shape`` in ``param_dtype``."""
    if quantization is not None and quantizes([layout.shard_numel for layout in layouts], layouts[0].param_dtype):
        return _quantized_gather_fn(layouts, world_size, group_name)

    def gather(*shards: torch.Tensor) -> list[torch.Tensor]:
        send = gather_copy_in(shards, layouts)  # (sum shard_numel,)
        # complex and bool travel as reals / bytes (to_wire), come back as themselves
        gathered = funcol.all_gather_into_tensor(to_wire(send), world_size, group_name)
        gathered = from_wire(funcol.wait_tensor(gathered), send.dtype)  # (N * sum shard_numel,)
        return gather_copy_out(gathered, layouts, world_size)

    return gather


def cast_fn(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """No communication (stage 0, world size 1): the shard is the parameter, cast to ``dtype``."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    return cast


# -- reduction of gradients -----------------------------------------------------------------------

def reduce_copy_in(grads: tuple[torch.Tensor, ...], layouts: list[ParamLayout], world_size: int,
                   scatter: bool) -> torch.Tensor:
    """The bucket's send buffer in ``reduce_dtype``. Reduce-scatter: ``(N * sum shard_numel,)``,
    each full gradient padded to ``N * chunk_rows`` rows and the rank chunks side by side, so rank
    ``r`` receives its rows of every gradient; all-reduce: the flattened gradients concatenated.

    A bucket of several parameters is one ``zerograph::pack_shards`` node (the Triton pack kernel
    on CUDA, casting on the fly); a single parameter keeps the plain ops (often no copy at all)."""
    dtype = layouts[0].reduce_dtype  # group_markers keeps one reduce_dtype per bucket
    if len(grads) > 1:
        if scatter:
            return PACK_SHARDS(list(grads), [layout.chunk_rows for layout in layouts], world_size, dtype)
        flat = [g.reshape(-1) for g in grads]  # 0-d parameters too: pack cuts rows on dim 0
        return PACK_SHARDS(flat, [layout.numel for layout in layouts], 1, dtype)
    (grad,), (layout,) = grads, layouts
    grad = grad.to(dtype)
    if not scatter:
        return grad.reshape(-1)
    missing = world_size * layout.chunk_rows - grad.shape[0]
    padded = F.pad(grad, [0, 0] * (grad.dim() - 1) + [0, missing]) if missing else grad
    return padded.reshape(-1)  # (N * chunk numel,)


def quantized_reduce_scatter(grads: tuple[torch.Tensor, ...], layouts: list[ParamLayout], world_size: int,
                             group_name: str) -> torch.Tensor:
    """qgZ in one hop: ``(sum shard_numel,)`` fp32, the sum over ranks of this rank's rows of each
    gradient, as ``reduce_scatter_tensor`` returns them. Copy-in ``zerograph::pack_quantized``
    (chunk ``r`` of every gradient quantized for rank ``r``), one ``all_to_all_single`` of those
    bytes, copy-out ``zerograph::dequantize_sum`` (the N received chunks dequantized, summed in fp32).

    Why an all-to-all and not a quantized ring: a ring reduce-scatter would dequantize, add and
    re-quantize at each of its N - 1 hops (N - 1 quantization errors, and a kernel per hop); the
    all-to-all sends each rank the same (N-1)/N of the buffer in one hop, quantized once. ZeRO++'s
    hierarchical version (intra-node, then inter-node) only changes which links carry it."""
    dtype, chunk_rows = layouts[0].reduce_dtype, [layout.chunk_rows for layout in layouts]
    rank_bytes = wire_layout([layout.shard_numel for layout in layouts], dtype.itemsize).rank_bytes
    send = PACK_QUANTIZED(list(grads), chunk_rows, world_size, dtype, BLOCK)  # (N * rank_bytes,) uint8
    splits = [rank_bytes] * world_size
    received = funcol.wait_tensor(funcol.all_to_all_single(send, splits, splits, group_name))
    return DEQUANTIZE_SUM(received, world_size, chunk_rows, [layout.row_numel for layout in layouts], dtype, BLOCK)


def quantizes_reduction(layouts: list[ParamLayout], quantization: str | None, scatter: bool) -> bool:
    """Whether ``reduce_fn`` reduces this bucket quantized (qgZ): a reduce-scatter of float
    gradients of which one shard holds a block."""
    return (quantization is not None and scatter and all(layout.param_dtype in QUANTIZABLE_DTYPES for layout in layouts)
            and quantizes([layout.shard_numel for layout in layouts], layouts[0].reduce_dtype))


def reduce_fn(keys: list[int], layouts: list[ParamLayout], local_rows: list[int], world_size: int,
              group_name: str, scatter: bool, flush: bool, replicate_group: tuple[str, int] | None = None,
              quantization: str | None = None) -> TensorsFn:
    """``(*full grads) -> [this rank's averaged shard, ...]``: one reduction of a bucket over the
    group named ``group_name`` (``world_size`` ranks): a reduce-scatter (``scatter``; quantized,
    qgZ, under ``quantizes_reduction``) or an all-reduce, then, under hybrid sharding
    (``replicate_group``: ``(name, size)``), an all-reduce of the result across replicas, then the
    division by N = ``world_size`` x replicas. ``flush``: first add the gradients a ``no_sync`` run
    held for ``keys`` (``zerograph::take_unsynced``). Shards: ``local_rows`` rows each (any value
    when not ``scatter``: the whole gradient), in the parameters' dtype."""
    quantized = quantizes_reduction(layouts, quantization, scatter)

    def reduce(*grads: torch.Tensor) -> list[torch.Tensor]:
        if flush:  # add what the unsynced micro-batches accumulated (already in reduce_dtype)
            grads = tuple(TAKE_UNSYNCED(g, k) for g, k in zip(grads, keys))
        if quantized:  # Config.reduce_quantization: fp32 sums of int8 chunks
            out = quantized_reduce_scatter(grads, layouts, world_size, group_name)
            moved = out.dtype
        else:
            send = reduce_copy_in(grads, layouts, world_size, scatter)
            if scatter:  # complex reduces as its real view (to_wire): the sum of each part
                out = funcol.wait_tensor(funcol.reduce_scatter_tensor(to_wire(send), "sum", world_size, group_name))
            else:
                out = funcol.wait_tensor(funcol.all_reduce(to_wire(send), "sum", group_name))
            moved = send.dtype
        replicas = 1
        if replicate_group is not None:  # hybrid sharding: the reduced shard summed across replicas
            replicate_name, replicas = replicate_group
            out = funcol.wait_tensor(funcol.all_reduce(out, "sum", replicate_name))
        out = from_wire(out, moved) / (world_size * replicas)
        shards, offset = [], 0
        for layout, rows in zip(layouts, local_rows):
            size = layout.shard_numel if scatter else layout.numel
            chunk = out[offset : offset + size]
            chunk = chunk.view(-1, *layout.shape[1:])[:rows] if scatter else chunk.view(layout.shape)
            # own storage (the flat bucket dies here), in the shard's dtype (the master's, for .grad)
            shards.append(chunk.clone() if chunk.dtype == layout.dtype else chunk.to(layout.dtype))
            offset += size
        return shards

    return reduce


def accumulate_fn(keys: list[int]) -> TensorsFn:
    """``(*full grads) -> [zeros of each shard]``: gradient sync off, each gradient added to the
    runtime's buffer of its key (``zerograph::accumulate_unsynced``); no collective."""
    def accumulate(*grads: torch.Tensor) -> list[torch.Tensor]:
        return [ACCUMULATE_UNSYNCED(g, k) for g, k in zip(grads, keys)]

    return accumulate


def sum_fn(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """Sum a tied parameter's gradients in ``dtype`` (its reduce dtype: no 16-bit sum of 16-bit parts)."""
    def total(*grads: torch.Tensor) -> torch.Tensor:
        return sum((g.to(dtype) for g in grads[1:]), grads[0].to(dtype))

    return total


def round_through_reduce_dtype(layout: ParamLayout) -> Callable[[torch.Tensor], torch.Tensor]:
    """World size 1: the gradient cast through ``reduce_dtype`` to the parameter's dtype, as the
    reduction would round it."""
    def cast(g: torch.Tensor) -> torch.Tensor:
        return g.to(layout.reduce_dtype).to(layout.dtype)

    return cast
