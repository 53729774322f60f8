"""Schedules in the dump: the cost model calibrated once per process (``calibrate_once``), the
predicted schedule of graphs run back to back (``schedule.json``) and a measured step
(``measured_schedule.json``), both as Chrome traces.

Source: the Chrome Trace Event Format (``zerograph.report.timeline``); ``zerograph.graph.costmodel``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .manifest import rank_manifest, write_json

_COST_MODELS: dict[str, Any] = {}


def calibrate_once(group: Any) -> Any:
    """Calibrate ``zerograph.graph.costmodel`` on ``group`` once per process (later calls return the
    cached model); ``None`` when the module is missing.

    Collective: every rank of ``group`` must call it at the same point the first time. The
    backend does so at its entry, on every rank alike, and not inside AOTAutograd's compilers,
    where collectives on real tensors hang.
    """
    key = getattr(group, "group_name", "")
    if key not in _COST_MODELS:
        try:
            from ..graph import costmodel
        except ImportError:
            return None
        _COST_MODELS[key] = costmodel.calibrate(group)
    return _COST_MODELS[key]


def write_schedule(path: str, graphs: Sequence[fx.GraphModule], cost: Any) -> bool:
    """Predict ``graphs`` run back to back with ``cost`` and write the Chrome trace to ``path``
    (open it in Perfetto or ``chrome://tracing``). False when ``zerograph.report.timeline`` is missing."""
    try:
        from ..report import timeline as timeline_mod
    except ImportError:
        return False
    write_json(path, timeline_mod.predict(list(graphs), cost).to_chrome_trace())
    return True


def write_measured_schedule(model: torch.nn.Module, schedule: Any) -> str | None:
    """Write a measured step (``zerograph.measure(..., model=model)``) as
    ``<dump_dir>/rank<r>/measured_schedule.json``, a Chrome trace beside the predicted
    ``schedule.json``. Returns the path, or ``None`` when dumping is off (nothing is written).

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``.
    """
    from ..runtime.state import state_of

    state = state_of(model)
    dump_root = state.config.resolved_dump_dir()
    if not dump_root:
        return None
    rank_dir = os.path.join(dump_root, f"rank{state.runtime.topology.mesh_rank}")
    manifest = rank_manifest(rank_dir, state.runtime.topology.mesh_rank, state.runtime.topology.dp_size)
    path = os.path.join(rank_dir, "measured_schedule.json")
    write_json(path, schedule.to_chrome_trace(pid=state.runtime.topology.mesh_rank))
    manifest.record(path)
    return path
