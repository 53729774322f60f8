"""Model patterns (shared, frozen and unused parameters, several forwards per backward...) and the
functions that train them (on spawned ranks, or as the reference).

Each pattern is a model plus how one training step computes its loss from a global batch. The
reference (``reference``) trains the model single-process and eagerly on the global batch; the
worker (``train_patterns``, run by ``tests.distributed.spawn``) compiles a fresh model per stage,
trains it on this rank's slice of the same batches, and returns plain data for the tests.

Sizes are mostly odd (9, 7, 5, 3, 1 rows), so that most shards are padded at world size 2 and a
parameter with one row leaves rank 1 an empty shard.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import zerograph
from tests.distributed import run_case_in_step, timed
from zerograph.runtime.state import graphs_of, runtime_of_model

from .models import rank_slice
from .training import train_steps

D = 9  # hidden width: odd, so every (D, ...) parameter is padded at world size 2


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# -- 1. shared parameters ------------------------------------------------------------------------

class TiedEnds(nn.Module):
    """The last layer's weight and bias are the first layer's (one ``nn.Parameter`` used by two
    ``nn.Linear`` modules in different units; layers.2 owns no parameter of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)])
        self.layers[2].weight = self.layers[0].weight
        self.layers[2].bias = self.layers[0].bias

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h))
        return _mse(self.layers[2](h), y)


class Parent(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.own = nn.Linear(D, D)
        self.shared = shared

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.tanh(self.own(h))))


class SharedSubmodule(nn.Module):
    """One ``nn.Linear`` held by two parents (two units) and called through both."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(D, D)
        self.parents = nn.ModuleList([Parent(shared), Parent(shared)])
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for parent in self.parents:
            h = parent(h)
        return _mse(self.head(h), y)


# -- 2. frozen parameters (LoRA) -----------------------------------------------------------------

class LoRALinear(nn.Module):
    """Frozen base Linear plus trainable low-rank adapters, all in one unit."""

    def __init__(self, d_in: int, d_out: int, r: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, r, bias=False)
        self.lora_b = nn.Linear(r, d_out, bias=False)  # not zero-initialised: every adapter moves at step 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRANet(nn.Module):
    """Units: two LoRA blocks (frozen + trainable) and a wholly frozen Linear between them; the
    root unit holds a frozen input projection and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(7, D).requires_grad_(False)
        self.blocks = nn.ModuleList([LoRALinear(D, D, 3), nn.Linear(D, D).requires_grad_(False), LoRALinear(D, D, 3)])
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return _mse(self.head(h), y)


# -- 3. unused parameters ------------------------------------------------------------------------

class TwoEncoders(nn.Module):
    """Encoder ``which`` (a Python int, so one graph per encoder) runs; the other one and its
    root-unit scale get no gradient that step. Each encoder is a unit; the head is shared."""

    def __init__(self) -> None:
        super().__init__()
        self.encoders = nn.ModuleList([nn.Sequential(nn.Linear(7, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(2)])
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(D)) for _ in range(2)])
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, which: int) -> torch.Tensor:
        h = torch.tanh(self.encoders[which](x) * self.scales[which])
        return _mse(self.head(h), y)


# -- 4. several forwards, one backward; one layer applied several times -----------------------------

class Stack(nn.Module):
    """Returns an output, not a loss: the step calls it twice and sums (two forwards, one backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(7, D), nn.Linear(D, D), nn.Linear(D, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h))
        return self.layers[2](h)


class LoopBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            h = torch.tanh(self.layer(h))
        return h


class LoopNet(nn.Module):
    """Each block applies its one Linear three times; the root unit holds the input and the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, D)
        self.blocks = nn.ModuleList([LoopBlock(), LoopBlock()])
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return _mse(self.head(h), y)


# -- 5. gradient clipping ------------------------------------------------------------------------

