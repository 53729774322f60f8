"""The dump's summary: per unit its size and where each graph gathers, waits for, releases and
reduces it, and a finished step's totals beside the ZeRO paper's formulas (``summary.md``,
``summary.json``); ``explain`` and ``write_summary`` for users.

Source: ZeRO (arXiv 1910.02054) sections 5 (memory) and 7 (communication volume).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zerograph.passes.manager import PASS_TIMES

from .annotate import collectives, releases
from .manifest import rank_manifest, write_json

KIND_ABBREV = {"joint": "joint", "partitioned": "pair", "forward": "fwd", "backward": "bwd", "inference": "inf"}


def build_report(runtime: Any, captured: Any, stats: Any | None) -> dict[str, Any]:
    """The summary as plain data (``summary.json``): per unit its size and where each graph
    gathers, waits for, releases and reduces it; with ``stats`` (``zerograph.Stats`` of a finished
    step) the totals beside the ZeRO paper's formulas (sections 5 and 7)."""
    rank = runtime.topology.rank  # the shard group's rank: what the local shapes follow
    rows = []
    for unit in runtime.units:
        layouts = [runtime.layouts[k] for k in unit.keys]
        shard = [math.prod(layout.local_shape(rank)) for layout in layouts]
        rows.append({"index": unit.index, "name": unit.name, "parameters": len(layouts),
                     "elements": sum(layout.numel for layout in layouts), "shard_elements": sum(shard),
                     "shard_bytes": sum(n * layout.dtype.itemsize for n, layout in zip(shard, layouts)),
                     "gathered": [], "released": [], "reduced": []})
    total = sum(row["elements"] for row in rows)
    for row in rows:  # each unit's share of Ψ: stage 3 gathers a unit whole while it is in use
        row["share"] = row["elements"] / total if total else 0.0
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
    report: dict[str, Any] = {"rank": rank, "world_size": runtime.topology.world_size, "stage": runtime.stage,
                              "replicas": runtime.topology.replicate_size,
                              "graphs": len(captured.graphs), "units": rows, "passes": _pass_times(captured),
                              "templates": _templates(captured), "unit_paths": captured.unit_paths()}
    if stats is not None:
        report["totals"] = _totals(stats)
    return report


def _pass_times(captured: Any) -> list[dict[str, Any]]:
    """Per captured graph and kind: nodes before and after its pass pipeline and each pass's
    seconds (``passes.manager.PASS_TIMES``, recorded whether or not a dump was asked for)."""
    rows = []
    for g, record in enumerate(captured.graphs):
        for kind in ("joint", "partitioned", "forward", "backward", "inference"):
            times = record[kind].meta.get(PASS_TIMES) if kind in record else None
            if times is not None:
                rows.append({"graph": g, "kind": kind, **times})
    return rows


def _templates(captured: Any) -> list[dict[str, Any]]:
    """Per unit template (``Config(unit_templates=True)``): the units that call it, its inputs'
    shapes, its graphs' sizes, the seconds its trace took and, for a copy of a template another
    model in the process traced, that template's id (``reused_from``)."""
    return [{"id": t.id, "units": list(t.units), "inputs": [list(shape) for shape, _, _ in t.input_metas],
             "forward_nodes": len(t.forward_graph.graph.nodes), "backward_nodes": len(t.backward_graph.graph.nodes),
             "trace_seconds": t.trace_seconds, "reused_from": t.reused_from} for t in getattr(captured, "templates", [])]


