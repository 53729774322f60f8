"""Measured compute time per graph node: a profiled training step turned into per-node costs.

``measure_node_seconds`` runs a step of a ``zerograph.compile``d model under ``torch.profiler`` and
returns, for each captured graph, ``{node name: seconds}`` of compute, plain data a pass or a
report can read in place of the cost model's roofline estimate. ``profile_step`` does the same
from events a caller already profiled (the benchmark's ``--simulate``), and ``ProfiledCost`` is a
``CostModel`` that answers ``node_time`` from such a measurement, so ``timeline.predict`` can
replay a measured step under another cluster's collectives.

How time is attributed: each compiled graph's execution is one AOTAutograd annotation event
(``CompiledFunction`` for a forward, ``CompiledFunctionBackward`` for a backward); its top-level
operator events are paired, in order and by op name, with the graph's operator nodes
(``match_nodes``); each node is charged its event plus the gap to the next event
(``attribute_seconds``); a ``wait_tensor``'s blocked time goes to no node, since it depends on the
communication, not on the node. A graph whose nodes mostly match no event (Inductor's fused
kernels) has its measured time spread over its nodes in proportion to a cost model's roofline
(``roofline_seconds``).

Source: ``torch.profiler.profile`` events (``FunctionEvent``: ``name``, ``thread``,
``time_range`` in microseconds, ``cpu_parent``); AOTAutograd's ``CompiledFunction`` /
``CompiledFunctionBackward`` ``record_function`` annotations.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import ConfigError
from ..graph.costmodel import WAIT, CostModel
from ..runtime.state import graphs_of
from .timeline import is_top_level_op

REGION_KINDS = {"CompiledFunction": "forward", "CompiledFunctionBackward": "backward"}
STEP_LABEL = "zerograph.profile.step"  # record_function around the step measure_node_seconds profiles
LOOKAHEAD = 8       # profile events skipped at most when matching one graph node to its event
MIN_MATCHED = 0.9   # below this fraction of a graph's operator nodes matched, spread its time by roofline
_US = 1e6           # profiler times are microseconds


@dataclasses.dataclass(frozen=True)
class ProfiledCost(CostModel):
    """A ``CostModel`` whose compute time per node comes from a measured profile.

    ``node_seconds``: FX node -> seconds on the compute stream (nodes absent cost 0, ``wait_tensor``
    always 0: ``timeline.predict`` decides how long a wait blocks). Collectives keep the base
    model's ``collective_time``.
    """

    node_seconds: Mapping[fx.Node, float] = dataclasses.field(default_factory=dict, compare=False)

    def node_time(self, node: fx.Node) -> float:
        if node.op != "call_function" or node.target is WAIT:
            return 0.0
        return self.node_seconds.get(node, 0.0)


@dataclasses.dataclass
class StepProfile:
    """One profiled step of a compiled model, per graph execution.

    Attributes:
        graphs: the graphs in execution order (forwards in capture order, then backwards in reverse).
        labels: ``(capture index, "forward" | "backward")`` of each graph, the keys of
            ``zerograph.runtime.state.graphs_of``.
        seconds: per graph, FX node -> measured compute seconds (waits excluded).
        step_s: the profiled step's wall time (seconds).
        outside_s: seconds of the step outside the graphs (optimizer step, Python, framework).
        matched_fraction: operator nodes paired with a profile event, over all operator nodes.
    """

    graphs: list[fx.GraphModule]
    labels: list[tuple[int, str]]
    seconds: list[dict[fx.Node, float]]
    step_s: float
    outside_s: float
    matched_fraction: float

    def by_node(self) -> dict[fx.Node, float]:
        """Every graph's node seconds in one mapping (``ProfiledCost.node_seconds``)."""
        return {node: s for per_graph in self.seconds for node, s in per_graph.items()}

    def by_name(self) -> list[dict[str, dict[str, float]]]:
        """Plain data shaped like ``graphs_of(model)``: ``[{"forward": {node name: seconds},
        "backward": {...}}]``, one entry per captured graph (names are unique within a graph)."""
        out: list[dict[str, dict[str, float]]] = [{} for _ in range(max((i for i, _ in self.labels), default=-1) + 1)]
        for (index, kind), per_graph in zip(self.labels, self.seconds):
            out[index][kind] = {node.name: s for node, s in per_graph.items()}
        return out


def measure_node_seconds(model: nn.Module, step: Callable[[], Any], *, warmup: int = 1,
                         cost: CostModel | None = None) -> list[dict[str, dict[str, float]]]:
    """Measured compute seconds of every node of ``model``'s captured graphs, from one profiled step.

    Runs ``step()`` (a whole training step of ``model``: forward, backward, optimizer) ``warmup``
    times, then once under ``torch.profiler`` (CPU activity: on GPU the times are the host side of
    each op, as ``timeline.measure`` reads them), and attributes the time as the module docstring
    says. Returns ``[{"forward": {node name: seconds}, "backward": {node name: seconds}}]``, one
    entry per captured graph in the order of ``zerograph.runtime.state.graphs_of(model)``; node names are
    those of the final, compiled graphs. A graph whose ops do not match its nodes (Inductor) is
    spread by ``cost``'s roofline, or left empty (``{}``) when ``cost`` is ``None``.

    Raises ``ConfigError`` when the profiled step did not run exactly the captured graphs (e.g. a
    recompile happened during it: warm up longer) or ``model`` is not compiled.

    Source: ``torch.profiler.profile``; AOTAutograd's ``CompiledFunction`` annotations.
    """
    for _ in range(warmup):
        step()
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
          torch.profiler.record_function(STEP_LABEL)):
        step()
    events = list(prof.events())
    window = next(e for e in events if e.name == STEP_LABEL)
    return profile_step(model, events, window, cost).by_name()


