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
    barrier, inside a ``STEP_LABEL`` record_function (CUDA activity too on GPU); the profiler
    stops only after ``drain_collectives``."""
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
        drain_collectives()
    return prof


def drain_collectives() -> None:
    """Return once every collective this rank started on the default group has finished, its
    profiler callbacks included (a barrier: gloo's barrier waits for the works in flight before it).

    Works around a PyTorch use-after-free: gloo completes a work's future and only then, on its
    worker thread, runs the profiler's end callback, which writes the op's end time into the event
    storage of the profile that started it. A step that waits on a future, not on the work (DDP's
    reducer), can leave ``torch.profiler.profile`` first; stopping frees that storage, and the late
    write corrupts the heap (glibc aborts later, at an unrelated free). Collective: every rank calls it.
    """
    dist.barrier()


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
