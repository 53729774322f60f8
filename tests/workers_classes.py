"""Rank worker for the correctness classes (``tests/test_correctness_classes.py``).

One spawned phase runs every multi-rank case, one after the other (``torch._dynamo.reset()``
between them); a case that raises returns its traceback instead, so it fails only its own test.
Each case trains a model compiled by zerograph on this rank's slice of a global batch and an
eager copy of it, in this process, on the whole global batch (the loss a mean over rows, so the
ranks' averaged gradients are the global batch's), and returns plain data for the test to compare.
The dtype matrix feeds the eager copy the global batch as the ranks' slices (one loss, one
backward), so that 16-bit blocks upstream do not blur the comparison of float64 ones.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zerograph
from tests.distributed import run_case_in_step
from zerograph.runtime.state import runtime_of_model, state_of

STEPS, LR, ROWS = 2, 0.1, 4  # SGD steps, learning rate, rows of the global batch


def _guarded(fn: Callable[..., object], *args: object) -> object:
    torch._dynamo.reset()  # a fresh model per case: Dynamo keeps at most 8 graphs per code object
    return run_case_in_step((fn.__name__, *args[2:]), fn, *args)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


# ------------------------------------------------------------------------------ 3: every dtype
class DtypeBlock(nn.Module):
    """A block whose weight (5 rows: uneven over 2 ranks, so padded) has the case's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5, dtype=torch.float64).to(dtype) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) if not self.w.is_complex() else x @ self.w


class MixedBlock(nn.Module):
    """Every dtype in one unit: fp32, complex64 and float64 trainable, int64 and bool frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.w32 = nn.Parameter(torch.randn(5, 5) / 3)
        self.wc = nn.Parameter(torch.randn(5, 5, dtype=torch.complex64) / 3)
        self.b64 = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.shift = nn.Parameter(torch.arange(5), requires_grad=False)  # int64
        self.mask = nn.Parameter(torch.tensor([True, False, True, True, False]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w32) * self.mask + self.shift / 10  # (B, 5) fp32
        c = h.to(torch.complex64) @ self.wc  # (B, 5) complex64
        return (c.abs().double() + self.b64).float()


class EveryDtype(nn.Module):
    """One unit per dtype (each pooled: non-root units) and one unit holding every dtype."""

    DTYPES = (torch.complex64, torch.complex128, torch.float64, torch.float16, torch.bfloat16)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DtypeBlock(d) for d in self.DTYPES] + [MixedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 5) fp32
        for block, dtype in zip(self.blocks, (*self.DTYPES, torch.float32)):
            h = block(x.to(dtype))
            x = h.abs().float() if h.is_complex() else h.float()
        return x.mean()


def _dtype_case(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = EveryDtype()
    batch = torch.randn(ROWS, 5)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    # the pool asked for: its byte slots serve every dtype (what "pooled" checks)
    compiled = zerograph.compile(model, stage=stage, config=zerograph.Config(
        memory=zerograph.MemoryPolicy(pool_comm_buffers=True)))
    opt = torch.optim.SGD([p for p in compiled.parameters() if p.requires_grad], lr=LR)
    mine = batch.chunk(world)[rank]
    for _ in range(STEPS):
        compiled(mine).backward()
        opt.step()
        opt.zero_grad()
        # the global batch as the ranks' slices, summed in one eager backward: the same per-row
        # kernels as the ranks, so only the gradient sum's order differs (÷ world is exact)
        (sum(reference(chunk) for chunk in batch.chunk(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ours = {n: full(p) for n, p in compiled.named_parameters()}
    theirs = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return {"ours": ours, "reference": theirs, "pooled": runtime_of_model(compiled).buffer_pool.allocations}


# ------------------------------------------------------------ 5: gradients that never reach the loss
class SideBlock(nn.Module):
    """A unit in which one layer's output is discarded: a bucket with gradients for some parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux(x)  # ran, but the loss never reads it
        return torch.tanh(self.main(x))


class SometimesHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SideBlock(), SideBlock()])
        self.side = nn.Linear(4, 4)  # root unit, output discarded
        self.head = nn.Linear(4, 1)  # used on some steps only

    def forward(self, x: torch.Tensor, use_head: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        self.side(x)
        return self.head(x).mean() if use_head else x.mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()}


def unused_case(rank: int, world: int, stage: int, config: zerograph.Config | None = None) -> dict:
    """Three AdamW steps (weight decay on: a zero gradient would decay, ``None`` skips): without
    the head; two micro-batches, the first unsynced and the only one using the head; without the
    head again. Records every parameter's gradient after each step's backward, and what the
    runtime still holds unsynced at the end. Three graphs (sync, accumulate, flush) per model,
    the fewest that cover the class."""
    torch.manual_seed(0)
    model = SometimesHead()
    batch = torch.randn(ROWS, 4)
    reference = copy.deepcopy(model)
    compiled = zerograph.compile(model, stage=stage, config=config)
    runs = []
    for net, x in ((compiled, batch.chunk(world)[rank]), (reference, batch)):
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        grads = []
        for step in range(3):
            if step == 1:
                with compiled.no_sync() if net is compiled else contextlib.nullcontext():
                    net(x, True).backward()
            net(x, False).backward()
            grads.append(_grads(net))
            opt.step()
            opt.zero_grad()
        held = sorted(runtime_of_model(compiled).grad_buffers.unsynced) if net is compiled else []
        runs.append({"grads": grads, "params": {n: full(p) for n, p in net.named_parameters()}, "held": held})
    return {"ours": runs[0], "reference": runs[1],
            "inline_reasons": [kind.inline_reason for kind in state_of(compiled).unit_kinds]}


def classes_runs(rank: int, world: int, parts: tuple[str, ...] = ("dtype", "unused")) -> dict:
    """Every multi-rank case of ``test_correctness_classes``: ``{case: result or traceback}``."""
    out: dict = {}
    for stage in (0, 1, 2, 3):
        if "dtype" in parts:
            out["dtype", stage] = _guarded(_dtype_case, rank, world, stage)
        if "unused" in parts:
            out["unused", stage] = _guarded(unused_case, rank, world, stage)
    dist.barrier()
    return out