def profile_step(model: nn.Module, events: Sequence[Any], window: Any, cost: CostModel | None = None) -> StepProfile:
    """Attribute one profiled step of ``model`` to its graphs' nodes.

    ``events``: ``torch.profiler``'s ``FunctionEvent`` list; ``window``: the event spanning the
    step (its thread is the training thread). A graph with fewer than ``MIN_MATCHED`` of its
    operator nodes matched has its measured time spread by ``roofline_seconds`` with ``cost``
    (nothing when ``cost`` is ``None``).

    Raises ``ConfigError`` when the step ran graphs other than the captured ones (kinds and count).
    """
    captured = graphs_of(model)
    labels = ([(i, "forward") for i, g in enumerate(captured) if "forward" in g]
              + [(i, "backward") for i, g in reversed(list(enumerate(captured))) if "backward" in g])
    regions = graph_regions(events, window)
    kinds = [REGION_KINDS[r.name] for r in regions]
    if kinds != [kind for _, kind in labels]:
        forwards = sum(1 for _, k in labels if k == "forward")
        raise ConfigError(f"profiled step ran graphs {kinds}, captured {forwards} forward and "
                          f"{len(labels) - forwards} backward")
    graphs = [captured[i][kind] for i, kind in labels]
    seconds: list[dict[fx.Node, float]] = []
    matched = total = 0
    for region, gm in zip(regions, graphs):
        ops = region_ops(events, region)
        pairs = match_nodes(gm.graph, ops)
        operators = sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        if len(pairs) >= MIN_MATCHED * operators:
            seconds.append(attribute_seconds(region, pairs))
        else:  # fused kernels (Inductor): spread the measured time over the nodes by their roofline
            seconds.append(roofline_seconds(region, ops, gm.graph, cost) if cost is not None else {})
        matched += len(pairs)
        total += operators
    inside = sum(r.time_range.end - r.time_range.start for r in regions) / _US
    step_s = (window.time_range.end - window.time_range.start) / _US
    return StepProfile(graphs, labels, seconds, step_s, step_s - inside, matched / max(total, 1))


def graph_regions(events: Sequence[Any], window: Any) -> list[Any]:
    """The compiled graphs' executions inside ``window``: AOTAutograd's annotation events on its thread."""
    return sorted((e for e in events if e.name in REGION_KINDS and e.thread == window.thread
                   and window.time_range.start <= e.time_range.start <= window.time_range.end),
                  key=lambda e: e.time_range.start)


def region_ops(events: Sequence[Any], region: Any) -> list[Any]:
    """Top-level operator events of ``region``'s thread that start inside it, in time order."""
    return sorted((e for e in events if e.thread == region.thread and is_top_level_op(e)
                   and region.time_range.start <= e.time_range.start < region.time_range.end),
                  key=lambda e: e.time_range.start)


def match_nodes(graph: fx.Graph, ops: Sequence[Any]) -> list[tuple[Any, fx.Node]]:
    """Pair the graph's operator nodes with the profile's op events, in order, by op name
    (``aten::mm`` ...); an event no node claims within ``LOOKAHEAD`` is skipped (e.g. the
    runtime's schedule check). Returns ``(event, node)`` pairs in execution order."""
    pairs, j = [], 0
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name
        for k in range(j, min(j + LOOKAHEAD, len(ops))):
            if ops[k].name == name:
                pairs.append((ops[k], node))
                j = k + 1
                break
    return pairs


def attribute_seconds(region: Any, pairs: Sequence[tuple[Any, fx.Node]]) -> dict[fx.Node, float]:
    """Seconds of ``region`` charged to each matched node: its own event plus the gap to the next
    event (Python between ops, unmatched events). A ``wait_tensor``'s blocked time is left out,
    since the simulation recomputes it, and the gap after a wait goes to the node after it (that
    time cannot hide the awaited collective)."""
    seconds: dict[fx.Node, float] = {}
    previous, pending = None, 0.0
    cursor = region.time_range.start
    for event, node in pairs:
        gap = max(0.0, event.time_range.start - cursor) / _US
        if previous is None:
            pending += gap
        else:
            seconds[previous] += gap
        cursor = max(cursor, event.time_range.end)
        if node.target is WAIT:
            previous = None
            continue
        seconds[node] = seconds.get(node, 0.0) + pending + (event.time_range.end - event.time_range.start) / _US
        previous, pending = node, 0.0
    tail = max(0.0, region.time_range.end - cursor) / _US
    if previous is not None:
        seconds[previous] += tail
    elif seconds:  # the region ended on a wait: the tail follows the last node
        seconds[next(reversed(seconds))] += pending + tail
    return seconds


def roofline_seconds(region: Any, ops: Sequence[Any], graph: fx.Graph, cost: CostModel) -> dict[fx.Node, float]:
    """The region's measured time less its waits, shared among the graph's nodes in proportion
    to ``cost.node_time`` (roofline): for lowered code whose ops are not the graph's nodes."""
    waited = sum(e.time_range.end - e.time_range.start for e in ops if e.name == WAIT._schema.name) / _US
    budget = max(0.0, (region.time_range.end - region.time_range.start) / _US - waited)
    estimates = {n: cost.node_time(n) for n in graph.nodes if n.op == "call_function" and n.target is not WAIT}
    total = sum(estimates.values())
    return {n: t * budget / total for n, t in estimates.items() if t > 0} if total > 0 else {}


__all__ = [
    "ProfiledCost",
    "StepProfile",
    "attribute_seconds",
    "match_nodes",
    "measure_node_seconds",
    "profile_step",
    "roofline_seconds",
]