def _totals(stats: Any) -> dict[str, Any]:
    psi = stats.num_params
    moved = sum(stats.comm_elements.values())
    # section 7: 2Ψ per step for stages 0-2 (reduce-scatter + all-gather), 3Ψ for stage 3
    paper_psi = 0 if stats.world_size == 1 else (3 if stats.stage == 3 else 2)
    return {"num_params": psi, "comm_elements": dict(stats.comm_elements), "comm_elements_total": moved,
            "comm_psi": moved / psi if psi else 0.0, "paper_comm_psi": paper_psi,
            "paper_comm_elements": paper_psi * psi, "comm_bytes": dict(stats.comm_bytes),
            "resident_bytes": dict(stats.resident_bytes), "formula_bytes": dict(stats.formula_bytes),
            "transient_bytes": dict(stats.transient_bytes),
            "comm_elements_per_dim": {d: dict(c) for d, c in stats.comm_elements_per_dim.items()},
            "comm_bytes_per_dim": {d: dict(c) for d, c in stats.comm_bytes_per_dim.items()}}


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
    replicas = report.get("replicas", 1)
    of = f"{report['world_size']}" + (f" (shard dim; x {replicas} replicas)" if replicas > 1 else "")
    lines = [f"# zerograph summary: rank {report['rank']} of {of}, stage {report['stage']}", ""]
    if not report["graphs"]:
        lines += ["No graph has been captured yet: run a step first.", ""]
    lines += [
        "Positions are node indices in each final graph (the last `NN_*.py` of `graph<g>_<kind>/`, "
        "placeholders included, from 0). *Wait after*: nodes between issuing the collective and waiting "
        "for it (how far it is prefetched). *Released*: the last node reading the unit's gathered "
        "parameters (`kept` = saved for backward).",
        "",
        "| unit | name | params | elements | share of Ψ | shard elements | shard bytes | gathered at | wait after "
        "| released at | reduced at |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for u in report["units"]:
        lines.append(
            f"| {u['index']} | {u['name']} | {u['parameters']} | {u['elements']:,} | {u.get('share', 0.0):.1%} "
            f"| {u['shard_elements']:,} "
            f"| {u['shard_bytes']:,} | {_where(u['gathered'], many, _gathered_at)} "
            f"| {_where(u['gathered'], many, _wait_after)} | {_where(u['released'], many, _released_at)} "
            f"| {_where(u['reduced'], many, _reduced_at)} |")
    lines += _unit_path_lines(report.get("unit_paths", []))
    lines += _template_lines(report.get("templates", []))
    lines += _pass_time_lines(report.get("passes", []), many)
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
    per_dim = totals.get("comm_bytes_per_dim", {})
    if len(per_dim) > 1:  # hybrid sharding: each collective counted on the mesh dim it ran over
        for dim, sent in per_dim.items():
            elements = totals["comm_elements_per_dim"][dim]
            kinds = ", ".join(f"{k} {elements[k]:,} elements / {sent[k]:,} bytes" for k in sent if sent[k])
            lines.append(f"| over the {dim} dim | {kinds} | |")
    for key, held in totals["resident_bytes"].items():
        formula = totals["formula_bytes"].get(key)
        transient = totals["transient_bytes"].get(key)
        extra = f" (of which transient {transient:,})" if transient else ""
        paper = f"{formula:,.0f} bytes" if formula is not None else "-"
        lines.append(f"| {key} held at most (sec. 5) | {held:,} bytes{extra} | {paper} |")
    return "\n".join(lines) + "\n"


def _unit_path_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The "Unit paths" table: per kind of templated unit, the path its units took and every exit
    from the fast path (``Config(strict_templates=True)`` turns an exit into an error)."""
    if not rows:
        return []
    lines = ["", "## Unit paths", "",
             "Per kind of unit: `template` (one traced call per unit), `inline` (its body traced into the model's "
             "graph) or `island` (eager, gathered once on entry); the exits from the template path, each with the "
             "number of traces (or eager calls) that took it.", "",
             "| kind | units | path | templates | flat shards | exits |", "|---|---:|---|---:|---|---|"]
    for row in rows:
        exits = "; ".join(f"{reason} (x{count})" for reason, count in row["exits"].items()) or "-"
        lines.append(f"| {row['kind']} | {row['units']} | {row['path']} | {row['templates']} "
                     f"| {'yes' if row['flat_shards'] else 'no'} | {exits.replace('|', '/')} |")
    return lines


def _template_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The "Unit templates" table: which units share one traced forward and backward."""
    if not rows:
        return []
    lines = ["", "## Unit templates (`Config(unit_templates=True)`)", "",
             "Each kind of unit was traced, partitioned and lowered once; the units listed call that template "
             "(one `zerograph::unit_forward` / `unit_backward` node each in the forward and backward graphs above; "
             "`unit_call` / `unit_call_backward`, with the unit's output and a token, in the joint). Its graphs are "
             "`template<id>_{forward,backward}.py` in this folder. A template another model in this process "
             "traced is reused, not traced again (\"copy of\" names it).", "",
             "| template | units | first input | forward / backward nodes | trace s |", "|---:|---|---|---:|---:|"]
    for row in rows:
        units = ", ".join(row["units"])
        traced = f"{row['trace_seconds']:.2f}" if row.get("reused_from") is None else f"copy of {row['reused_from']}"
        lines.append(f"| {row['id']} | {units} ({len(row['units'])}) | {tuple(row['inputs'][0])} | "
                     f"{row['forward_nodes']} / {row['backward_nodes']} | {traced} |")
    return lines


def _pass_time_lines(rows: Sequence[Mapping[str, Any]], many_graphs: bool) -> list[str]:
    """The "Compile time" table: one row per graph, each pass's milliseconds in pipeline order."""
    if not rows:
        return []
    lines = ["", "## Compile time of the passes", "",
             "Wall-clock milliseconds of each pass on each graph (the pipeline's order), and the graph's nodes "
             "before and after it.", "", "| graph | nodes in -> out | total ms | passes (ms) |", "|---|---:|---:|---|"]
    for row in rows:
        name = ("g%d " % row["graph"] if many_graphs else "") + row["kind"]
        passes = ", ".join(f"{p} {1e3 * s:.1f}" for p, s in row["seconds"].items())
        lines.append(f"| {name} | {row['nodes_in']:,} -> {row['nodes_out']:,} | "
                     f"{1e3 * sum(row['seconds'].values()):.1f} | {passes} |")
    return lines


_LAST_TOTALS: dict[str, dict[str, Any]] = {}  # rank directory -> totals last written there


def write_summary_files(rank_dir: str, report: Mapping[str, Any]) -> str:
    """Write ``summary.json`` and ``summary.md`` of ``report`` into ``rank_dir`` and record them in
    its manifest; returns the path of ``summary.md``. Raises ``DumpError`` when ``rank_dir`` holds
    files of something other than a zerograph dump."""
    manifest = rank_manifest(rank_dir, report["rank"], report["world_size"])
    if "totals" in report:
        _LAST_TOTALS[rank_dir] = report["totals"]
    write_json(os.path.join(rank_dir, "summary.json"), report)
    path = os.path.join(rank_dir, "summary.md")
    with open(path, "w") as f:
        f.write(summary_markdown(report))
    manifest.record(os.path.join(rank_dir, "summary.json"), path)
    return path


def _report_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, dict[str, Any]]:
    from ..report.stats import stats
    from ..runtime.state import state_of

    state = state_of(model)
    numbers = stats(model, optimizer) if state.captured.graphs else None
    return state, build_report(state.runtime, state.captured, numbers)


