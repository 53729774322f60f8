"""The dump behind ``ZEROGRAPH_DUMP`` / ``Config(dump_dir=)``: what the passes did, readable by a person.

Layout (``<root>`` is the dump directory)::

    <root>/rank<r>/summary.md, summary.json   per unit: size, where gathered / released / prefetched /
                                              reduced; totals against the paper's formulas
    <root>/rank<r>/schedule.json              predicted schedule of one step (Chrome trace)
    <root>/rank<r>/graph<g>_<kind>/           kind: joint | forward | backward | inference
        00_input.py, NN_<pass>.py   the graph before the first pass and after each pass that changed
                                    it, zerograph's nodes commented (unit, elements, bytes, collective)
        NN_<pass>.diff              unified diff against the previous file
        passes.json                 per pass: nodes before/after, change per op kind, a one-line summary
        graph.dot, graph.svg        the final graph, collectives / waits / releases coloured, one
                                    cluster per unit (SVG only where Graphviz's ``dot`` exists)
        memory.json, memory.png     live bytes after each node by category
        schedule.json               predicted schedule of this graph alone (Chrome trace)

Dumping off costs nothing: ``passes/manager.py`` and ``zerograph/capture.py`` import this module only
when a dump directory is set. Files are written as each graph is compiled; ``summary.md`` is
rewritten with the step's totals by ``write_summary`` / ``explain`` once a step has finished.

Source: torchtitan's graph-pass debug dumps (each graph before/after a pass, op-count diffs);
``torch.fx.GraphModule.print_readable``; the Chrome Trace Event Format (``zerograph.timeline``).
"""
from __future__ import annotations

import collections
import difflib
import json
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from zerograph.passes._fx import find_collectives
from zerograph.vocab import TAG, full_buffer
from zerograph.passes.activation_partition import ACTIVATION
from zerograph.passes.liveness import reads, storage_root, timeline

from .sharding import Unit

log = logging.getLogger(__name__)

MEMORY_CATEGORIES = ("parameters", "gathered parameters", "gradients", "activations", "buffers")
# liveness roles -> memory category (the roles passes/liveness.py assigns)
ROLE_CATEGORY = {"gather": "gathered parameters", "full_grad": "gradients", "reduce": "gradients"}
# ops listed first in a pass's change summary: what zerograph inserts and removes
ZEROGRAPH_OPS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor", "all_reduce",
                 "wait_tensor", "unshard", "reduce_grad", "pool_buffer", "pack_shards_out")
SUMMARY_KINDS = 8          # op kinds named in a one-line change summary (passes.json has them all)
SVG_MAX_NODES = 4000       # Graphviz layout time grows fast with size; beyond this only graph.dot
SVG_TIMEOUT_S = 120        # seconds given to ``dot -Tsvg`` before the SVG is skipped
KIND_ABBREV = {"joint": "joint", "forward": "fwd", "backward": "bwd", "inference": "inf"}


# ---------------------------------------------------------------------------------------------
# facts about one graph (plain data, shared by the comments, the rendering and the summary)


def op_name(node: fx.Node) -> str:
    """Short name of what a node does: ``all_gather_into_tensor`` for
    ``torch.ops._c10d_functional.all_gather_into_tensor.default``; the op kind for non-calls."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", str(target))


def op_counts(graph: fx.Graph) -> collections.Counter:
    return collections.Counter(op_name(node) for node in graph.nodes)


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _units_of(tag: Mapping[str, Any]) -> tuple[int, ...]:
    """Units a tagged node serves; bucketed collectives list several (``units``). A marker
    tagged by ``bucketing`` only (no ``role`` yet) serves none."""
    return tuple(tag.get("units", [tag["unit"]] if "unit" in tag else []))


def last_reads(graph: fx.Graph) -> dict[fx.Node, int]:
    """Storage root -> position of the last node that keeps it alive (``len(nodes)`` when it
    reaches the output). Same rule as ``passes/liveness.py``: views and waits alias their input,
    and a wait keeps its collective's send buffer alive."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[fx.Node, int] = {}
    for node in nodes:
        for inp in reads(node):
            root = storage_root(inp)
            last[root] = len(nodes) if node.op == "output" else max(last.get(root, pos[root]), pos[node])
    return last


