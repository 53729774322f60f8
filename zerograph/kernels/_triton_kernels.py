"""The Triton kernels. Imported lazily by the wrappers in ``adamw.py`` and ``packing.py``.

All kernels are 1-D streaming kernels: each program handles ``BLOCK`` consecutive elements and
offsets are computed in int64 so buffers beyond 2**31 elements are addressed correctly. Casts go
through fp32 so every pair of {fp32, bf16, fp16} converts with one rounding, as ``Tensor.to`` does.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, n,
    decay, lerp_w, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps, scale,
    LERP_LOW: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    # IEEE-rounded div/sqrt (div_rn, sqrt_rn): Triton's defaults are approximate on GPU and the
    # result must track torch.optim.AdamW to ~1 ulp.
    if SCALE_MODE == 1:
        g = tl.div_rn(g, scale)
    elif SCALE_MODE == 2:
        g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
    # Decoupled weight decay is applied to the old parameter, before the Adam update.
    p = p * decay
    # Same two-sided lerp formula as torch.lerp, so the first moment rounds the same way.
    if LERP_LOW:
        m = m + lerp_w * (g - m)
    else:
        m = g - (g - m) * (1.0 - lerp_w)
    v = v * beta2
    v = v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + neg_step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pack_kernel(src_ptr, out_ptr, n, padded, out_offset, BLOCK: tl.constexpr):
    # One shard: out[out_offset + k] = cast(src[k]) for k < n, 0 for n <= k < padded.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
    y = x.to(tl.float32).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_offset + offs, y, mask=offs < padded)


@triton.jit
def _unpack_kernel(src_ptr, dst_ptr, rank_stride, col_offset, shard_numel, numel, BLOCK: tl.constexpr):
    # One parameter; axis 1 is the rank. Rank r's padded chunk sits at src[r*rank_stride + col_offset :
    # ... + shard_numel] and is element range [r*shard_numel, (r+1)*shard_numel) of the full tensor,
    # whose tail beyond `numel` is padding and is dropped.
    pid = tl.program_id(0).to(tl.int64)
    rank = tl.program_id(1).to(tl.int64)
    k = pid * BLOCK + tl.arange(0, BLOCK)
    dst = rank * shard_numel + k
    mask = (k < shard_numel) & (dst < numel)
    x = tl.load(src_ptr + rank * rank_stride + col_offset + k, mask=mask, other=0.0)
    tl.store(dst_ptr + dst, x.to(tl.float32).to(dst_ptr.dtype.element_ty), mask=mask)


ADAMW_BLOCK, ADAMW_WARPS = 1024, 4
COPY_BLOCK, COPY_WARPS = 4096, 8


def launch_adamw(p, g, m, v, out, scale_tensor, scale_value, *, decay, lerp_w, beta2, neg_step_size,
                 bc2_sqrt, eps) -> None:
    n = p.numel()
    if n == 0:
        return
    scale_mode = 0 if scale_tensor is None and scale_value is None else (2 if scale_tensor is not None else 1)
    grid = (triton.cdiv(n, ADAMW_BLOCK),)
    _adamw_kernel[grid](
        p, g, m, v, out if out is not None else p, scale_tensor if scale_tensor is not None else p, n,
        decay, lerp_w, beta2, 1.0 - beta2, neg_step_size, bc2_sqrt, eps,
        1.0 if scale_value is None else scale_value,
        LERP_LOW=lerp_w < 0.5, SCALE_MODE=scale_mode, HAS_OUT=out is not None,
        BLOCK=ADAMW_BLOCK, num_warps=ADAMW_WARPS,
    )


def launch_pack(src, out, padded: int, out_offset: int) -> None:
    if padded == 0:
        return
    grid = (triton.cdiv(padded, COPY_BLOCK),)
    # A 0-element source still needs a valid pointer argument; every load is masked off.
    _pack_kernel[grid](src if src.numel() else out, out, src.numel(), padded, out_offset,
                       BLOCK=COPY_BLOCK, num_warps=COPY_WARPS)


def launch_unpack(src, dst, world_size: int, rank_stride: int, col_offset: int, shard_numel: int) -> None:
    if shard_numel == 0 or dst.numel() == 0:
        return
    grid = (triton.cdiv(shard_numel, COPY_BLOCK), world_size)
    _unpack_kernel[grid](src, dst, rank_stride, col_offset, shard_numel, dst.numel(),
                         BLOCK=COPY_BLOCK, num_warps=COPY_WARPS)


# ------------------------------------------------------------------ block-wise int8 (qwZ gathers)
# One program per quantization block of QUANT_BLOCK elements; must equal kernels.quantize.BLOCK.

@triton.jit
def _quantize_kernel(src_ptr, q_ptr, s_ptr, n, padded, q_offset, s_offset, BLOCK: tl.constexpr):
    # One shard, block `pid`: elements k < n are the shard's, n <= k < padded are zero padding.
    # scale = absmax / 127; q = floor(x * 127 / absmax + 0.5) in [-127, 127] (symmetric; 0 for an
    # all-zero block). IEEE-rounded divisions (div_rn) so compiled Triton matches the reference.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=0)
    den = tl.where(absmax > 0.0, absmax, 1.0)
    y = tl.div_rn(x * 127.0, tl.zeros_like(x) + den)
    q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0)
    tl.store(q_ptr + q_offset + offs, q.to(tl.int8), mask=offs < padded)
    tl.store(s_ptr + s_offset + pid, tl.div_rn(absmax, 127.0))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, dst_ptr, rank_bytes, q_col, s_col, shard_numel, numel, BLOCK: tl.constexpr):
    # One parameter; axis 1 is the rank. Rank r's int8 chunk sits at q[r*rank_bytes + q_col : ... +
    # shard_numel], its fp32 scales at s[(r*rank_bytes + s_col) / 4 + block]; the chunk is element
    # range [r*shard_numel, (r+1)*shard_numel) of the full tensor, whose tail beyond `numel` is padding.
    pid = tl.program_id(0).to(tl.int64)
    rank = tl.program_id(1).to(tl.int64)
    k = pid * BLOCK + tl.arange(0, BLOCK)
    dst = rank * shard_numel + k
    mask = (k < shard_numel) & (dst < numel)
    q = tl.load(q_ptr + rank * rank_bytes + q_col + k, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + (rank * rank_bytes + s_col) // 4 + pid)
    tl.store(dst_ptr + dst, (q * s).to(dst_ptr.dtype.element_ty), mask=mask)


QUANT_BLOCK, QUANT_WARPS = 256, 2


def launch_quantize(src, q, s, padded: int, q_offset: int, s_offset: int) -> None:
    if padded == 0:
        return
    grid = (triton.cdiv(padded, QUANT_BLOCK),)
    _quantize_kernel[grid](src if src.numel() else s, q, s, src.numel(), padded, q_offset, s_offset,
                           BLOCK=QUANT_BLOCK, num_warps=QUANT_WARPS)


def launch_dequantize(q, s, dst, world_size: int, rank_bytes: int, q_col: int, s_col: int, shard_numel: int) -> None:
    if shard_numel == 0 or dst.numel() == 0:
        return
    grid = (triton.cdiv(shard_numel, QUANT_BLOCK), world_size)
    _dequantize_kernel[grid](q, s, dst, rank_bytes, q_col, s_col, shard_numel, dst.numel(),
                             BLOCK=QUANT_BLOCK, num_warps=QUANT_WARPS)


# ------------------------------------------------------ block-wise int8 reduction (qgZ reduce-scatters)

@triton.jit
def _dequantize_sum_kernel(q_ptr, s_ptr, dst_ptr, world_size, rank_bytes, q_col, s_col, dst_offset, shard_numel,
                           BLOCK: tl.constexpr):
    # One parameter, block `pid` of this rank's shard: the sum over source ranks r (in rank order,
    # in fp32) of q_r * scale_r, rank r's int8 chunk at q[r*rank_bytes + q_col ...], its scales at
    # s[(r*rank_bytes + s_col) / 4 + block].
    pid = tl.program_id(0).to(tl.int64)
    k = pid * BLOCK + tl.arange(0, BLOCK)
    mask = k < shard_numel
    q_off = q_col + k
    s_off = s_col // 4 + pid
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(0, world_size):
        q = tl.load(q_ptr + q_off, mask=mask, other=0).to(tl.float32)
        acc += q * tl.load(s_ptr + s_off)
        q_off += rank_bytes
        s_off += rank_bytes // 4
    tl.store(dst_ptr + dst_offset + k, acc, mask=mask)


@triton.jit
def _sum_raw_kernel(src_ptr, dst_ptr, world_size, rank_stride, col, dst_offset, shard_numel, BLOCK: tl.constexpr):
    # One raw (unquantized) parameter: the fp32 sum over source ranks of src[r*rank_stride + col + k].
    pid = tl.program_id(0).to(tl.int64)
    k = pid * BLOCK + tl.arange(0, BLOCK)
    mask = k < shard_numel
    off = col + k
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(0, world_size):
        acc += tl.load(src_ptr + off, mask=mask, other=0.0).to(tl.float32)
        off += rank_stride
    tl.store(dst_ptr + dst_offset + k, acc, mask=mask)


def launch_dequantize_sum(q, s, dst, world_size: int, rank_bytes: int, q_col: int, s_col: int, dst_offset: int,
                          shard_numel: int) -> None:
    if shard_numel == 0:
        return
    grid = (triton.cdiv(shard_numel, QUANT_BLOCK),)
    _dequantize_sum_kernel[grid](q, s, dst, world_size, rank_bytes, q_col, s_col, dst_offset, shard_numel,
                                 BLOCK=QUANT_BLOCK, num_warps=QUANT_WARPS)


def launch_sum_raw(src, dst, world_size: int, rank_stride: int, col: int, dst_offset: int, shard_numel: int) -> None:
    if shard_numel == 0:
        return
    grid = (triton.cdiv(shard_numel, COPY_BLOCK),)
    _sum_raw_kernel[grid](src, dst, world_size, rank_stride, col, dst_offset, shard_numel,
                          BLOCK=COPY_BLOCK, num_warps=COPY_WARPS)
