"""Models and batches shared by the tests; the reference is always single-process eager."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerograph.models.gpt import GPT, GPTConfig

TINY_GPT = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)
DEEP_GPT = GPTConfig(block_size=16, n_layer=8, n_head=2, n_embd=16)  # units small beside Ψ
MID_GPT = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=16)  # more blocks than prefetch depth 2 keeps in flight


class UnevenMLP(nn.Module):
    """Sizes not divisible by 2 or 3, so every shard needs padding: Linear(7,5) -> Linear(5,3)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.layers(x) - y) ** 2).mean()


@torch._dynamo.disable
def _run_eagerly(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


class GraphBreakMLP(UnevenMLP):
    """The last Linear runs in an eager frame between two compiled ones (a graph break)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.layers[1](self.layers[0](x))
        out = _run_eagerly(self.layers[2], h)
        return ((out - y) ** 2).mean()


class ScaledMLP(UnevenMLP):
    """A 0-d learned scale in the root unit (CLIP's logit_scale pattern): replicated, all-reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.scale * self.layers(x) - y) ** 2).mean()


class CheckpointedGPT(GPT):
    """The GPT with each block under ``torch.utils.checkpoint`` (non-reentrant), as a user trades
    activation memory for a second forward of each block in backward."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(TINY_GPT)
    if name == "gpt_checkpointed":
        return CheckpointedGPT(TINY_GPT)
    if name == "gpt_deep":
        return GPT(DEEP_GPT)
    if name == "gpt_mid":
        return GPT(MID_GPT)
    if name == "mlp":
        return UnevenMLP()
    if name == "mlp_break":
        return GraphBreakMLP()
    if name == "mlp_scalar":
        return ScaledMLP()
    raise KeyError(name)


def global_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if name.startswith("gpt"):
        x = torch.randint(0, TINY_GPT.vocab_size, (size, TINY_GPT.block_size), generator=g)
        return x, torch.roll(x, -1, dims=1)
    return torch.randn(size, 7, generator=g), torch.randn(size, 3, generator=g)  # the MLPs


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    per = batch[0].shape[0] // world_size
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def reference_training(name: str, steps: int, batch_size: int, lr: float) -> dict:
    """Single-process eager AdamW on the global batch: the ground truth of every parity test."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = model(*global_batch(name, step, batch_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
