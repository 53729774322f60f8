"""The memory timeline of one graph: live bytes after each node by category (``memory.json``) and
its stacked plot (``memory.png``).

Source: ``passes/liveness.py`` (roles and the aliasing rule); matplotlib's object API (``Figure``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from zerograph.passes.liveness import storage_root, timeline

from .annotate import collectives, last_reads, node_bytes, op_name

MEMORY_CATEGORIES = ("parameters", "gathered parameters", "gradients", "activations", "buffers")
# liveness roles -> memory category (the roles passes/liveness.py assigns)
ROLE_CATEGORY = {"gather": "gathered parameters", "full_grad": "gradients", "reduce": "gradients"}


def held_inputs(gm: fx.GraphModule, dynamo: fx.GraphModule | None, input_params: Sequence[str | None],
                param_bytes: Mapping[str, int]) -> tuple[dict[str, str], dict[str, int]]:
    """Graph inputs the module holds for the whole step, so the graph never frees them.

    Returns ``(placeholder name -> "parameters" | "buffers", category -> bytes held)``. A
    placeholder is traced back to its Dynamo input through AOTAutograd's input descriptor
    (``meta["desc"]``, e.g. the ``_local_tensor`` of a ``DTensor`` parameter); ``input_params``
    names the Dynamo inputs that are parameters (``None`` for the others), and Dynamo names
    buffer inputs ``..._buffers_...``. ``param_bytes``: parameter name -> this rank's shard bytes.
    """
    dynamo_inputs = dynamo.graph.find_nodes(op="placeholder") if dynamo is not None else []
    category_of_input: dict[int, str] = {}
    held = dict.fromkeys(("parameters", "buffers"), 0)
    for i, node in enumerate(dynamo_inputs):
        if i < len(input_params) and input_params[i]:
            category_of_input[i] = "parameters"
            held["parameters"] += param_bytes.get(input_params[i], 0)
        elif "_buffers_" in node.name:
            category_of_input[i] = "buffers"
            val = node.meta.get("example_value")
            held["buffers"] += val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
    placeholders = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        while hasattr(desc, "base"):  # SubclassGetAttrAOTInput(base=PlainAOTInput(idx=1), ...)
            desc = desc.base
        if type(desc).__name__ in ("PlainAOTInput", "ParamAOTInput", "BufferAOTInput"):
            category = category_of_input.get(getattr(desc, "idx", -1))
            if category is not None:
                placeholders[node.name] = category
    return placeholders, held


def memory_timeline(graph: fx.Graph, held: tuple[dict[str, str], dict[str, int]],
                    carried: Mapping[str, tuple[str, int]] | None = None) -> dict[str, Any]:
    """Live bytes after each node, split into ``MEMORY_CATEGORIES``.

    Parameters and buffers (``held``, from ``held_inputs``) are held by the module for the whole
    graph. Gathered parameters and gradients are ``passes/liveness.py``'s roles (``carried``: roles
    of placeholders saved by the forward, as ``Timeline.saved``). Activations are every other
    tensor the graph holds (inputs, saved values, intermediates), each live from its definition to
    its last reader by the same rule as liveness, so the categories add up to what the graph holds.
    The placeholders all exist on entry, so the first nodes (the inputs) show their full level.

    Returns a JSON-able dict: ``nodes``, ``ops``, ``live_bytes`` {category: [bytes per node]},
    ``total``, ``peak_bytes`` {category and "total": bytes}, ``collectives`` (positions and kinds).
    """
    placeholders, held_bytes = held
    nodes = list(graph.nodes)
    end = len(nodes)
    roles = timeline(graph, dict(carried or {}))
    last = last_reads(graph)
    delta = np.zeros(end + 2, dtype=np.int64)
    for i, node in enumerate(nodes):
        if node.name in placeholders or storage_root(node) is not node:
            continue
        size = node_bytes(node)
        if size:
            delta[i] += size
            delta[last.get(node, i) + 1] -= size
    everything = np.cumsum(delta[:end])  # all the graph holds, held inputs excluded
    by_role = {cat: np.zeros(end, dtype=np.int64) for cat in set(ROLE_CATEGORY.values())}
    for i, live in enumerate(roles.live):
        for role, nbytes in live.items():
            by_role[ROLE_CATEGORY[role]][i] += nbytes
    series = {
        "parameters": np.full(end, held_bytes["parameters"], dtype=np.int64),
        "gathered parameters": by_role["gathered parameters"],
        "gradients": by_role["gradients"],
        "activations": np.maximum(everything - by_role["gathered parameters"] - by_role["gradients"], 0),
        "buffers": np.full(end, held_bytes["buffers"], dtype=np.int64),
    }
    inputs = sum(1 for n in nodes if n.op == "placeholder")  # FX lists every input first
    if 0 < inputs < end:  # inputs all exist on entry: show the prefix at its full level, not ramping up
        for values in series.values():
            values[:inputs] = values[inputs - 1]
    total = sum(series.values())
    return {
        "unit": "bytes",
        "nodes": [n.name for n in nodes],
        "ops": [op_name(n) for n in nodes],
        "live_bytes": {cat: series[cat].tolist() for cat in MEMORY_CATEGORIES},
        "total": total.tolist(),
        "peak_bytes": {**{cat: int(series[cat].max(initial=0)) for cat in MEMORY_CATEGORIES},
                       "total": int(total.max(initial=0))},
        "collectives": [{"position": c["start"], "kind": c["kind"], "units": c["units"]} for c in collectives(graph)],
    }


def plot_memory(memory: Mapping[str, Any], path: str, title: str) -> None:
    """Stacked live bytes per category over the graph's nodes as a PNG, collectives marked.

    Uses matplotlib's object API (``Figure`` + Agg) so the caller's pyplot backend is left alone.
    """
    from matplotlib.figure import Figure

    peak = max(memory["total"], default=0)
    scale, unit = (2**20, "MiB") if peak >= 2**20 else (2**10, "KiB")
    x = np.arange(len(memory["nodes"]))
    fig = Figure(figsize=(11, 4.5))
    fig.subplots_adjust(left=0.07, right=0.82, top=0.93, bottom=0.11)  # fixed margins: a layout engine costs a draw
    ax = fig.add_subplot()
    ax.stackplot(x, *[np.asarray(memory["live_bytes"][cat]) / scale for cat in MEMORY_CATEGORIES],
                 labels=MEMORY_CATEGORIES, alpha=0.85)
    colours = {"all_gather": "tab:blue", "reduce_scatter": "tab:red", "all_reduce": "tab:red"}
    for kind in colours:
        marks = [c["position"] for c in memory["collectives"] if c["kind"] == kind]
        if marks:
            ax.vlines(marks, 0, peak / scale, colors=colours[kind], linestyles="dashed", linewidth=0.8,
                      label=f"{kind} issued")
    ax.set_xlabel("node (graph order)")
    ax.set_ylabel(f"live {unit}")
    ax.set_title(title)
    ax.set_xlim(0, max(len(x) - 1, 1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside: never hides data
    fig.savefig(path, dpi=100)


