"""The training loop the rank workers share: AdamW steps on a compiled model, losses averaged over ranks."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The mean of ``loss`` over the default group's ranks (each rank's own value without one)."""
    total = loss.detach().float().clone()
    if not dist.is_initialized():
        return total.item()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_steps(model: nn.Module, loss_of: Callable[[int], torch.Tensor], steps: int, lr: float, *,
                after_backward: Callable[[int, torch.optim.Optimizer], None] | None = None,
                after_step: Callable[[int, torch.optim.Optimizer], None] | None = None,
                ) -> tuple[torch.optim.Optimizer, list[float]]:
    """``steps`` steps of ``torch.optim.AdamW(model.parameters(), lr)``: ``loss_of(step)`` runs
    the forward of this rank's slice, then backward, ``after_backward(step, opt)`` (read
    gradients or ``zerograph.stats`` here, before ``zero_grad`` frees the gradient shards),
    ``opt.step()``, ``opt.zero_grad()``, ``after_step(step, opt)``.

    Returns the optimizer and the per-step losses averaged over ranks (``mean_over_ranks``).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(step)
        loss.backward()
        if after_backward is not None:
            after_backward(step, opt)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if after_step is not None:
            after_step(step, opt)
    return opt, losses
