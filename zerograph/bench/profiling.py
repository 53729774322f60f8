"""``torch.profiler`` runs of training steps, shared by the comm and memory measurements.

Each profiled step runs after a device sync and a barrier, inside a ``STEP_LABEL``
``record_function``, so its window can be found among the events.

Source: ``torch.profiler.profile``, ``torch.profiler.record_function``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

STEP_LABEL = "zerograph.bench.step"  # record_function around each profiled step


def profile_steps(step: Callable[[], Any], n: int, device: torch.device) -> tuple[list[Any], list[Any]]:
    """Run ``step()`` ``n`` times under ``torch.profiler`` (each after a barrier, inside a
    ``STEP_LABEL`` record_function); returns ``(events, step windows)`` in time order."""
    if n == 0:
        return [], []
    events = list(profile_run(step, n, device).events())
    return events, step_windows(events)


def profile_run(step: Callable[[], Any], n: int, device: torch.device, profile_memory: bool = False) -> Any:
    """The ``torch.profiler.profile`` of ``n`` runs of ``step()``, each after a device sync and a
    barrier, inside a ``STEP_LABEL`` record_function (CUDA activity too on GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=profile_memory) as prof:
        for _ in range(n):
            sync_device(device)
            dist.barrier()
            with torch.profiler.record_function(STEP_LABEL):
                step()
                sync_device(device)
    return prof


def step_windows(events: Sequence[Any]) -> list[Any]:
    """The ``STEP_LABEL`` events (one per profiled step), in time order."""
    return sorted((e for e in events if e.name == STEP_LABEL), key=lambda e: e.time_range.start)


def median_window(windows: Sequence[Any]) -> Any:
    """The step window of median duration."""
    ordered = sorted(windows, key=lambda w: w.time_range.end - w.time_range.start)
    return ordered[len(ordered) // 2]


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
