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


def check_meshes(model: nn.Module) -> None:
    """Every ``DTensor`` parameter's mesh puts this rank where it is. A rank that inherited another
    rank's meshes (DTensor's caches compare meshes by value, not by rank: a forkserver that had
    compiled a model as rank 0 of a world of 2 handed rank 1 meshes of rank 0, tests/warm_rank.py)
    fails here instead of saving or loading the wrong rows."""
    if not dist.is_initialized():
        return
    for name, param in model.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            coordinate = mesh.get_coordinate()
            assert coordinate is not None and mesh.mesh[tuple(coordinate)].item() == dist.get_rank(), (
                f"{name}: mesh coordinate {coordinate} is not rank {dist.get_rank()}'s")


def train_steps(model: nn.Module, loss_of: Callable[[int], torch.Tensor], steps: int, lr: float, *,
                after_backward: Callable[[int, torch.optim.Optimizer], None] | None = None,
                after_step: Callable[[int, torch.optim.Optimizer], None] | None = None,
                ) -> tuple[torch.optim.Optimizer, list[float]]:
    """``steps`` steps of ``torch.optim.AdamW(model.parameters(), lr)``: ``loss_of(step)`` runs
    the forward of this rank's slice, then backward, ``after_backward(step, opt)`` (read
    gradients or ``zerograph.stats`` here, before ``zero_grad`` frees the gradient shards),
    ``opt.step()``, ``opt.zero_grad()``, ``after_step(step, opt)``. First ``check_meshes``.

    Returns the optimizer and the per-step losses averaged over ranks (``mean_over_ranks``).
    """
    check_meshes(model)
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
