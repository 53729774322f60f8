"""zerograph's passes in PyTorch's structured trace (``TORCH_TRACE=dir``), so that ``tlparse``
shows them beside Dynamo's and AOTAutograd's artifacts, per rank and per compile.

Artifacts (``trace_structured("artifact", ...)``; ``<kind>``: joint | forward | backward | inference):

    zerograph_<kind>_00_input          the graph before the first pass, zerograph's nodes commented
    zerograph_<kind>_<NN>_<pass>       per pass: its one-line summary and time, then the graph after
                                       it (when it changed the graph)
    zerograph_<kind>_collectives       the collective schedule: each collective's kind, units, start
                                       and wait positions, bytes (JSON)
    zerograph_<kind>_memory            the memory timeline's numbers (``memory.json``)
    zerograph_<kind>_schedule          the predicted schedule (Chrome trace), when dumping is also on
                                       (its cost model is calibrated only then)

Emitted whether or not a dump directory is set; nothing runs when the trace is off.

Source: ``torch._logging.trace_structured`` (the API Dynamo, AOTAutograd and Inductor log through);
``tlparse`` (github.com/pytorch/tlparse) renders each artifact as a file of its compile.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch.fx as fx
from torch._logging import trace_structured

from .annotate import collectives, pipeline_node_order, pipeline_op_counts, readable_pipeline_python
from .passlog import pass_entry


def emit(name: str, payload: str | Any, encoding: str = "string") -> None:
    """One artifact ``name`` of the structured trace; ``encoding="json"`` for JSON-able data."""
    text = payload if encoding == "string" else json.dumps(payload)
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=lambda: text)


class PassTrace:
    """The per-pass log of one graph in the structured trace: the methods of ``GraphDump``."""

    def __init__(self, ctx: Any, gm: fx.GraphModule) -> None:
        self.ctx, self.kind = ctx, ctx.graph_kind
        self._counts = pipeline_op_counts(gm)
        self._order = pipeline_node_order(gm)
        nodes = sum(self._counts.values())
        self.entries: list[dict[str, Any]] = [{"number": 0, "pass": "input", "nodes": nodes, "summary": f"nodes {nodes}"}]
        emit(f"zerograph_{self.kind}_00_input",
             self._header("input, before the first pass") + readable_pipeline_python(gm, ctx.units))

    def after_pass(self, number: int, name: str, gm: fx.GraphModule, modified: bool, seconds: float) -> None:
        entry, self._counts, self._order = pass_entry(number, name, gm, modified, seconds, self._counts, self._order)
        self.entries.append(entry)
        line = f"# pass {number:02d} {name}: {entry['summary']} ({1e3 * seconds:.1f} ms)\n"
        body = readable_pipeline_python(gm, self.ctx.units) if modified else "# the graph is unchanged\n"
        emit(f"zerograph_{self.kind}_{number:02d}_{name}", line + self._header(f"after pass {number} {name}") + body)

    def disabled(self, number: int, name: str) -> None:
        self.entries.append({"number": number, "pass": name, "disabled": True, "summary": "disabled"})
        emit(f"zerograph_{self.kind}_{number:02d}_{name}", f"# pass {number:02d} {name}: disabled\n")

    def _header(self, when: str) -> str:
        ctx = self.ctx
        return f"# zerograph: {ctx.graph_kind} graph, {when}; stage {ctx.stage}, world size {ctx.world_size}\n"


class PassLogs:
    """Several per-pass logs driven as one (the dump's files and the structured trace)."""

    def __init__(self, *logs: Any) -> None:
        self.logs = logs

    def after_pass(self, *args: Any, **kwargs: Any) -> None:
        for log in self.logs:
            log.after_pass(*args, **kwargs)

    def disabled(self, number: int, name: str) -> None:
        for log in self.logs:
            log.disabled(number, name)


def open_pass_log(dump_dir: str | None, ctx: Any, gm: fx.GraphModule, traced: bool) -> Any:
    """The per-pass log ``passes.manager.run_pipeline`` drives: a ``GraphDump`` writing into
    ``dump_dir`` (when set), a ``PassTrace`` (when ``traced``), both, or ``None``."""
    from . import GraphDump  # through the package: what a test may have replaced

    logs = ([GraphDump(dump_dir, ctx, gm)] if dump_dir else []) + ([PassTrace(ctx, gm)] if traced else [])
    return logs[0] if len(logs) == 1 else (PassLogs(*logs) if logs else None)


def emit_graph_results(kind: str, graph: fx.Graph, memory: Mapping[str, Any], schedule: Any | None) -> None:
    """The final graph's collective schedule, memory timeline and (when given) predicted schedule."""
    emit(f"zerograph_{kind}_collectives", collectives(graph), "json")
    emit(f"zerograph_{kind}_memory", memory, "json")
    if schedule is not None:
        emit(f"zerograph_{kind}_schedule", schedule.to_chrome_trace(), "json")
