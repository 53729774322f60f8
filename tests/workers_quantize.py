"""Rank workers and a single-process emulation for the quantized all-gather (qwZ, issue 21 part 3).

The emulation (``emulated_training``) is qwZ's arithmetic written independently of the passes:
each step, every parameter is cut into the ranks' ``torch.chunk`` shards, each shard of at least
one block is quantized and dequantized by blocks (``quantize_reference``), the forward and
backward run on those weights over the global batch, and AdamW updates the exact fp32 master
weights with that gradient. zerograph's quantized run must match it to fp32 accuracy (the
gradient is the exact reduction of the full-precision gradient at the dequantized weights).
"""
from __future__ import annotations

import math
import traceback

import torch
from torch import nn

import zerograph
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


def dequantized(p: torch.Tensor, world_size: int) -> torch.Tensor:
    """What the quantized all-gather hands forward for parameter ``p`` (full fp32 tensor)."""
    rows = p.shape[0]
    chunk = -(-rows // world_size)
    row_numel = math.prod(p.shape[1:])
    shard_numel = chunk * row_numel
    if shard_numel < BLOCK:
        return p.clone()  # small shards travel unquantized
    pieces = []
    for r in range(world_size):
        piece = p[r * chunk : (r + 1) * chunk].reshape(-1)  # may be short or empty
        q, scales = quantize_reference(piece, shard_numel)
        q = torch.nn.functional.pad(q.float(), [0, scales.numel() * BLOCK - shard_numel])
        pieces.append((q.view(-1, BLOCK) * scales[:, None]).view(-1)[: piece.numel()])
    return torch.cat(pieces).view(p.shape)


def emulated_training(name: str, world_size: int) -> dict:
    master = build(name)
    compute = build(name)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    losses, first_grads = [], None
    for step in range(STEPS):
        with torch.no_grad():
            for p, c in zip(master.parameters(), compute.parameters()):
                c.copy_(dequantized(p, world_size))
        loss = compute(*batch(name, step))
        loss.backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad, c.grad = c.grad, None
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in master.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "first_grads": first_grads,
            "params": {n: p.detach().clone() for n, p in master.named_parameters()}}


def plain_first_grads(name: str) -> dict[str, torch.Tensor]:
    """First-step gradients at the unquantized weights (what the emulation must differ from)."""
    model = build(name)
    model(*batch(name, 0)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def train(rank: int, world_size: int, name: str, stage: int, quantization: str | None) -> dict:
    torch._dynamo.reset()
    model = zerograph.compile(build(name), stage=stage, config=zerograph.Config(gather_quantization=quantization))
    seen: dict = {}

    def after_backward(step: int, opt: torch.optim.Optimizer) -> None:
        if step == 0:
            seen["first_grads"] = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        seen["stats"] = zerograph.stats(model, opt)

    _, losses = train_steps(model, lambda step: model(*rank_slice(batch(name, step), rank, world_size)),
                            STEPS, LR, after_backward=after_backward)
    return {"losses": losses, "first_grads": seen["first_grads"], "stats": seen["stats"],
            "params": {n: p.full_tensor().clone() for n, p in model.named_parameters()}}


CASES = (("gpt", 3, None), ("gpt", 3, "int8"), ("gpt", 1, "int8"), ("mlp_break_big", 3, "int8"))


def quantize_runs(rank: int, world_size: int) -> dict:
    """Every case of ``CASES`` one after the other; a case that raises returns its traceback."""
    out = {}
    for case in CASES:
        try:
            out[case] = train(rank, world_size, *case)
        except Exception:
            out[case] = traceback.format_exc()
    return out


__all__ = ["CASES", "QMAX", "STEPS", "dequantized", "emulated_training", "plain_first_grads", "quantize_runs"]
