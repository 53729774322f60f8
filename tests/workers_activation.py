"""Rank functions of the activation-budget tests (spawned by ``tests.distributed.spawn``); plain data out."""
from __future__ import annotations

import torch
import torch.distributed as dist

import zerograph
from zerograph.graph.costmodel import CostModel
from zerograph.passes.activation_partition import ACTIVATION
from zerograph.runtime.state import graphs_of

from .models import build, global_batch, rank_slice
from .training import train_steps


def _train(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float,
           budget: int | None, replicated: bool = False, unit_templates: bool | None = None, **activations) -> dict:
    """``replicated``: every rank trains on the whole batch (activations are replicated across
    ranks, as across a tensor-parallel group), else on its slice of it. ``activations``: the
    ``ActivationPolicy`` fields beside ``budget_bytes``."""
    policy = zerograph.ActivationPolicy(budget_bytes=budget, **activations)
    model = zerograph.compile(build(name), stage=stage,
                              config=zerograph.Config(activations=policy, unit_templates=unit_templates))
    saved, offloaded = [], []

    def loss_of(step: int) -> torch.Tensor:
        batch = global_batch(name, step, batch_size)
        return model(*(batch if replicated else rank_slice(batch, rank, world_size)))

    def read_stats(step: int, opt: torch.optim.Optimizer) -> None:
        stats = zerograph.stats(model)
        saved.append(stats.saved_activation_bytes)
        offloaded.append(stats.offloaded_activation_bytes)

    _, losses = train_steps(model, loss_of, steps, lr, after_backward=read_stats)
    decisions = {}
    for record in graphs_of(model):
        for node in record["joint"].graph.nodes if "joint" in record else ():
            note = node.meta.get(ACTIVATION, {})
            if "note" in note:
                decisions[note["unit"]] = note["decision"]
    return {"losses": losses, "saved_bytes": saved, "offloaded_bytes": offloaded, "decisions": decisions,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def budget_runs(rank: int, world_size: int, name: str, stages: tuple[int, ...], steps: int, batch_size: int,
                lr: float) -> dict:
    """Per stage: train without a budget, read the measured saved-activation bytes A, then train
    the same steps from the same initial values with ``activation_budget_bytes = A // 2``. The run
    without a budget is the build a budget gets (per-parameter, as ``moved_runs``'), so that A // 2
    is half of what that build saves: a template saves less (it recomputes cheap ops and layer
    norms), and half of that is below what recompute can reach with the root's logits kept."""
    out = {}
    for stage in stages:
        free = _train(rank, world_size, name, stage, steps, batch_size, lr, None, unit_templates=False)
        budget = max(free["saved_bytes"]) // 2
        out[stage] = {"free": free, "budget": budget,
                      "constrained": _train(rank, world_size, name, stage, steps, batch_size, lr, budget)}
    return out


# recompute priced far above a host round trip or an all-gather, so that the plan moves activations
SLOW_COMPUTE = CostModel(world_size=2, flops_per_s=1e6, bytes_per_s=1e6, op_overhead_s=1e-3,
                         collectives={"all_gather": (1e-5, 1e-9)}, host_bytes_per_s=5e10)


def moved_runs(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float) -> dict:
    """Every rank trains on the whole batch: without a budget; then with a budget below the
    measured saved bytes, once with P_a over the whole world (the activation group) and once with
    offload, both priced by ``SLOW_COMPUTE``."""
    # the build an activation budget gets (per-parameter: templates are off under a budget), so that
    # each budget is a fraction of what that build saves (a template recomputes its cheap ops, saving less)
    free = _train(rank, world_size, name, stage, steps, batch_size, lr, None, replicated=True, unit_templates=False)
    unconstrained = max(free["saved_bytes"])
    common = dict(replicated=True, cost_model=SLOW_COMPUTE)
    budgets = {"partition": unconstrained * 3 // 4, "offload": unconstrained // 2}  # P_a at M = 2 frees at most half
    return {"free": free, "budgets": budgets,
            "partition": _train(rank, world_size, name, stage, steps, batch_size, lr, budgets["partition"],
                                group=dist.group.WORLD, **common),
            "offload": _train(rank, world_size, name, stage, steps, batch_size, lr, budgets["offload"],
                              offload=True, **common)}


def activation_runs(rank: int, world_size: int, name: str, steps: int, batch_size: int, lr: float) -> dict:
    """``budget_runs`` at stage 2 and ``moved_runs`` at stage 3, in one process group (one spawn
    for both: a process start and a first compile cost more than these runs); then the budget run
    of stage 3 on the whole batch (``replicated``), from ``moved_runs``' unconstrained run: one
    unconstrained compile at stage 3, not two."""
    budget = budget_runs(rank, world_size, name, (2,), steps, batch_size, lr)
    torch._dynamo.reset()  # Dynamo keeps at most 8 graphs per code object
    moved = moved_runs(rank, world_size, name, 3, steps, batch_size, lr)
    free = moved["free"]
    half = max(free["saved_bytes"]) // 2
    budget[3] = {"free": free, "budget": half,
                 "constrained": _train(rank, world_size, name, 3, steps, batch_size, lr, half, replicated=True)}
    return {"budget": budget, "moved": moved}
