"""Rank functions of the activation-budget tests (spawned by ``tests.distributed.spawn``); plain data out."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerograph
from zerograph.passes.activation_partition import ACTIVATION

from .models import build, global_batch, rank_slice


def _train(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float,
           budget: int | None) -> dict:
    model = zerograph.compile(build(name), stage=stage, config=zerograph.Config(activation_budget_bytes=budget))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, saved = [], []
    for step in range(steps):
        loss = model(*rank_slice(global_batch(name, step, batch_size), rank, world_size))
        loss.backward()
        saved.append(zerograph.stats(model).saved_activation_bytes)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    decisions = {}
    for record in model._zerograph.captured.graphs:
        for node in record["joint"].graph.nodes if "joint" in record else ():
            note = node.meta.get(ACTIVATION, {})
            if "note" in note:
                decisions[note["unit"]] = note["decision"]
    return {"losses": losses, "saved_bytes": saved, "decisions": decisions,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def budget_runs(rank: int, world_size: int, name: str, stages: tuple[int, ...], steps: int, batch_size: int,
                lr: float) -> dict:
    """Per stage: train without a budget, read the measured saved-activation bytes A, then train
    the same steps from the same initial values with ``activation_budget_bytes = A // 2``."""
    out = {}
    for stage in stages:
        free = _train(rank, world_size, name, stage, steps, batch_size, lr, None)
        budget = max(free["saved_bytes"]) // 2
        out[stage] = {"free": free, "budget": budget,
                      "constrained": _train(rank, world_size, name, stage, steps, batch_size, lr, budget)}
    return out
