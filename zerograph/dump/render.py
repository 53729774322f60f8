"""The final graph as Graphviz: ``graph.dot`` always, ``graph.svg`` where Graphviz's ``dot`` is
installed. One box per node, collectives and waits filled, release points outlined, one cluster
per unit.

Source: pydot (``pydot.Dot``); Graphviz's ``dot -Tsvg``.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from zerograph.graph.vocab import TAG

from ..shard.sharding import Unit
from .annotate import collectives, op_name, releases, tagged_units

log = logging.getLogger(__name__)

SVG_MAX_NODES = 4000       # Graphviz layout time grows fast with size; beyond this only graph.dot
SVG_TIMEOUT_S = 120        # seconds given to ``dot -Tsvg`` before the SVG is skipped
NODE_STYLE = {  # fill colours (ColorBrewer pastel)
    "all_gather": "#9ecae1", "reduce_scatter": "#fdae6b", "all_reduce": "#fdae6b", "wait": "#fff7bc",
    "placeholder": "#eeeeee", "output": "#eeeeee",
}
RELEASE_COLOUR = "#e34a33"


def module_unit(node: fx.Node, units: Sequence[Unit]) -> int | None:
    """The non-root unit whose module ran ``node`` (``nn_module_stack``, or ``fwd_nn_module_stack``
    for backward nodes), or ``None``. Root-unit compute stays outside clusters: it sits at both
    ends of a transformer's graph, and one cluster would pull the two ends together."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).lstrip(".")  # h[0] -> h.0
    owners = [unit for unit in units[1:] if path == unit.name or path.startswith(unit.name + ".")]
    return max(owners, key=lambda unit: len(unit.name)).index if owners else None  # the innermost unit


def dot_graph(graph: fx.Graph, units: Sequence[Unit]) -> Any:
    """The graph as a ``pydot.Dot``: one box per node (name, op, shape), an edge per data
    dependency, collectives and waits filled, release points outlined red, one cluster per unit."""
    import pydot

    dot = pydot.Dot("zerograph", graph_type="digraph", rankdir="TB", fontname="Helvetica")
    dot.set_node_defaults(shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica", fontsize="10")
    clusters: dict[int, Any] = {}
    found = collectives(graph)
    kind_of = {c["node"]: c["kind"] for c in found}
    waits = {c["wait_node"] for c in found}
    released = {r["node"]: r for r in releases(graph) if r["position"] is not None}
    for node in graph.nodes:
        val = node.meta.get("val")
        shape = f"\n{list(val.shape)}" if isinstance(val, torch.Tensor) else ""
        attrs: dict[str, str] = {"label": f"{node.name}\n{op_name(node)}{shape}"}
        style = kind_of.get(node.name) or ("wait" if node.name in waits else node.op)
        if style in NODE_STYLE:
            attrs["fillcolor"] = NODE_STYLE[style]
        if node.name in released:
            r = released[node.name]
            attrs.update(color=RELEASE_COLOUR, penwidth="2.5")
            what = "gathered params" if r["role"] == "gather" else "full grads"
            attrs["label"] += f"\nrelease {what} of unit {','.join(map(str, r['units']))}"
        tagged = tagged_units(node.meta.get(TAG, {}))
        unit = tagged[0] if tagged else module_unit(node, units)
        parent = dot
        if unit is not None:
            if unit not in clusters:
                clusters[unit] = pydot.Cluster(f"unit{unit}", label=f"unit {unit}: {units[unit].name}",
                                               style="dashed", color="#888888")
                dot.add_subgraph(clusters[unit])
            parent = clusters[unit]
        parent.add_node(pydot.Node(node.name, **attrs))
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            dot.add_edge(pydot.Edge(inp.name, node.name))
    return dot


def write_rendering(directory: str, graph: fx.Graph, units: Sequence[Unit]) -> None:
    """``graph.dot``, and ``graph.svg`` when Graphviz's ``dot`` is on the PATH and the graph is
    small enough to lay out quickly (``SVG_MAX_NODES``)."""
    dot_path = os.path.join(directory, "graph.dot")
    with open(dot_path, "w") as f:
        f.write(dot_graph(graph, units).to_string())
    if shutil.which("dot") is None or len(graph.nodes) > SVG_MAX_NODES:
        return
    try:  # a subprocess with a timeout: pydot's own writer would wait for as long as dot takes
        subprocess.run(["dot", "-Tsvg", dot_path, "-o", os.path.join(directory, "graph.svg")],
                       check=True, capture_output=True, timeout=SVG_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("zerograph dump: no graph.svg for %s (%s)", directory, exc)