def releases(graph: fx.Graph) -> list[dict[str, Any]]:
    """Where each unit's gathered parameters (role ``gather``) and full gradients (``full_grad``)
    die: ``[{"role", "units", "node", "position", "tensors", "freed_bytes"}]`` in graph order.

    ``position`` is the last reader of the group's last tensor (the eager lowering frees it right
    after that node); ``None`` when a tensor reaches the graph's output (saved for backward).
    ``tensors``: buffers of the group (send buffer, gathered buffer, copied-out parameters);
    ``freed_bytes``: bytes of those whose last reader is that node.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    groups: dict[tuple[str, tuple[int, ...]], list[fx.Node]] = {}
    seen: set[fx.Node] = set()
    for node in nodes:
        tag = node.meta.get(TAG, {})
        if tag.get("role") == "gather" and storage_root(node) is node and _nbytes(node):
            groups.setdefault(("gather", _units_of(tag)), []).append(node)
        elif tag.get("role") == "reduce":  # the untagged inputs of a reduction's copy-in are full gradients
            for inp in node.all_input_nodes:
                root = storage_root(inp)
                if TAG not in root.meta and root.op != "placeholder" and root not in seen:
                    seen.add(root)
                    groups.setdefault(("full_grad", _units_of(tag)), []).append(root)
    last = last_reads(graph)
    found = []
    for (role, units), roots in groups.items():
        final = max(last.get(r, pos[r]) for r in roots)
        kept = final >= len(nodes)
        found.append({"role": role, "units": list(units), "node": "output" if kept else nodes[final].name,
                      "position": None if kept else final, "tensors": len(roots),
                      "freed_bytes": sum(_nbytes(r) for r in roots if last.get(r, pos[r]) == final)})
    return sorted(found, key=lambda r: len(nodes) if r["position"] is None else r["position"])


def collectives(graph: fx.Graph) -> list[dict[str, Any]]:
    """Every tagged collective: ``[{"kind", "role", "units", "node", "wait_node", "copy_in",
    "copy_out", "start", "wait", "ahead", "elements", "bytes"}]``; ``copy_in`` / ``copy_out`` name
    the first node packing its input / unpacking its result (``passes._fx.find_collectives``);
    ``start`` / ``wait`` are node positions, ``ahead = wait - start``
    (how many nodes run between issuing the collective and waiting for it), ``elements`` /
    ``bytes`` the full (unsharded) buffer, as ``passes.manager.collective_volume`` counts it."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    found = []
    for c in find_collectives(graph):
        val = full_buffer(c.start)
        found.append({"kind": c.kind, "role": c.role, "units": list(c.units), "node": c.start.name,
                      "wait_node": c.wait.name, "copy_in": c.issue[0].name if len(c.issue) > 1 else None,
                      "copy_out": c.finish[1].name if len(c.finish) > 1 else None,
                      "start": pos[c.start], "wait": pos[c.wait],
                      "ahead": pos[c.wait] - pos[c.start], "elements": val.numel(), "bytes": c.full_bytes})
    return found


def unit_label(units: Sequence[Unit], ids: Sequence[int]) -> str:
    """``unit 1 'blocks.0' (12 params)`` or, for a bucket, ``units 1, 2 ('blocks.0', 'blocks.1'; 24 params)``."""
    params = sum(len(units[i].keys) for i in ids)
    if len(ids) == 1:
        return f"unit {ids[0]} '{units[ids[0]].name}' ({params} params)"
    names = ", ".join(f"'{units[i].name}'" for i in ids)
    return f"units {', '.join(map(str, ids))} ({names}; {params} params)"


# ---------------------------------------------------------------------------------------------
# the graph as commented Python, and what each pass changed


