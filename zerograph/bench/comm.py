"""Communication per step: elements moved (counted for DDP / FSDP2, read from ``zerograph.stats``
for zerograph) and exposed communication read off a profiled step.

Volumes follow the ZeRO paper's convention (arXiv 1910.02054, section 7): elements of the full
tensors, an all-reduce counted twice. Exposed communication is defined in docs/bench.md (``report.DEFINITIONS``).

Source: ``torch.utils._python_dispatch.TorchDispatchMode`` (the counter); ``c10d`` and
``_c10d_functional`` op schemas (the sizes); ``zerograph.report.timeline`` (interval arithmetic).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..report.stats import stats
from ..report.timeline import (
    Event,
    is_top_level_op,
    schedule_from_events,
    schedule_from_profile,
)

log = logging.getLogger(__name__)

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _numel(tensors: Any) -> int:
    """Elements of a tensor or of a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


# full elements moved by each collective op the dispatcher sees, from its arguments
_COLLECTIVE_SIZES: dict[str, tuple[str, Callable[[tuple], int]]] = {
    "c10d::allreduce_": ("all_reduce", lambda a: _numel(a[0])),
    "c10d::allreduce_coalesced_": ("all_reduce", lambda a: _numel(a[0])),
    "c10d::_allgather_base_": ("all_gather", lambda a: _numel(a[0])),
    "c10d::allgather_": ("all_gather", lambda a: _numel(a[0])),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", lambda a: _numel(a[0])),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", lambda a: _numel(a[1])),
    "c10d::reduce_scatter_": ("reduce_scatter", lambda a: _numel(a[1])),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _numel(a[1])),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", lambda a: _numel(a[0]) * a[1]),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", lambda a: _numel(a[0]) * a[1]),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", lambda a: _numel(a[0])),
    "_c10d_functional::all_reduce": ("all_reduce", lambda a: _numel(a[0])),
}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active, as ``zerograph.stats`` counts its own:
    ``elements[kind]`` = elements of the full tensors, an all-reduce twice (ZeRO paper section 7).
    ``other`` counts calls of other ``c10d`` ops (broadcasts, barriers), which move no model state.

    Eager collectives only: a compiled graph's collectives do not reach a dispatch mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.elements = dict.fromkeys(KINDS, 0)
        self.other: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name
        if name in _COLLECTIVE_SIZES:
            kind, size = _COLLECTIVE_SIZES[name]
            self.elements[kind] += size(args) * (2 if kind == "all_reduce" else 1)
        elif "c10d" in name:
            self.other[name] = self.other.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_collectives(step: Callable[[], Any]) -> dict[str, int]:
    """Run ``step()`` under ``CollectiveCounter``; ``{kind: elements}``."""
    counter = CollectiveCounter()
    with counter:
        step()
    if counter.other:
        log.info("uncounted c10d ops in the counted step: %s", counter.other)
    return counter.elements


def zerograph_volume(model: nn.Module) -> dict[str, int]:
    """``{kind: elements}`` a compiled model moved per step, from ``zerograph.stats``."""
    return {k: int(v) for k, v in stats(model).comm_elements.items()}


_COMM_OP_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_COMM_THREAD_PREFIXES = ("gloo:", "nccl:")


def _clipped(event: Any, window: Any, track: str) -> Any | None:
    """``timeline.Event`` of ``event`` cut to ``window`` (seconds from its start), or ``None``."""
    start = max(event.time_range.start, window.time_range.start)
    end = min(event.time_range.end, window.time_range.end)
    if end <= start:
        return None
    return Event(event.name, track, (start - window.time_range.start) / 1e6, (end - start) / 1e6, kind=event.name)


def comm_breakdown(events: Sequence[Any], window: Any, device: torch.device) -> dict[str, float]:
    """``step_s``, ``compute_s``, ``comm_s`` (collectives in flight) and ``exposed_comm_s`` of one
    profiled step, in seconds, by the definition in the module docstring."""
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = [_clipped(e, window, "comm") for e in kernels if "nccl" in e.name.lower()]
        compute = [_clipped(e, window, "compute") for e in kernels if "nccl" not in e.name.lower()]
    else:
        comm_threads = {e.thread for e in events if e.name.startswith(_COMM_THREAD_PREFIXES)}
        comm = [_clipped(e, window, "comm") for e in events
                if e.thread in comm_threads and e.name.startswith(_COMM_THREAD_PREFIXES)]
        compute = [_clipped(e, window, "compute") for e in events
                   if e.thread not in comm_threads and not e.name.startswith(_COMM_OP_PREFIXES)
                   and is_top_level_op(e)]
    schedule = schedule_from_events([e for e in comm + compute if e is not None])
    return {"step_s": (window.time_range.end - window.time_range.start) / 1e6,
            "compute_s": schedule.compute_s, "comm_s": schedule.comm_s,
            "exposed_comm_s": schedule.comm_s - schedule.overlap_s()}


def zerograph_wait_breakdown(events: Sequence[Any], windows: Sequence[Any]) -> list[float]:
    """Per profiled step, seconds the training thread sat in ``wait_tensor``: the exposed
    communication as ``zerograph.report.timeline.measure`` defines it (comparable with ``predict``)."""
    out = []
    for w in windows:
        inside = [e for e in events if w.time_range.start <= e.time_range.start and e.time_range.end <= w.time_range.end]
        out.append(schedule_from_profile(inside).exposed_comm_s)
    return out
