"""Predicted and measured step timelines on two tracks: compute and communication.

``predict`` simulates captured FX graphs with a ``CostModel`` (one compute stream that runs the
graph in order, one comm stream that runs collectives one at a time); ``measure`` reads the same
kind of schedule off a ``torch.profiler`` run of a real step. Both give a ``Schedule`` whose
``exposed_comm_s`` is the time compute sat blocked on a ``wait_tensor``, the number the scheduling
passes try to drive to 0, and which exports to the Chrome trace format (opens in Perfetto).

Source: the two-stream simulation mirrors Inductor's comm/compute overlap estimate
(``torch/_inductor/comms.py``, ``overlap_scheduling.py``); the trace format is the Chrome Trace
Event Format ("X" complete events, microseconds).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..graph.costmodel import COLLECTIVE_OPS, WAIT, CostModel, collective_bytes, tensor_bytes
from ..graph.ops import GATHER_ACTIVATION
from ..graph.vocab import group_name_of

log = logging.getLogger(__name__)

TRACKS = ("compute", "comm")
_US = 1e6  # microseconds per second (Chrome traces count in µs)


@dataclasses.dataclass(frozen=True)
class Event:
    """One interval on a track (times in seconds from the start of the step).

    ``kind`` is the collective kind on the comm track and the op name on the compute track;
    ``unit`` is the sharding unit (``node.meta["zerograph"]["unit"]``) when known.
    """

    name: str
    track: str
    start_s: float
    dur_s: float
    kind: str | None = None
    unit: int | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclasses.dataclass
class Schedule:
    """A step on two tracks.

    Attributes:
        events: compute and comm intervals, in the order they started.
        step_s: end of the last event (seconds; the step starts at 0).
        compute_s: busy time of the compute track (seconds, overlapping events counted once).
        comm_s: busy time of the comm track (seconds; in a measured schedule, the time at least
            one collective was in flight).
        exposed_comm_s: time the compute track sat blocked in ``wait_tensor`` (seconds).
        waits: the blocked intervals themselves (track ``"comm"``, kind of the awaited collective).
    """

    events: list[Event]
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    waits: list[Event] = dataclasses.field(default_factory=list)

    def track(self, name: str) -> list[Event]:
        return [e for e in self.events if e.track == name]

    def collective_counts(self) -> dict[str, int]:
        """``{kind: number of collectives}`` on the comm track."""
        counts: dict[str, int] = {}
        for e in self.track("comm"):
            counts[e.kind or "?"] = counts.get(e.kind or "?", 0) + 1
        return counts

    def overlap_s(self) -> float:
        """Seconds during which some collective and some compute run at once (hidden comm)."""
        return _intersection_length(_union(self.track("compute")), _union(self.track("comm")))

    def summary(self) -> str:
        """A few lines for a log: step, busy and exposed times in ms, collectives per kind."""
        ms = 1e3
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.collective_counts().items())) or "no collectives"
        return (f"step {self.step_s * ms:.3f} ms | compute {self.compute_s * ms:.3f} ms | "
                f"comm {self.comm_s * ms:.3f} ms (hidden {self.overlap_s() * ms:.3f} ms, "
                f"exposed {self.exposed_comm_s * ms:.3f} ms)\n{counts}")

    def to_chrome_trace(self, *, pid: int = 0) -> dict:
        """``{"traceEvents": [...]}`` in the Chrome Trace Event Format: one "X" event per interval
        (µs), one thread per track plus one for the blocked waits, named by "M" metadata events.
        ``json.dump`` it and open it in Perfetto (``pid`` separates ranks in a merged trace)."""
        tids = {"compute": 0, "comm": 1, "exposed": 2}
        trace: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for name, tid in tids.items()
        ]
        for tid_name, events in (("compute", self.track("compute")), ("comm", self.track("comm")),
                                 ("exposed", self.waits)):
            for e in events:
                trace.append({"name": e.name, "cat": e.track, "ph": "X", "pid": pid, "tid": tids[tid_name],
                              "ts": e.start_s * _US, "dur": e.dur_s * _US,
                              "args": {"kind": e.kind, "unit": e.unit}})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}


def schedule_from_events(events: Iterable[Event], waits: Iterable[Event] = ()) -> Schedule:
    """Fill a ``Schedule``'s totals from its intervals (events sorted by start)."""
    events = sorted(events, key=lambda e: e.start_s)
    waits = sorted(waits, key=lambda e: e.start_s)
    return Schedule(
        events=events,
        step_s=max((e.end_s for e in [*events, *waits]), default=0.0),
        compute_s=_length(_union(e for e in events if e.track == "compute")),
        comm_s=_length(_union(e for e in events if e.track == "comm")),
        exposed_comm_s=_length(_union(waits)),
        waits=waits,
    )