def node_comments(graph: fx.Graph, units: Sequence[Unit]) -> dict[str, list[str]]:
    """Node name -> comment lines for zerograph's nodes: each collective (kind, unit, full
    elements and bytes), each wait (how far after its collective), each release point, and each
    unit's activation decision (keep / recompute, ``activation_partition``)."""
    comments: dict[str, list[str]] = collections.defaultdict(list)
    for c in collectives(graph):
        who = unit_label(units, c["units"])
        if c["copy_in"]:
            comments[c["copy_in"]].append(f"zerograph: copy-in for the {c['kind']} of {who}: one flat buffer")
        comments[c["node"]].append(f"zerograph: {c['kind']} of {who}: {c['elements']:,} elements, "
                                   f"{c['bytes']:,} bytes (full buffer)")
        comments[c["wait_node"]].append(f"zerograph: wait for {c['node']} ({who}), issued {c['ahead']} node(s) earlier")
        if c["copy_out"]:
            comments[c["copy_out"]].append(f"zerograph: copy-out of the {c['kind']} of {who}")
    for r in releases(graph):
        if r["position"] is None:
            continue
        what = "gathered parameters" if r["role"] == "gather" else "full gradients"
        freed = f"the last {r['freed_bytes']:,} bytes of its {r['tensors']} buffers are freed after this line"
        comments[r["node"]].append(f"zerograph: release of {unit_label(units, r['units'])} {what}: last use; {freed}")
    for node in graph.nodes:  # activation_partition's decision, on each planned unit's first forward node
        note = node.meta.get(ACTIVATION, {}).get("note")
        if note:
            comments[node.name].append(f"zerograph: {note}")
    return comments


# one statement of a GraphModule's forward body: 8 spaces, the node's name, an optional type annotation
_STATEMENT = re.compile(r'^ {8}([A-Za-z_]\w*)(?::\s*"[^"]*")?\s*=\s')


def readable_python(gm: fx.GraphModule, units: Sequence[Unit]) -> str:
    """``gm.print_readable()`` with ``node_comments`` above their statements.

    Comments only: the text stays Python that ``ast.parse`` accepts.
    """
    comments = node_comments(gm.graph, units)
    out = []
    for line in gm.print_readable(print_output=False).splitlines():
        match = _STATEMENT.match(line)
        if match and match.group(1) in comments:
            out.extend(f"        # {text}" for text in comments[match.group(1)])
        out.append(line)
    return "\n".join(out) + "\n"


def describe_changes(before: Mapping[str, int], after: Mapping[str, int], moved: int = 0) -> tuple[dict[str, int], str]:
    """Per-op-kind change between two ``op_counts`` and a one-line summary of it, e.g.
    ``nodes 541 -> 703 (+162): +3 all_gather_into_tensor, +3 wait_tensor, -28 unshard, +59 view``.

    zerograph's own ops come first, then the others by size of change (ties by name, so the line
    is the same on every run). ``moved``: nodes that changed place, named when no op changed.
    """
    changes = {op: after.get(op, 0) - before.get(op, 0) for op in set(before) | set(after)}
    changes = {op: d for op, d in changes.items() if d}
    ordered = sorted(changes, key=lambda op: (op not in ZEROGRAPH_OPS, -abs(changes[op]), op))
    n_before, n_after = sum(before.values()), sum(after.values())
    parts = [f"{changes[op]:+d} {op}" for op in ordered[:SUMMARY_KINDS]]
    if len(ordered) > SUMMARY_KINDS:
        parts.append(f"... {len(ordered) - SUMMARY_KINDS} more kinds")
    if not parts:
        parts = [f"{moved} nodes moved" if moved else "no node added, removed or moved (metadata only)"]
    line = f"nodes {n_before} -> {n_after} ({n_after - n_before:+d}): " + ", ".join(parts)
    return {op: changes[op] for op in ordered}, line


def nodes_moved(before: Sequence[str], after: Sequence[str]) -> int:
    """Nodes of ``after`` outside the longest common subsequence of the two node orders."""
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    return len(after) - sum(block.size for block in matcher.get_matching_blocks())


