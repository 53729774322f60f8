"""Memory per system on one rank: peak RSS or CUDA peak over the timed steps (``MemoryProbe``),
bytes of training state held between steps (``held_bytes``) and the allocator's in-step peak with
what made it (``profile_allocations``, ``peak_allocations``). Definitions in docs/bench.md.

Source: Linux ``/proc/self/status`` (``VmRSS``, ``VmHWM``) and ``/proc/self/clear_refs``;
``torch.cuda.max_memory_allocated``; ``torch.profiler(profile_memory=True)`` and its event tree,
as ``torch.profiler._memory_profiler`` reads it.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.state import is_compiled, runtime_of_model
from .profiling import profile_run, step_windows


class MemoryProbe:
    """Peak memory of one system on this rank (see ``DEFINITIONS["peak_memory"]``).

    CPU: RSS from ``/proc/self/status`` (``VmRSS``, ``VmHWM``); the high-water mark is reset by
    writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). Where that is refused, falls back
    to ``resource.getrusage``'s lifetime peak, which misses a peak lower than an earlier
    system's (``method`` says which). GPU: ``torch.cuda`` allocator statistics. Bytes throughout.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = self._current()
        self.method = "cuda_max_memory_allocated" if device.type == "cuda" else "VmHWM"

    def start_peak(self) -> None:
        """Start the peak window now (after the warm-up steps, which compile)."""
        self.steady = self._current()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "ru_maxrss (lifetime peak: may miss this system's peak)"

    def result(self) -> dict:
        peak = self._peak()
        return {"method": self.method, "baseline_bytes": self.baseline, "after_warmup_bytes": self.steady,
                "peak_bytes": peak, "peak_over_baseline_bytes": max(0, peak - self.baseline)}

    def _current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_bytes("VmRSS")

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.method == "VmHWM":
            return _proc_status_bytes("VmHWM")
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the training state this rank holds between steps, by kind, each storage counted
    once (``DEFINITIONS["allocated"]``): parameters (a ``DTensor``'s local shard, with the
    padding of its storage), ``.grad``, the optimizer's state tensors, the module buffers, and
    the communication buffers a system keeps across steps (zerograph's pool, DDP's buckets)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def nbytes(tensors: Any) -> int:
        total = 0
        for t in tensors:
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:  # a freed FSDP2 unsharded param has 0
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_states": nbytes(v for state in optimizer.state.values() for v in state.values()
                                       if isinstance(v, torch.Tensor)),
            "buffers": nbytes(model.buffers()), "comm_buffers": nbytes(_comm_buffers(model))}


def _comm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Buffers a system keeps from step to step outside parameters and optimizer: zerograph's
    ``BufferPool`` slots; DDP's gradient buckets (as same-sized copies: the reducer exposes no
    other handle on them)."""
    if is_compiled(model):
        return list(runtime_of_model(model).buffer_pool.buffers.values())
    reducer = getattr(model, "reducer", None)
    if not isinstance(reducer, dist.Reducer):
        return []
    return [bucket.buffer() for bucket in reducer._get_zeros_like_grad_buckets()]


def profile_allocations(step: Callable[[], Any], n: int, device: torch.device) -> tuple[list[int], list[dict]]:
    """Run ``step()`` ``n`` times as ``profile_steps`` does, with ``profile_memory``. Returns per
    step the peak of the running sum of the device allocator's allocations (+) and frees (-)
    inside its ``STEP_LABEL`` window (the most bytes the step allocated above what was held at its
    start), and ``peak_allocations`` of the profile (what made the highest point)."""
    if n == 0:
        return [], []
    prof = profile_run(step, n, device, profile_memory=True)
    kineto = prof.profiler.kineto_results
    origin = kineto.trace_start_ns()  # FunctionEvent times are microseconds after it
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    changes = sorted(((e.start_ns() - origin, e.nbytes()) for e in kineto.events()
                      if e.name() == "[memory]" and e.device_type() == kind), key=lambda c: c[0])
    peaks = []
    for window in step_windows(prof.events()):
        start_ns, end_ns = window.time_range.start * 1e3, window.time_range.end * 1e3
        running = peak = 0
        for t, nbytes in changes:
            if start_ns <= t <= end_ns:
                running += nbytes
                peak = max(peak, running)
        peaks.append(peak)
    return peaks, peak_allocations(kineto.experimental_event_tree(), device)


def peak_allocations(roots: Sequence[Any], device: torch.device, top: int = 6) -> list[dict]:
    """The blocks alive at the highest point of the allocations a profile recorded on ``device``,
    summed by the ops that allocated them: ``[{"ops": "aten::empty < zerograph::unpack_gathered <
    CompiledFunction", "bytes": ...}]`` (innermost op first, three levels), largest first, at most
    ``top``. Blocks allocated before the profile started are not seen. ``roots``: the profiler's
    event tree (``kineto_results.experimental_event_tree()``), whose allocation events carry the
    address, size (negative: a free) and device, as ``torch.profiler._memory_profiler`` reads them."""
    allocations = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.typed[1]
        if type(fields).__name__.endswith("Allocation") and fields.device.type == device.type:
            ops, parent = [], event.parent
            while parent is not None and len(ops) < 3:
                ops.append(parent.name)
                parent = parent.parent
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size, " < ".join(ops) or "(no op)"))
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    snapshot: dict[int, tuple[int, str]] = {}
    for _, ptr, size, ops in sorted(allocations, key=lambda a: a[0]):
        if size > 0:
            live[ptr] = (size, ops)
            total += size
        elif ptr in live:
            total -= live.pop(ptr)[0]
        if total > best:
            best, snapshot = total, dict(live)
    by_ops: dict[str, int] = {}
    for size, ops in snapshot.values():
        by_ops[ops] = by_ops.get(ops, 0) + size
    ranked = sorted(by_ops.items(), key=lambda kv: -kv[1])[:top]
    return [{"ops": ops, "bytes": nbytes} for ops, nbytes in ranked]


def allocation_summary(ranks: Sequence[dict]) -> dict:
    """Max over ranks of the state held at a step's start, of the median in-step allocation peak
    and of their sum (``None`` without profiled steps)."""
    state = [sum(r["state_bytes_by_kind"].values()) for r in ranks]
    peak = [statistics.median(r["step_peak_bytes"]) if r["step_peak_bytes"] else None for r in ranks]
    if None in peak:
        return {"state_bytes": max(state), "step_peak_alloc_bytes": None, "state_plus_peak_bytes": None}
    return {"state_bytes": max(state), "step_peak_alloc_bytes": max(peak),
            "state_plus_peak_bytes": max(s + p for s, p in zip(state, peak))}