class ClipNet(nn.Module):
    """Rows 5, 3 and 1: every shard padded, and rank 1 holds empty shards of the last Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _mse(self.layers(x), y)


# -- patterns ------------------------------------------------------------------------------------

def _batch_xy(y_dim: int, in_dim: int = 7) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(step: int, size: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randn(size, in_dim, generator=g), torch.randn(size, y_dim, generator=g)
    return make


def _call(model: nn.Module, batch: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    return model(*batch)


def _call_alternating(model: nn.Module, batch: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    return model(*batch, step % 2)


def _call_twice(model: nn.Module, batch: tuple[torch.Tensor, ...], step: int) -> torch.Tensor:
    x1, x2 = batch
    return model(x1).mean() + model(x2).mean()


@dataclasses.dataclass(frozen=True)
class Pattern:
    model: type[nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, ...]]  # (step, global batch size) -> tensors
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...], int], torch.Tensor] = _call
    clip: float | None = None  # max_norm for clip_grad_norm_ before each step


PATTERNS = {
    "tied_ends": Pattern(TiedEnds, _batch_xy(D, in_dim=D)),
    "shared_submodule": Pattern(SharedSubmodule, _batch_xy(3, in_dim=D)),
    "lora": Pattern(LoRANet, _batch_xy(3)),
    "alternating_encoders": Pattern(TwoEncoders, _batch_xy(3), _call_alternating),
    "two_forwards": Pattern(Stack, _batch_xy(7), _call_twice),  # (x1, x2): both inputs of width 7
    "layer_loop": Pattern(LoopNet, _batch_xy(3)),
    "clip": Pattern(ClipNet, _batch_xy(1), clip=0.05),
}

STEPS, LR, BATCH = 3, 1e-3, 4


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return PATTERNS[name].model()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _ties(model: nn.Module) -> list[list[str]]:
    """Names sharing one parameter object: ``[[first name, other names...], ...]`` in module order."""
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    return [names for names in groups.values() if len(names) > 1]


def reference(name: str, steps: int = STEPS, batch_size: int = BATCH, lr: float = LR) -> dict:
    """Single-process eager AdamW on the global batch (the ground truth)."""
    pattern = PATTERNS[name]
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms, grad_none = [], [], []
    for step in range(steps):
        loss = pattern.loss(model, pattern.batch(step, batch_size), step)
        loss.backward()
        grad_none.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        if pattern.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), pattern.clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "grad_none": grad_none,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "opt_state": sorted(n for n, p in model.named_parameters() if p in opt.state),
            "ties": _ties(model)}


def _train(name: str, stage: int, rank: int, world_size: int, steps: int, batch_size: int, lr: float) -> dict:
    pattern = PATTERNS[name]
    model = zerograph.compile(build(name), stage=stage)
    norms, grad_none, grad_types, last = [], [], set(), {}

    def after_backward(step: int, opt: torch.optim.Optimizer) -> None:
        grad_none.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        grad_types.update(type(p.grad).__name__ for p in model.parameters() if p.grad is not None)
        if pattern.clip is not None:
            norms.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), pattern.clip)).item())
        if step == steps - 1:
            last["stats"] = zerograph.stats(model, opt)

    opt, losses = train_steps(model, lambda step: pattern.loss(
        model, rank_slice(pattern.batch(step, batch_size), rank, world_size), step), steps, lr,
        after_backward=after_backward)
    stats = last["stats"]
    runtime = runtime_of_model(model)
    return {
        "losses": losses,
        "norms": norms,
        "grad_none": grad_none,
        "grad_types": sorted(grad_types),
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "opt_state": sorted(n for n, p in model.named_parameters() if p in opt.state),
        "stats": stats,
        "padded_numel": {layout.fqn: layout.padded_numel for layout in runtime.layouts.values()},
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        "ties": _ties(model),
        "graphs": len(graphs_of(model)),
    }


def train_patterns(rank: int, world_size: int, names: tuple[str, ...], stages: tuple[int, ...],
                   steps: int = STEPS, batch_size: int = BATCH, lr: float = LR) -> dict:
    """``{(name, stage): result dict (with its ``seconds``), or the traceback of a failure}``: one
    fresh model per pattern and stage, compiled and trained one after the other in this process."""
    out: dict = {}
    for name in names:
        for stage in stages:
            out[name, stage] = run_case_in_step((name, stage), timed, _train, name, stage, rank, world_size, steps,
                                                batch_size, lr)
    return out
