"""The files written once a graph's pipeline has run (called by the backend): the final graph's
rendering, memory timeline and predicted schedule, the step's schedule and the rank's summary;
then the graph is marked complete in the rank's manifest.

Source: see the modules it calls (``render``, ``memory``, ``schedule``, ``report``).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ..report.timeline import predict
from .manifest import rank_manifest, write_json
from .memory import held_inputs, memory_timeline, plot_memory
from .render import write_rendering
from .report import _LAST_TOTALS, build_report, write_summary_files
from .schedule import _COST_MODELS, write_schedule

GRAPH_RESULT_FILES = ("graph.dot", "graph.svg", "memory.json", "memory.png", "schedule.json")


def finish_graph(directory: str | None, kind: str, gm: Any, runtime: Any, captured: Any, graph_id: int,
                 carried: Mapping[str, tuple[str, int]] | None = None, traced: bool = False) -> None:
    """Write the final graph's rendering, memory timeline and predicted schedule into ``directory``;
    at the rank's root, after a backward graph the step's schedule, and after a forward, backward
    or inference graph ``summary.md`` (totals come from ``write_summary`` / ``explain`` after a step;
    a later compile keeps the last ones written). Every file is recorded in the rank's manifest,
    and the graph is marked ``complete`` there once its own files are written (the partitioned
    pair, ``gm`` a ``PartitionedGraphs``, has none besides its pass log). ``traced``: emit
    the collective schedule, memory timeline and predicted schedule to PyTorch's structured trace
    too (``dump.trace``); ``directory`` ``None``: only that, no file.

    ``runtime``: ``zerograph.runtime.runtime.Runtime``; ``captured``: ``CapturedGraphs``; ``carried``: roles
    of the placeholders a forward saved (backward graphs). Schedules need the cost model that
    ``calibrate_once`` cached at the backend's entry; without it they are skipped. No collective.
    """
    if kind == "partitioned":  # the pair goes on into the forward and backward pipelines, whose folders render it
        if directory is not None:
            rank_manifest(os.path.dirname(directory), runtime.topology.mesh_rank, runtime.topology.dp_size).finish_graph(
                os.path.basename(directory))
        return
    param_bytes = {layout.fqn: math.prod(layout.local_shape(runtime.topology.rank)) * layout.dtype.itemsize
                   for layout in runtime.marker_layouts.values()}  # the units' flat shards too
    held = held_inputs(gm, captured.graphs[graph_id].get("dynamo"), captured.input_params[graph_id], param_bytes)
    memory = memory_timeline(gm.graph, held, carried)
    cost = _COST_MODELS.get(runtime.topology.group_name)  # from ``calibrate_once`` at the backend's entry
    if traced:
        from .trace import emit_graph_results

        schedule = predict([gm], cost) if kind != "joint" and cost is not None else None
        emit_graph_results(kind, gm.graph, memory, schedule)
    if directory is None:
        return
    rank_dir = os.path.dirname(directory)
    manifest = rank_manifest(rank_dir, runtime.topology.mesh_rank, runtime.topology.dp_size)
    write_rendering(directory, gm.graph, runtime.units)
    write_json(os.path.join(directory, "memory.json"), memory)
    plot_memory(memory, os.path.join(directory, "memory.png"),
                f"rank {runtime.topology.mesh_rank}, graph {graph_id} {kind}: live bytes (stage {runtime.stage})")
    if kind != "joint" and cost is not None:  # the joint graph never runs as such: no schedule
        write_schedule(os.path.join(directory, "schedule.json"), [gm], cost)
    manifest.record(*(path for name in GRAPH_RESULT_FILES if os.path.exists(path := os.path.join(directory, name))))
    manifest.finish_graph(os.path.basename(directory))
    if kind == "joint":
        return  # no summary yet: the forward and backward graphs come next
    if kind == "backward" and cost is not None:  # a training step: forwards in order, then backwards reversed
        step = ([r["forward"] for r in captured.graphs if "forward" in r]
                + [r["backward"] for r in reversed(captured.graphs) if "backward" in r])
        write_schedule(os.path.join(rank_dir, "schedule.json"), step, cost)
        manifest.record(os.path.join(rank_dir, "schedule.json"))
    _write_templates(rank_dir, captured, manifest)
    report = build_report(runtime, captured, None)
    if rank_dir in _LAST_TOTALS:  # keep the totals this process's last ``explain`` wrote there
        report["totals"] = _LAST_TOTALS[rank_dir]
    write_summary_files(rank_dir, report)


def _write_templates(rank_dir: str, captured: Any, manifest: Any) -> None:
    """The code of each unit template's forward and backward graph, ``template<id>_<kind>.py``."""
    for template in getattr(captured, "templates", []):
        for kind, gm in (("forward", template.forward_graph), ("backward", template.backward_graph)):
            path = os.path.join(rank_dir, f"template{template.id}_{kind}.py")
            with open(path, "w") as f:
                f.write(f"# unit template {template.id}, called by {', '.join(template.units)}\n{gm.code}")
            manifest.record(path)