# ---------------------------------------------------------------------------------------------
# prediction from graphs


def predict(graphs: Sequence[fx.GraphModule | fx.Graph], cost: CostModel,
            group_costs: Mapping[str, CostModel] | None = None) -> Schedule:
    """Simulate ``graphs`` back to back (e.g. one step's forward then backward) on two streams.

    The compute stream runs every ``call_function`` node in graph order for ``cost.node_time``.
    A collective is issued when the compute stream reaches it (after its launch overhead) and
    runs on the comm stream from ``max(issue, comm stream free)`` for
    ``cost.collective_time(kind, full bytes)``; its ``wait_tensor`` blocks the compute stream until
    it is done, and that blocked time is the exposed communication. Nodes need ``meta["val"]``.

    ``zerograph::gather_activation`` (P_a's and hpZ's re-gather) is an all-gather of its padded
    full buffer whose wait is inside the op: it blocks the compute stream until it is done.

    ``group_costs``: process-group name -> the ``CostModel`` that prices the collectives over
    that group (a mesh dim on links of their own, e.g. hybrid sharding's shard dim inside a node
    and its replicate dim across nodes); a collective over any other group is priced by ``cost``.

    Returns a ``Schedule`` with one comm event per collective node and one compute event per node
    of nonzero cost.
    """
    now = 0.0        # compute stream clock, seconds
    comm_free = 0.0  # when the comm stream finishes its last collective
    done: dict[fx.Node, tuple[float, str]] = {}  # collective node -> (finish time, kind)
    events: list[Event] = []
    waits: list[Event] = []
    for graph in graphs:
        graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            unit = node.meta.get("zerograph", {}).get("unit")
            if node.target is WAIT and node.args[0] in done:
                finish, kind = done[node.args[0]]
                if finish > now:
                    waits.append(Event(node.name, "comm", now, finish - now, kind, unit))
                    now = finish
                continue
            if node.target is GATHER_ACTIVATION:
                now = _blocking_gather(node, now, comm_free, (group_costs or {}).get(node.args[2], cost),
                                       events, waits, unit)
                comm_free = now
                continue
            dur = cost.node_time(node)
            if dur > 0:
                events.append(Event(node.name, "compute", now, dur, _op_name(node.target), unit))
                now += dur
            kind = COLLECTIVE_OPS.get(node.target)
            if kind is not None:
                start = max(now, comm_free)
                priced_by = (group_costs or {}).get(group_name_of(node), cost)
                comm_free = start + priced_by.collective_time(kind, collective_bytes(node))
                events.append(Event(node.name, "comm", start, comm_free - start, kind, unit))
                done[node] = (comm_free, kind)
    return schedule_from_events(events, waits)


def _blocking_gather(node: fx.Node, now: float, comm_free: float, cost: CostModel, events: list[Event],
                     waits: list[Event], unit: int | None) -> float:
    """``zerograph::gather_activation`` (P_a's and hpZ's backward re-gather): an all-gather of
    ``group_size`` pieces and its wait inside one op, so the compute stream launches it
    (``op_overhead_s``), then blocks until the comm stream has run it. Returns the time compute
    resumes (the gather's end), which is also when the comm stream is next free."""
    piece, _, _, group_size = node.args[:4]
    launched = now + cost.op_overhead_s
    if cost.op_overhead_s > 0:
        events.append(Event(node.name, "compute", now, cost.op_overhead_s, _op_name(node.target), unit))
    start = max(launched, comm_free)
    end = start + cost.collective_time("all_gather", tensor_bytes(piece.meta["val"]) * group_size)
    events.append(Event(node.name, "comm", start, end - start, "all_gather", unit))
    waits.append(Event(node.name, "comm", launched, end - launched, "all_gather", unit))
    return end


def _op_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


# ---------------------------------------------------------------------------------------------
# measurement with torch.profiler

# an operator event's name is "namespace::op" ("aten::mm", "_c10d_functional::wait_tensor");
# annotations are not ("CompiledFunction", "autograd::engine::evaluate_function: ...")
_OP_NAME = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*$")
_COMM_THREAD_EVENT = ("gloo:", "nccl:")  # events a process group's worker threads record
_COLLECTIVE_NAMES = {op._schema.name: kind for op, kind in COLLECTIVE_OPS.items()}
_WAIT_NAME = WAIT._schema.name


