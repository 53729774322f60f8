"""The per-pass log of one graph (``GraphDump``, driven by ``passes.manager.run_pipeline``): the
graph as commented Python before the first pass and after each that changed it, a unified diff per
pass, and ``passes.json`` with each pass's node counts, change per op kind and one-line summary.

Source: torchtitan's graph-pass debug dumps (each graph before/after a pass, op-count diffs);
``torch.fx.passes.infra.pass_manager`` (``PassResult.modified``); ``difflib.unified_diff``.
"""
from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

from .annotate import pipeline_node_order, pipeline_op_counts, readable_pipeline_python, unit_label
from .manifest import rank_manifest, write_json

ZEROGRAPH_OPS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor", "all_reduce",
                 "all_to_all_single", "wait_tensor", "unshard", "reduce_grad", "pool_buffer", "pack_shards_out")
SUMMARY_KINDS = 8          # op kinds named in a one-line change summary (passes.json has them all)


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


def pass_entry(number: int, name: str, gm: fx.GraphModule, modified: bool, seconds: float,
               counts_before: Mapping[str, int], order_before: Sequence[str]) -> tuple[dict[str, Any], Any, list[str]]:
    """The ``passes.json`` entry of pass ``number`` (``name``, ``seconds`` long) that left ``gm``,
    given the op counts and node order before it; returns ``(entry, op counts, node order)`` after."""
    counts = pipeline_op_counts(gm)
    order = pipeline_node_order(gm)
    moved = nodes_moved(order_before, order) if modified and counts == counts_before else 0
    changes, summary = describe_changes(counts_before, counts, moved)
    entry: dict[str, Any] = {"number": number, "pass": name, "modified": modified, "seconds": seconds,
                             "nodes_before": sum(counts_before.values()), "nodes_after": sum(counts.values()),
                             "changes": changes, "summary": summary if modified else "unchanged"}
    return entry, counts, order


class GraphDump:
    """Writes one graph's pass-by-pass dump into ``directory``; ``run_pipeline`` drives it.

    ``passes.json`` is rewritten after every pass, so a pipeline that fails part-way leaves a
    consistent dump of the passes that ran (the one to read when a ``PassError`` names a pass).
    """

    def __init__(self, directory: str, ctx: Any, gm: fx.GraphModule) -> None:
        self.manifest = rank_manifest(os.path.dirname(os.path.abspath(directory)))  # may clear a previous dump
        self.graph = os.path.basename(os.path.abspath(directory))
        self.manifest.start_graph(self.graph)
        os.makedirs(directory, exist_ok=True)
        self.directory, self.ctx = directory, ctx
        self._written: list[str] = []
        self._counts = pipeline_op_counts(gm)
        self._order = pipeline_node_order(gm)
        self._file = "00_input.py"
        self._body = self._write_python(self._file, gm, "input, before the first pass")
        nodes = sum(self._counts.values())
        self.entries: list[dict[str, Any]] = [
            {"number": 0, "pass": "input", "file": self._file, "nodes": nodes, "summary": f"nodes {nodes}"}]
        self._save_log()

    def after_pass(self, number: int, name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
        """Record pass ``number`` (``name``), which ran in ``seconds``; write its graph and diff when
        it ``modified`` the graph."""
        entry, counts, order = pass_entry(number, name, gm, modified, seconds, self._counts, self._order)
        if modified:
            file = f"{number:02d}_{name}.py"
            body = self._write_python(file, gm, f"after pass {number} {name}")
            entry["file"], entry["diff"] = file, f"{number:02d}_{name}.diff"
            self._written.append(os.path.join(self.directory, entry["diff"]))
            with open(self._written[-1], "w") as f:  # bodies only: headers always differ
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
        body = readable_pipeline_python(gm, ctx.units)
        self._written.append(os.path.join(self.directory, file))
        with open(self._written[-1], "w") as f:
            f.write(header + body)
        return body

    def _save_log(self) -> None:
        """Rewrite ``passes.json`` and record it, with the files written since, in the manifest."""
        path = os.path.join(self.directory, "passes.json")
        write_json(path, self.entries)
        self.manifest.record(*self._written, path)
        self._written.clear()
