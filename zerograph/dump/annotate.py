"""Facts about one graph as plain data (collectives, releases, op counts) and the graph as
commented Python: what the dump's files, renderings and summary are built from.

Source: ``torch.fx.GraphModule.print_readable``; ``zerograph.passes._fx.find_collectives`` and
``passes/liveness.py`` (the same aliasing rule for when a buffer dies).
"""
from __future__ import annotations

import collections
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from zerograph.graph.vocab import TAG, full_buffer
from zerograph.passes._fx import find_collectives
from zerograph.passes.activation_partition import ACTIVATION
from zerograph.passes.context import graph_modules
from zerograph.passes.liveness import reads, storage_root

from ..shard.sharding import Unit


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


def pipeline_op_counts(graphs: Any) -> collections.Counter:
    """``op_counts`` of what a pass pipeline works on: one graph module, or the partitioned pair's two."""
    return sum((op_counts(gm.graph) for gm in graph_modules(graphs)), collections.Counter())


def pipeline_node_order(graphs: Any) -> list[str]:
    """The node names of ``graphs`` in order (the pair's: forward's, then backward's, each prefixed)."""
    parts = graph_modules(graphs)
    prefixes = ("forward.", "backward.") if len(parts) == 2 else ("",)
    return [prefix + n.name for prefix, gm in zip(prefixes, parts) for n in gm.graph.nodes]


def node_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def tagged_units(tag: Mapping[str, Any]) -> tuple[int, ...]:
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
        if tag.get("role") == "gather" and storage_root(node) is node and node_bytes(node):
            groups.setdefault(("gather", tagged_units(tag)), []).append(node)
        elif tag.get("role") == "reduce":  # the untagged inputs of a reduction's copy-in are full gradients
            for inp in node.all_input_nodes:
                root = storage_root(inp)
                if TAG not in root.meta and root.op != "placeholder" and root not in seen:
                    seen.add(root)
                    groups.setdefault(("full_grad", tagged_units(tag)), []).append(root)
    last = last_reads(graph)
    found = []
    for (role, units), roots in groups.items():
        final = max(last.get(r, pos[r]) for r in roots)
        kept = final >= len(nodes)
        found.append({"role": role, "units": list(units), "node": "output" if kept else nodes[final].name,
                      "position": None if kept else final, "tensors": len(roots),
                      "freed_bytes": sum(node_bytes(r) for r in roots if last.get(r, pos[r]) == final)})
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


def readable_pipeline_python(graphs: Any, units: Sequence[Unit]) -> str:
    """``readable_python`` of one graph module, or of the partitioned pair (forward, then backward)."""
    parts = graph_modules(graphs)
    if len(parts) == 1:
        return readable_python(parts[0], units)
    return "".join(f"# ---- {label} graph ----\n" + readable_python(gm, units)
                   for label, gm in zip(("forward", "backward"), parts))


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
