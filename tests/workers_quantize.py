"""Rank workers and a single-process emulation for the quantized all-gather (qwZ).

The emulation (``emulated_training``) is qwZ's arithmetic written independently of the passes:
each step, every parameter is cut into the ranks' ``torch.chunk`` shards, each shard of at least
one block is quantized and dequantized by blocks (``quantize_reference``), the forward and
backward run on those weights over the global batch, and AdamW updates the exact fp32 master
weights with that gradient. zerograph's quantized run must match it to fp32 accuracy (the
gradient is the exact reduction of the full-precision gradient at the dequantized weights).
"""
from __future__ import annotations

import math

import torch
from torch import nn

import zerograph
from tests.distributed import run_case_in_step
from zerograph.kernels.quantize import BLOCK, QMAX, quantize_reference

from .models import build as build_named
from .models import global_batch, rank_slice
from .training import train_steps

STEPS, LR, BATCH = 3, 1e-3, 4


@torch._dynamo.disable
def _run_eagerly(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


class BreakMLP(nn.Module):
    """Linear(24, 48) -> tanh -> Linear(48, 32) in an eager frame (a graph break) -> mean square.
    Each rank's shard of either weight holds at least one block at world size 2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.layers[1](self.layers[0](x))
        return ((_run_eagerly(self.layers[2], h) - y) ** 2).mean()


def build(name: str) -> nn.Module:
    if name == "mlp_break_big":
        torch.manual_seed(0)
        return BreakMLP()
    return build_named(name)


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "mlp_break_big":
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randn(BATCH, 24, generator=g), torch.randn(BATCH, 32, generator=g)
    return global_batch(name, step, BATCH)


def roundtrip(piece: torch.Tensor, shard_numel: int) -> torch.Tensor:
    """``piece`` (one rank's row chunk, flattened, maybe short) through int8 and back, as the
    kernels do with a padded shard of ``shard_numel`` elements; unchanged below one block."""
    if shard_numel < BLOCK:
        return piece.clone()
    q, scales = quantize_reference(piece, shard_numel)
    q = torch.nn.functional.pad(q.float(), [0, scales.numel() * BLOCK - shard_numel])
    return (q.view(-1, BLOCK) * scales[:, None]).view(-1)[: piece.numel()]


def _chunks(p: torch.Tensor, world_size: int) -> tuple[list[torch.Tensor], int]:
    chunk = -(-p.shape[0] // world_size)
    return [p[r * chunk : (r + 1) * chunk].reshape(-1) for r in range(world_size)], chunk * math.prod(p.shape[1:])


def dequantized(p: torch.Tensor, world_size: int) -> torch.Tensor:
    """What the quantized all-gather hands forward for parameter ``p`` (full fp32 tensor)."""
    pieces, shard_numel = _chunks(p, world_size)
    return torch.cat([roundtrip(piece, shard_numel) for piece in pieces]).view(p.shape)


def reduced(grads: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """What the quantized reduce-scatter hands each rank, all ranks' shards together: per
    destination chunk, the fp32 sum in rank order of every rank's dequantized chunk, over N."""
    per_source = [_chunks(g, world_size) for g in grads]  # [(chunks, shard_numel)] per source rank
    out = []
    for d in range(world_size):
        total = torch.zeros_like(per_source[0][0][d])
        for chunks, shard_numel in per_source:
            total = total + roundtrip(chunks[d], shard_numel)
        out.append(total / world_size)
    return torch.cat(out).view(grads[0].shape)


def emulated_training(name: str, world_size: int, gather: bool, reduce: bool) -> dict:
    master = build(name)
    compute = build(name)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    losses, first_grads = [], None
    for step in range(STEPS):
        with torch.no_grad():
            for p, c in zip(master.parameters(), compute.parameters()):
                c.copy_(dequantized(p, world_size) if gather else p)
        per_rank, rank_losses = [], []
        for r in range(world_size):  # each rank's gradient of its own slice
            loss = compute(*rank_slice(batch(name, step), r, world_size))
            loss.backward()
            per_rank.append([c.grad for c in compute.parameters()])
            rank_losses.append(loss.item())
            compute.zero_grad(set_to_none=True)
        for i, p in enumerate(master.parameters()):
            grads = [g[i] for g in per_rank]
            p.grad = reduced(grads, world_size) if reduce else sum(grads[1:], grads[0]) / world_size
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in master.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(sum(rank_losses) / world_size)
    return {"losses": losses, "first_grads": first_grads,
            "params": {n: p.detach().clone() for n, p in master.named_parameters()}}


def plain_first_grads(name: str) -> dict[str, torch.Tensor]:
    """First-step gradients at the unquantized weights (what the emulation must differ from)."""
    model = build(name)
    model(*batch(name, 0)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def train(rank: int, world_size: int, name: str, stage: int, gather: str | None, reduce: str | None) -> dict:
    torch._dynamo.reset()
    config = zerograph.Config(gather_quantization=gather, reduce_quantization=reduce)
    model = zerograph.compile(build(name), stage=stage, config=config)
    seen: dict = {}

    def after_backward(step: int, opt: torch.optim.Optimizer) -> None:
        if step == 0:
            seen["first_grads"] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        seen["stats"] = zerograph.stats(model, opt)

    _, losses = train_steps(model, lambda step: model(*rank_slice(batch(name, step), rank, world_size)),
                            STEPS, LR, after_backward=after_backward)
    return {"losses": losses, "first_grads": seen["first_grads"], "stats": seen["stats"],
            "params": {n: p.full_tensor().clone() for n, p in model.named_parameters()}}


# (model, stage, gather_quantization, reduce_quantization): stage 2 covers gathers kept for backward
# (as stage 1's), the graph-break model the eager fallbacks of both
CASES = (("gpt", 3, None, None), ("gpt", 3, "int8", None), ("gpt", 3, None, "int8"), ("gpt", 2, "int8", "int8"),
         ("mlp_break_big", 3, "int8", "int8"))


def quantize_runs(rank: int, world_size: int) -> dict:
    """Every case of ``CASES`` one after the other; a case that raises returns its traceback."""
    out = {}
    for case in CASES:
        out[case] = run_case_in_step(case, train, rank, world_size, *case)
    return out


__all__ = ["CASES", "QMAX", "STEPS", "dequantized", "reduced", "emulated_training", "plain_first_grads", "quantize_runs"]
