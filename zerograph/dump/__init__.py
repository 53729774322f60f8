"""The dump behind ``ZEROGRAPH_DUMP`` / ``Config(dump_dir=)``: what the passes did, readable by a person.

``<root>/manifest.json`` (the run) and, per rank, ``<root>/rank<r>/``: ``manifest.json`` (every
file written, each graph folder ``writing`` until its last file, then ``complete``),
``summary.md`` / ``summary.json``, ``schedule.json``, and a ``graph<g>_<kind>/`` folder per graph
(the graph before the first pass and after each pass that changed it, a diff per pass,
``passes.json``, ``graph.dot`` / ``graph.svg``, ``memory.json`` / ``memory.png``,
``schedule.json``). The full layout: docs/inspection.md, section "The dump".

Dumping into a folder that already holds a dump starts fresh: each rank deletes the files its
previous manifest lists, and only those, before writing its first file; a ``rank<r>/`` folder that
is not empty and is not a zerograph dump is refused with ``DumpError`` (``manifest``).

Modules, one concern each: ``annotate`` (facts about a graph, the graph as commented Python),
``passlog`` (``GraphDump``: the per-pass log), ``memory`` (memory timeline), ``render`` (DOT / SVG),
``schedule`` (cost model, predicted and measured schedules), ``report`` (summary, ``explain``,
``write_summary``), ``finish`` (a graph's files after its last pass), ``manifest`` (what a run
wrote), ``reader`` (reading and checking a dump, for ``zerograph inspect``), ``trace`` (the passes
in PyTorch's structured trace, ``TORCH_TRACE``, for ``tlparse``).

Dumping off costs nothing: ``import zerograph`` imports none of this package, and the pass manager
and ``capture.py`` import it only when a dump directory is set. This file imports no submodule:
each name below is loaded on first use (PEP 562 ``__getattr__``).

Source: torchtitan's graph-pass debug dumps (each graph before/after a pass, op-count diffs);
``torch.fx.GraphModule.print_readable``; the Chrome Trace Event Format (``zerograph.report.timeline``).
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY = {
    "op_name": "annotate", "op_counts": "annotate", "collectives": "annotate", "releases": "annotate",
    "last_reads": "annotate", "unit_label": "annotate", "node_comments": "annotate", "readable_python": "annotate",
    "GraphDump": "passlog", "describe_changes": "passlog", "nodes_moved": "passlog",
    "MEMORY_CATEGORIES": "memory", "held_inputs": "memory", "memory_timeline": "memory", "plot_memory": "memory",
    "dot_graph": "render", "module_unit": "render", "write_rendering": "render",
    "calibrate_once": "schedule", "write_schedule": "schedule", "write_measured_schedule": "schedule",
    "build_report": "report", "summary_markdown": "report", "explain": "report", "write_summary": "report",
    "finish_graph": "finish",
    "begin_dump": "manifest", "rank_manifest": "manifest",
    "read_dump": "reader",
    "PassTrace": "trace", "open_pass_log": "trace",
}

# the names of _LAZY (a test checks they agree)
__all__ = ["GraphDump", "MEMORY_CATEGORIES", "PassTrace", "open_pass_log", "begin_dump", "build_report",
           "calibrate_once", "collectives",
           "describe_changes", "dot_graph", "explain", "finish_graph", "held_inputs", "last_reads",
           "memory_timeline", "module_unit", "node_comments", "nodes_moved", "op_counts", "op_name",
           "plot_memory", "rank_manifest", "read_dump", "readable_python", "releases", "summary_markdown",
           "unit_label", "write_measured_schedule", "write_rendering", "write_schedule", "write_summary"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function (and a test may still patch the name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