def measure(step: Callable[[], Any], *, warmup: int = 1, model: Any = None) -> Schedule:
    """Run ``step()`` ``warmup`` times, then once under ``torch.profiler``; return its schedule.
    With ``model`` (a ``zerograph.compile``d model whose dump is on), the schedule is also written
    to the dump as ``measured_schedule.json``.

    Compute events are the top-level operator events (nested ones are part of their parent) of
    the threads that run the step (not the process group's worker threads). Each functional
    collective starts an in-flight comm interval that ends with its ``wait_tensor``; a wait is
    paired with the earliest-issued open collective whose output size matches its input (so
    waits reordered by the scheduling passes still pair right), and its duration is exposed
    communication. Times are relative to the first event of the step.

    Source: ``torch.profiler.profile`` (CPU activity, ``record_shapes`` for the pairing).
    """
    for _ in range(warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    schedule = schedule_from_profile(prof.events())
    if model is not None:
        from ..dump import write_measured_schedule

        write_measured_schedule(model, schedule)
    return schedule


def schedule_from_profile(profile_events: Sequence[Any]) -> Schedule:
    """Build a measured ``Schedule`` from ``torch.profiler``'s ``FunctionEvent`` list (µs times)."""
    comm_threads = {e.thread for e in profile_events if e.name.startswith(_COMM_THREAD_EVENT)}
    ops = sorted((e for e in profile_events if e.thread not in comm_threads and is_top_level_op(e)),
                 key=lambda e: e.time_range.start)
    if not ops:
        return schedule_from_events([])
    origin_us = ops[0].time_range.start

    def seconds(us: float) -> float:
        return (us - origin_us) / _US

    events: list[Event] = []
    waits: list[Event] = []
    open_collectives: list[tuple[Any, str, int | None]] = []  # (event, kind, output numel), issue order
    for e in ops:
        start, dur = seconds(e.time_range.start), (e.time_range.end - e.time_range.start) / _US
        if e.name == _WAIT_NAME:
            issued = _pop_matching(open_collectives, math.prod(e.input_shapes[0]) if e.input_shapes else None)
            kind = issued[1] if issued else None
            waits.append(Event(f"wait_{len(waits)}", "comm", start, dur, kind))
            if issued:
                coll_start = seconds(issued[0].time_range.end)  # in flight once its launch returns
                events.append(Event(f"{kind}_{len(waits) - 1}", "comm", coll_start, start + dur - coll_start, kind))
            continue
        kind = _COLLECTIVE_NAMES.get(e.name)
        if kind is not None:
            open_collectives.append((e, kind, _collective_output_numel(e, kind)))
        events.append(Event(e.name, "compute", start, dur, e.name))  # a collective's launch is CPU work too
    if open_collectives:
        log.warning("%d collectives were never waited within the profiled step", len(open_collectives))
    return schedule_from_events(events, waits)


def is_top_level_op(event: Any) -> bool:
    """True for a profiler event that is an operator (``ns::op``) not nested in another operator."""
    if not _OP_NAME.match(event.name):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if _OP_NAME.match(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def _collective_output_numel(event: Any, kind: str) -> int | None:
    """Elements of a functional collective's output, from its recorded input shape and group size
    (``all_gather_into_tensor(x, group_size, name)``, ``reduce_scatter_tensor(x, op, group_size,
    name)``, ``all_reduce(x, op, name)``); ``None`` when the profile lacks them."""
    if not event.input_shapes:
        return None
    numel = math.prod(event.input_shapes[0])
    if kind == "all_reduce":
        return numel
    concrete = getattr(event, "concrete_inputs", None) or []
    group_size = concrete[1 if kind == "all_gather" else 2] if len(concrete) > 2 else None
    if not isinstance(group_size, int):
        return None
    return numel * group_size if kind == "all_gather" else numel // group_size


def _pop_matching(open_collectives: list[tuple[Any, str, int | None]],
                  numel: int | None) -> tuple[Any, str, int | None] | None:
    """Remove and return the earliest open collective whose output has ``numel`` elements (the
    earliest of all when no size matches or sizes are unknown); ``None`` when none is open."""
    for i, (_, _, out_numel) in enumerate(open_collectives):
        if numel is not None and out_numel == numel:
            return open_collectives.pop(i)
    return open_collectives.pop(0) if open_collectives else None


# ---------------------------------------------------------------------------------------------
# interval arithmetic


def _union(events: Iterable[Event]) -> list[tuple[float, float]]:
    """Disjoint, sorted ``(start, end)`` intervals covering the events."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted((e.start_s, e.end_s) for e in events):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two disjoint, sorted interval lists (a two-pointer sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


__all__ = ["Event", "Schedule", "TRACKS", "measure", "predict", "schedule_from_events", "schedule_from_profile"]
