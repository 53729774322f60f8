"""A memory budget for ``zerograph.compile`` (``MemoryPolicy.budget_bytes``): the step's
peak planned with a ``Config``'s dtypes and schedule (``zerograph.plan``), the schedule fitted to
the budget, or a refusal with the plan's numbers."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import nn

from ..config import Config
from ..errors import ConfigError
from .plan import GB, Plan, _check_count, _sig3, plan

log = logging.getLogger(__name__)


def plan_for_config(model: nn.Module, stage: int, world_size: int, config: Config, *,
                    example_inputs: Sequence[object] | None = None, replicas: int = 1) -> Plan:
    """``plan`` with the dtypes and schedule of a ``zerograph.Config``, as ``compile`` would run it.

    ``param_dtype`` is ``config.mixed_precision.param_dtype``, or the model's first floating
    parameter's dtype when that is ``None`` (so is ``master_dtype``, the dtype the shards keep);
    AdamW is assumed (``compile`` does not know the optimizer); ``prefetch_depth``,
    ``unit_classes`` and ``secondary_partition_size`` are the config's; ``bucket_bytes`` the
    config's when > 0 (0: one bucket per unit, the plan's default).
    """
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return plan(model, stage, world_size, param_dtype=config.mixed_precision.param_dtype or own, master_dtype=own,
                prefetch_depth=config.schedule.prefetch_depth, bucket_bytes=config.schedule.bucket_bytes or None,
                unit_classes=config.unit_classes, replicas=replicas,
                secondary_partition_size=config.secondary_partition_size, example_inputs=example_inputs)


def check_memory_budget(planned: Plan, budget_bytes: int | None) -> None:
    """Refuse a plan whose predicted step peak exceeds ``budget_bytes`` (``None``: no budget).

    Raises:
        ConfigError: ``planned.step_peak_bytes > budget_bytes``, naming the peak's parts and
            what lowers each; or ``budget_bytes`` not an int >= 1.

    For ``zerograph.compile`` with ``MemoryPolicy(budget_bytes=...)``:
    ``check_memory_budget(plan_for_config(model, stage, world_size, config), config.memory.budget_bytes)``.
    """
    if budget_bytes is None:
        return
    budget_bytes = _check_count("memory.budget_bytes", budget_bytes, minimum=1)
    if planned.step_peak_bytes <= budget_bytes:
        return
    parts = ", ".join(f"{k.replace('_', ' ')} {_sig3(v / GB)}" for k, v in planned.step_peak_breakdown.items())
    hints = []
    if planned.stage == 3 and planned.prefetch_depth > 0:
        hints.append(f"prefetch_depth={planned.prefetch_depth - 1} (fewer units gathered ahead)")
    if planned.stage < 3:
        hints.append("a higher stage (3 shards the parameters too)")
    hints += ["more ranks", "activation checkpointing or ActivationPolicy(budget_bytes=...) for the activations",
              "a larger budget"]
    unknown = "" if planned.activation_bytes is not None else " (activations not included: no example inputs)"
    raise ConfigError(
        f"predicted step peak {_sig3(planned.step_peak_bytes / GB)} GB per rank exceeds memory.budget_bytes "
        f"{_sig3(budget_bytes / GB)} GB{unknown} (stage {planned.stage}, N = {planned.world_size}; GB = 1e9 bytes: "
        f"{parts}). Try: {'; '.join(hints)}")


def fit_memory_budget(model: nn.Module, stage: int, world_size: int, replicas: int, config: Config) -> Config:
    """``config`` with the largest ``prefetch_depth``, up to its own, whose planned step peak
    (``zerograph.plan``) fits ``MemoryPolicy.budget_bytes``; ``config`` itself without a budget.
    Raises ``ConfigError`` with the plan's parts when ``prefetch_depth=0`` does not fit either."""
    budget = config.memory.budget_bytes
    if budget is None:
        return config
    for depth in range(config.schedule.prefetch_depth, -1, -1):
        candidate = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, prefetch_depth=depth))
        planned = plan_for_config(model, stage, world_size, candidate, replicas=replicas)
        if planned.step_peak_bytes <= budget:
            if depth < config.schedule.prefetch_depth:
                log.warning("zerograph: prefetch_depth %d -> %d to fit memory.budget_bytes %d (planned peak %d bytes)",
                            config.schedule.prefetch_depth, depth, budget, planned.step_peak_bytes)
            return candidate
    check_memory_budget(planned, budget)  # prefetch_depth=0 does not fit: raises with the plan's numbers
    return config