class GraphDump:
    """Writes one graph's pass-by-pass dump into ``directory``; ``run_pipeline`` drives it.

    ``passes.json`` is rewritten after every pass, so a pipeline that fails part-way leaves a
    consistent dump of the passes that ran (the one to read when a ``PassError`` names a pass).
    """

    def __init__(self, directory: str, ctx: Any, gm: fx.GraphModule) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory, self.ctx = directory, ctx
        self._counts = op_counts(gm.graph)
        self._order = [n.name for n in gm.graph.nodes]
        self._file = "00_input.py"
        self._body = self._write_python(self._file, gm, "input, before the first pass")
        nodes = sum(self._counts.values())
        self.entries: list[dict[str, Any]] = [
            {"number": 0, "pass": "input", "file": self._file, "nodes": nodes, "summary": f"nodes {nodes}"}]
        self._save_log()

    def after_pass(self, number: int, name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
        """Record pass ``number`` (``name``), which ran in ``seconds``; write its graph and diff when
        it ``modified`` the graph."""
        counts = op_counts(gm.graph)
        order = [n.name for n in gm.graph.nodes]
        moved = nodes_moved(self._order, order) if modified and counts == self._counts else 0
        changes, summary = describe_changes(self._counts, counts, moved)
        entry: dict[str, Any] = {"number": number, "pass": name, "modified": modified, "seconds": seconds,
                                 "nodes_before": sum(self._counts.values()), "nodes_after": sum(counts.values()),
                                 "changes": changes, "summary": summary if modified else "unchanged"}
        if modified:
            file = f"{number:02d}_{name}.py"
            body = self._write_python(file, gm, f"after pass {number} {name}")
            entry["file"], entry["diff"] = file, f"{number:02d}_{name}.diff"
            with open(os.path.join(self.directory, entry["diff"]), "w") as f:  # bodies only: headers always differ
                f.writelines(difflib.unified_diff(self._body.splitlines(keepends=True), body.splitlines(keepends=True),
                                                  fromfile=self._file, tofile=file))
            self._file, self._body = file, body
        self._counts, self._order = counts, order
        self.entries.append(entry)
        self._save_log()

    def disabled(self, number: int, name: str) -> None:
        """Record that pass ``number`` was switched off by ``Config.disabled_passes``."""
        self.entries.append({"number": number, "pass": name, "disabled": True, "summary": "disabled"})
        self._save_log()

    def _write_python(self, file: str, gm: fx.GraphModule, when: str) -> str:
        """Write the header and the commented graph; return the graph part (what diffs compare)."""
        ctx = self.ctx
        header = (f"# zerograph dump: {ctx.graph_kind} graph, {when}; stage {ctx.stage}, world size {ctx.world_size}\n"
                  "# units: " + "; ".join(unit_label(ctx.units, [u.index]) for u in ctx.units) + "\n")
        body = readable_python(gm, ctx.units)
        with open(os.path.join(self.directory, file), "w") as f:
            f.write(header + body)
        return body

    def _save_log(self) -> None:
        _write_json(os.path.join(self.directory, "passes.json"), self.entries)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


# ---------------------------------------------------------------------------------------------
# memory timeline


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
        size = _nbytes(node)
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


# ---------------------------------------------------------------------------------------------
# rendering of the final graph

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
        tagged = _units_of(node.meta.get(TAG, {}))
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


# ---------------------------------------------------------------------------------------------
# predicted schedule

_COST_MODELS: dict[str, Any] = {}


def calibrate_once(group: Any) -> Any:
    """Calibrate ``zerograph.costmodel`` on ``group`` once per process (later calls return the
    cached model); ``None`` when the module is missing.

    Collective: every rank of ``group`` must call it at the same point the first time. The
    backend does so at its entry, on every rank alike, and not inside AOTAutograd's compilers,
    where collectives on real tensors hang.
    """
    key = getattr(group, "group_name", "")
    if key not in _COST_MODELS:
        try:
            from . import costmodel
        except ImportError:
            return None
        _COST_MODELS[key] = costmodel.calibrate(group)
    return _COST_MODELS[key]


def write_schedule(path: str, graphs: Sequence[fx.GraphModule], cost: Any) -> bool:
    """Predict ``graphs`` run back to back with ``cost`` and write the Chrome trace to ``path``
    (open it in Perfetto or ``chrome://tracing``). False when ``zerograph.timeline`` is missing."""
    try:
        from . import timeline as timeline_mod
    except ImportError:
        return False
    _write_json(path, timeline_mod.predict(list(graphs), cost).to_chrome_trace())
    return True


# ---------------------------------------------------------------------------------------------
# per-graph files after the last pass (called by the backend)


def finish_graph(directory: str, kind: str, gm: fx.GraphModule, runtime: Any, captured: Any, graph_id: int,
                 carried: Mapping[str, tuple[str, int]] | None = None) -> None:
    """Write the final graph's rendering, memory timeline and predicted schedule into ``directory``;
    at the rank's root, after a backward graph the step's schedule, and after a forward, backward
    or inference graph ``summary.md`` (totals come from ``write_summary`` / ``explain`` after a step;
    a later compile keeps the last ones written).

    ``runtime``: ``zerograph.runtime.Runtime``; ``captured``: ``CapturedGraphs``; ``carried``: roles
    of the placeholders a forward saved (backward graphs). Schedules need the cost model that
    ``calibrate_once`` cached at the backend's entry; without it they are skipped. No collective.
    """
    units = runtime.units
    write_rendering(directory, gm.graph, units)
    param_bytes = {layout.fqn: math.prod(layout.local_shape(runtime.rank)) * layout.dtype.itemsize
                   for layout in runtime.layouts.values()}
    held = held_inputs(gm, captured.graphs[graph_id].get("dynamo"), captured.input_params[graph_id], param_bytes)
    memory = memory_timeline(gm.graph, held, carried)
    _write_json(os.path.join(directory, "memory.json"), memory)
    plot_memory(memory, os.path.join(directory, "memory.png"),
                f"rank {runtime.rank}, graph {graph_id} {kind}: live bytes (stage {runtime.stage})")
    if kind == "joint":
        return  # the joint graph never runs as such: no schedule, no summary yet
    cost = _COST_MODELS.get(runtime.group_name)  # from ``calibrate_once`` at the backend's entry
    if cost is not None:
        write_schedule(os.path.join(directory, "schedule.json"), [gm], cost)
    rank_dir = os.path.dirname(directory)
    if kind == "backward" and cost is not None:  # a training step: forwards in order, then backwards reversed
        step = ([r["forward"] for r in captured.graphs if "forward" in r]
                + [r["backward"] for r in reversed(captured.graphs) if "backward" in r])
        write_schedule(os.path.join(rank_dir, "schedule.json"), step, cost)
    report = build_report(runtime, captured, None)
    if rank_dir in _LAST_TOTALS:  # keep the totals this process's last ``explain`` wrote there
        report["totals"] = _LAST_TOTALS[rank_dir]
    _write_summary_files(rank_dir, report)


# ---------------------------------------------------------------------------------------------
# summary: per unit and totals against the paper


def build_report(runtime: Any, captured: Any, stats: Any | None) -> dict[str, Any]:
    """The summary as plain data (``summary.json``): per unit its size and where each graph
    gathers, waits for, releases and reduces it; with ``stats`` (``zerograph.Stats`` of a finished
    step) the totals beside the ZeRO paper's formulas (sections 5 and 7)."""
    rank = runtime.rank
    rows = []
    for unit in runtime.units:
        layouts = [runtime.layouts[k] for k in unit.keys]
        shard = [math.prod(layout.local_shape(rank)) for layout in layouts]
        rows.append({"index": unit.index, "name": unit.name, "parameters": len(layouts),
                     "elements": sum(layout.numel for layout in layouts), "shard_elements": sum(shard),
                     "shard_bytes": sum(n * layout.dtype.itemsize for n, layout in zip(shard, layouts)),
                     "gathered": [], "released": [], "reduced": []})
    for g, record in enumerate(captured.graphs):
        for kind in ("forward", "backward", "inference"):
            if kind not in record:
                continue
            where = {"graph": g, "kind": kind}
            for c in collectives(record[kind].graph):
                for u in c["units"]:
                    rows[u]["gathered" if c["role"] == "gather" else "reduced"].append(
                        {**where, "collective": c["kind"], "start": c["start"], "wait": c["wait"], "ahead": c["ahead"]})
            for r in releases(record[kind].graph):
                if r["role"] == "gather":
                    for u in r["units"]:
                        rows[u]["released"].append({**where, "node": r["node"], "position": r["position"]})
    report: dict[str, Any] = {"rank": rank, "world_size": runtime.world_size, "stage": runtime.stage,
                              "graphs": len(captured.graphs), "units": rows}
    if stats is not None:
        report["totals"] = _totals(stats)
    return report


def _totals(stats: Any) -> dict[str, Any]:
    psi = stats.num_params
    moved = sum(stats.comm_elements.values())
    # section 7: 2Ψ per step for stages 0-2 (reduce-scatter + all-gather), 3Ψ for stage 3
    paper_psi = 0 if stats.world_size == 1 else (3 if stats.stage == 3 else 2)
    return {"num_params": psi, "comm_elements": dict(stats.comm_elements), "comm_elements_total": moved,
            "comm_psi": moved / psi if psi else 0.0, "paper_comm_psi": paper_psi,
            "paper_comm_elements": paper_psi * psi, "comm_bytes": dict(stats.comm_bytes),
            "resident_bytes": dict(stats.resident_bytes), "formula_bytes": dict(stats.formula_bytes),
            "transient_bytes": dict(stats.transient_bytes)}


def _where(events: Sequence[Mapping[str, Any]], many_graphs: bool, describe: Callable[[Mapping[str, Any]], str]) -> str:
    """``fwd @12, bwd @40`` (``g1 fwd @12`` when the model has several graphs)."""
    parts = [("g%d " % e["graph"] if many_graphs else "") + f"{KIND_ABBREV[e['kind']]} {describe(e)}" for e in events]
    return ", ".join(parts) or "-"


def _gathered_at(e: Mapping[str, Any]) -> str:
    return f"@{e['start']}"


def _wait_after(e: Mapping[str, Any]) -> str:
    return f"+{e['ahead']}"


def _released_at(e: Mapping[str, Any]) -> str:
    return "kept" if e["position"] is None else f"@{e['position']} ({e['node']})"


def _reduced_at(e: Mapping[str, Any]) -> str:
    return f"@{e['start']} ({e['collective']})"


def summary_markdown(report: Mapping[str, Any]) -> str:
    """``summary.md`` from ``build_report``'s data."""
    many = report["graphs"] > 1
    lines = [f"# zerograph summary: rank {report['rank']} of {report['world_size']}, stage {report['stage']}", ""]
    if not report["graphs"]:
        lines += ["No graph has been captured yet: run a step first.", ""]
    lines += [
        "Positions are node indices in each final graph (the last `NN_*.py` of `graph<g>_<kind>/`, "
        "placeholders included, from 0). *Wait after*: nodes between issuing the collective and waiting "
        "for it (how far it is prefetched). *Released*: the last node reading the unit's gathered "
        "parameters (`kept` = saved for backward).",
        "",
        "| unit | name | params | elements | shard elements | shard bytes | gathered at | wait after "
        "| released at | reduced at |",
        "|---:|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for u in report["units"]:
        lines.append(
            f"| {u['index']} | {u['name']} | {u['parameters']} | {u['elements']:,} | {u['shard_elements']:,} "
            f"| {u['shard_bytes']:,} | {_where(u['gathered'], many, _gathered_at)} "
            f"| {_where(u['gathered'], many, _wait_after)} | {_where(u['released'], many, _released_at)} "
            f"| {_where(u['reduced'], many, _reduced_at)} |")
    totals = report.get("totals")
    lines.append("")
    if totals is None:
        lines.append("Totals need a finished step: call `zerograph.explain(model, optimizer)` after one.")
        return "\n".join(lines) + "\n"
    psi = totals["num_params"]
    lines += [f"## Totals of the last finished step (`zerograph.stats`), Ψ = {psi:,} parameters", "",
              "| quantity | measured | paper (arXiv 1910.02054) |", "|---|---:|---:|",
              f"| communication per step (sec. 7) | {totals['comm_elements_total']:,} elements = "
              f"{totals['comm_psi']:.3f}Ψ | {totals['paper_comm_psi']}Ψ = "
              f"{totals['paper_comm_elements']:,} elements |"]
    for kind, elements in totals["comm_elements"].items():
        if elements:
            lines.append(f"| {kind} | {elements:,} elements, {totals['comm_bytes'][kind]:,} bytes sent | |")
    for key, held in totals["resident_bytes"].items():
        formula = totals["formula_bytes"].get(key)
        transient = totals["transient_bytes"].get(key)
        extra = f" (of which transient {transient:,})" if transient else ""
        paper = f"{formula:,.0f} bytes" if formula is not None else "-"
        lines.append(f"| {key} held at most (sec. 5) | {held:,} bytes{extra} | {paper} |")
    return "\n".join(lines) + "\n"


_LAST_TOTALS: dict[str, dict[str, Any]] = {}  # rank directory -> totals last written there


def _write_summary_files(rank_dir: str, report: Mapping[str, Any]) -> str:
    os.makedirs(rank_dir, exist_ok=True)
    if "totals" in report:
        _LAST_TOTALS[rank_dir] = report["totals"]
    _write_json(os.path.join(rank_dir, "summary.json"), report)
    path = os.path.join(rank_dir, "summary.md")
    with open(path, "w") as f:
        f.write(summary_markdown(report))
    return path


def _report_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, dict[str, Any]]:
    from .state import state_of
    from .stats import stats

    state = state_of(model)
    numbers = stats(model, optimizer) if state.captured.graphs else None
    return state, build_report(state.runtime, state.captured, numbers)


def write_summary(model: torch.nn.Module, dump_dir: str, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Write ``<dump_dir>/rank<r>/summary.md`` and ``summary.json`` for ``model`` after a step,
    totals from ``zerograph.stats(model, optimizer)`` (pass the optimizer for its state bytes; call
    it before ``zero_grad`` frees the gradient shards). Returns the path of ``summary.md``.

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``.
    """
    state, report = _report_of(model, optimizer)
    return _write_summary_files(os.path.join(dump_dir, f"rank{state.runtime.rank}"), report)


def explain(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """The dump's ``summary.md`` as a string: per unit its size and where it is gathered, released,
    prefetched and reduced; totals of the last step against the paper's formulas. Writes the file
    too when dumping is on (``Config.dump_dir`` / ``ZEROGRAPH_DUMP``). Call after a step, before
    ``zero_grad``.

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``.
    """
    state, report = _report_of(model, optimizer)
    dump_root = state.config.resolved_dump_dir()
    if dump_root:
        _write_summary_files(os.path.join(dump_root, f"rank{state.runtime.rank}"), report)
    return summary_markdown(report)


def write_measured_schedule(model: torch.nn.Module, schedule: Any) -> str | None:
    """Write a measured step (``zerograph.measure(..., model=model)``) as
    ``<dump_dir>/rank<r>/measured_schedule.json``, a Chrome trace beside the predicted
    ``schedule.json``. Returns the path, or ``None`` when dumping is off (nothing is written).

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``.
    """
    from .state import state_of

    state = state_of(model)
    dump_root = state.config.resolved_dump_dir()
    if not dump_root:
        return None
    path = os.path.join(dump_root, f"rank{state.runtime.rank}", "measured_schedule.json")
    _write_json(path, schedule.to_chrome_trace(pid=state.runtime.rank))
    return path


__all__ = ["GraphDump", "MEMORY_CATEGORIES", "build_report", "describe_changes", "explain", "finish_graph",
           "memory_timeline", "readable_python", "summary_markdown", "write_measured_schedule", "write_summary"]