def write_summary(model: torch.nn.Module, dump_dir: str, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Write ``<dump_dir>/rank<r>/summary.md`` and ``summary.json`` for ``model`` after a step,
    totals from ``zerograph.stats(model, optimizer)`` (pass the optimizer for its state bytes; call
    it before ``zero_grad`` frees the gradient shards). Returns the path of ``summary.md``.

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``; ``DumpError``
    when ``<dump_dir>/rank<r>/`` holds files but is not a zerograph dump (``dump.manifest``).
    """
    state, report = _report_of(model, optimizer)
    return write_summary_files(os.path.join(dump_dir, f"rank{state.runtime.topology.mesh_rank}"), report)


def explain(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """The dump's ``summary.md`` as a string: per unit its size and where it is gathered, released,
    prefetched and reduced; totals of the last step against the paper's formulas. Writes the file
    too when dumping is on (``Config.dump_dir`` / ``ZEROGRAPH_DUMP``). Call after a step, before
    ``zero_grad``.

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``; ``DumpError``
    as ``write_summary``.
    """
    state, report = _report_of(model, optimizer)
    dump_root = state.config.resolved_dump_dir()
    if dump_root:
        write_summary_files(os.path.join(dump_root, f"rank{state.runtime.topology.mesh_rank}"), report)
    return summary_markdown(report)


