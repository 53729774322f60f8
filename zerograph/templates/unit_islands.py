"""Islands: units run eagerly between graphs, gathered once on entry (``templates.UnitKind.run_as_islands``).

A unit whose body has data-dependent control flow (a loop over the experts that got tokens)
would be split by Dynamo into graphs at points that differ from rank to rank, each gathering
the unit's parameters again; ranks would run different collectives. An island runs the body
outside every graph instead: its parameters are all-gathered once on entry and every gradient
is reduced once, in a fixed order, whatever the body did. Before its gathers, and again before
its reductions, the ranks compare a digest of what the island is about to run (the schedule check
of ``comm_schedule``, as before a graph), so ranks at different islands, or one at an island and
another at a graph, raise ``ScheduleMismatchError`` instead of exchanging buffers of the wrong
parameters or aborting in the transport. Source: FSDP2's unshard in a unit's pre-forward hook and
reshard in its post-forward hook.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..graph import registry
from ..graph.vocab import GRAD_ACCUMULATE, GRAD_SYNC
from ..runtime.comm_schedule import CommSchedule, ScheduleEntry, schedule_from
from ..shard.trace_state import TRACE
from .unit_trace import UNIT_ATTR


def island_schedule(keys: tuple[int, ...], direction: str, mode: str = GRAD_SYNC) -> CommSchedule:
    """What an island of parameters ``keys`` runs outside every graph, in order: in
    ``"forward"`` each sharded parameter's all-gather; in ``"backward"`` the all-reduce of the
    reached-flags, then each parameter's reduction (every one that some rank reached; none while
    gradients accumulate unsynced, ``mode``)."""
    layouts = [registry.layout_of(key) for key in keys]
    entries = []
    if direction == "forward":
        entries = [ScheduleEntry("all_gather", lay.numel, str(lay.param_dtype).removeprefix("torch."), (lay.unit,))
                   for lay in layouts if lay.sharded]
    else:
        entries = [ScheduleEntry("all_reduce", len(keys), "uint8", (layouts[0].unit,))]
        if mode != GRAD_ACCUMULATE:
            entries += [ScheduleEntry("reduce_scatter" if lay.sharded else "all_reduce", lay.numel,
                                      str(lay.reduce_dtype).removeprefix("torch."), (lay.unit,)) for lay in layouts]
    unit = layouts[0].unit
    return schedule_from(entries, f"island {direction}", f"the island {direction} of unit #{unit}")


class GatheredOnEntry(torch.autograd.Function):
    """An island's parameters (``run_island``): each all-gathered in forward; in backward every
    one reduced, in slot order, on every rank alike, whichever of them this rank's data reached
    (zeros for the others), unless no rank reached it (``None``, as eager leaves it): the
    collectives of a unit do not depend on its data. Inputs: the marker keys, the gradient mode,
    then each parameter's local shard ``(local_rows, *rest)``; outputs: the full parameters."""

    @staticmethod
    def forward(ctx: Any, keys: tuple[int, ...], mode: str, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.keys, ctx.mode = keys, mode
        ctx.set_materialize_grads(False)
        runtime = registry.runtime_of(keys[0])
        runtime.schedule_check.check_schedule(island_schedule(keys, "forward"))
        return tuple(runtime.eager.unshard(shard, key) for shard, key in zip(shards, keys))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        runtime = registry.runtime_of(ctx.keys[0])
        runtime.schedule_check.check_schedule(island_schedule(ctx.keys, "backward", ctx.mode))
        reached = runtime.eager.reached_on_any_rank([grad is not None for grad in grads], ctx.keys[0])
        out: list[torch.Tensor | None] = [None, None]
        for grad, key, hit in zip(grads, ctx.keys, reached):
            if not hit:
                out.append(None)
                continue
            if grad is None:
                layout = registry.layout_of(key)
                grad = torch.zeros(layout.shape, dtype=layout.param_dtype, device=runtime.device)
            out.append(runtime.reduce_grad(grad.contiguous(), key, ctx.mode))
        return tuple(out)


@torch._dynamo.disable
def run_island(unit: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run ``unit``'s body eagerly, outside every graph (Dynamo breaks the model's graph at the
    call, on every rank alike), on its parameters gathered once on entry: each parameter's
    ``unshard`` marker runs as the op itself (its all-gather now, its reduce in backward, through
    autograd), the full tensors stand in the parameter slots for the body's reads, and the slots
    get their shards back on exit. Source: FSDP2's unshard in a unit's pre-forward hook and
    reshard in its post-forward hook."""
    record = getattr(unit, UNIT_ATTR)
    param_slots, keys, flat = record.param_slots, record.keys, record.flat
    shards = [mod._parameters[name] for mod, name in param_slots]
    mode = TRACE.grad_mode if torch.is_grad_enabled() else GRAD_SYNC
    if flat is not None:
        fulls = flat.unflatten(GatheredOnEntry.apply((flat.layout.key,), mode, flat.input)[0])
    else:
        locals_ = [shard.to_local() if isinstance(shard, DTensor) else shard for shard in shards]
        fulls = list(GatheredOnEntry.apply(keys, mode, *locals_))
    with TRACE.scope(tracing_unit=True):  # the parameter attributes read their slots
        try:
            for (mod, name), full in zip(param_slots, fulls):
                mod._parameters[name] = full
            return type(unit).forward(unit, *args, **kwargs)
        finally:
            for (mod, name), shard in zip(param_slots, shards):
                mod._parameters[name] = shard
