"""``--simulate``: a zerograph system's profiled step projected onto another cluster.

Each measured node time (``zerograph.profile``) is scaled by this machine's calibrated FLOP/s
over the cluster's and replayed by ``zerograph.timeline.predict`` with the cluster's alpha-beta
collectives; the cluster named ``local`` is this machine as calibrated, a self-check of the
projection. Clusters are described in ``clusters.json`` (bus bandwidth, latency, rates).

Source: the bus-bandwidth convention of NCCL's nccl-tests (``PERFORMANCE.md``);
``zerograph.costmodel.calibrate``; ``zerograph.plan`` for the model-state bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..costmodel import CostModel, calibrate
from ..errors import ConfigError
from ..plan import plan as memory_plan
from ..profile import ProfiledCost, profile_step
from ..timeline import predict
from .systems import SystemSpec
from .workloads import Workload, shapes_only

log = logging.getLogger(__name__)

CLUSTERS_FILE = Path(__file__).parent.parent / "clusters.json"
LOCAL_CLUSTER = "local"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster to project onto: one data-parallel rank per device (see ``clusters.json``).

    ``scale``: factor applied to this machine's measured op times (this machine's calibrated
    FLOP/s over the cluster's); ``cost``: the cluster's ``CostModel`` (its collectives are used).
    """

    name: str
    description: str
    world_size: int
    scale: float
    cost: CostModel
    assumptions: tuple[str, ...]


def load_cluster_table(path: str | os.PathLike) -> dict[str, dict]:
    """The clusters of a JSON table (keys starting with ``_`` are comments). Raises ``ConfigError``."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the cluster table {path}: {exc}") from exc
    return {name: entry for name, entry in table.items() if not name.startswith("_")}


def cluster_cost_model(entry: Mapping[str, Any]) -> CostModel:
    """``CostModel`` of a cluster entry: alpha = ``latency_s``, beta from the bus bandwidth with
    nccl-tests' factors ((N-1)/N for all-gather and reduce-scatter, 2(N-1)/N for all-reduce)."""
    try:
        n = int(entry["nodes"]) * int(entry["devices_per_node"])
        busbw, latency = float(entry["bus_bandwidth_bytes_per_s"]), float(entry["latency_s"])
        ring = (n - 1) / n
        return CostModel(world_size=n, flops_per_s=float(entry["flops_per_s"]),
                         bytes_per_s=float(entry["memory_bytes_per_s"]), op_overhead_s=float(entry["op_overhead_s"]),
                         collectives={"all_gather": (latency, ring / busbw), "reduce_scatter": (latency, ring / busbw),
                                      "all_reduce": (latency, 2 * ring / busbw)})
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"cluster entry {dict(entry)} is incomplete or invalid: {exc!r}") from exc


def clusters_for(args: argparse.Namespace, device: torch.device) -> list[Cluster]:
    """Calibrate this machine (every rank takes part), then describe each requested cluster.
    The first entry is always this machine (``LOCAL_CLUSTER``); it is reported only when asked."""
    local = calibrate(dist.group.WORLD)
    table = load_cluster_table(args.clusters)
    clusters = [Cluster(LOCAL_CLUSTER, f"this machine, as calibrated by costmodel.calibrate ({device.type})",
                        local.world_size, 1.0, local,
                        ("op times as measured (scale 1)",
                         "collectives: alpha-beta fitted by costmodel.calibrate on this machine's process group"))]
    for name in args.simulate.split(","):
        if name == LOCAL_CLUSTER:
            continue
        entry = table[name]
        cost = cluster_cost_model(entry)
        scale = local.flops_per_s / cost.flops_per_s
        clusters.append(Cluster(name, entry.get("description", name), cost.world_size, scale, cost, (
            f"op times: this machine's measured times x {scale:.3g} (its calibrated matmul rate "
            f"{local.flops_per_s / 1e9:.3g} GFLOP/s over the cluster's {cost.flops_per_s / 1e9:.3g} GFLOP/s), "
            f"floored at the cluster's op overhead {cost.op_overhead_s * 1e6:.3g} us; time outside the graphs "
            "(optimizer step, framework) scaled the same way",
            f"collectives: latency {float(entry['latency_s']) * 1e6:.3g} us + bytes / bus bandwidth "
            f"{float(entry['bus_bandwidth_bytes_per_s']) / 1e9:.3g} GB/s with nccl-tests' factors, at world size "
            f"{cost.world_size}, one at a time on one stream beside compute",
            "per-rank batch and graphs as measured here (weak scaling: the global batch grows with the "
            "world size); collectives move full buffers, so their sizes do not depend on the world size")))
    return clusters


def simulate_system(spec: SystemSpec, model: nn.Module, events: Sequence[Any], window: Any,
                    clusters: Sequence[Cluster], workload: Workload, world_size: int) -> dict:
    """Project one zerograph system's profiled step onto each cluster with ``timeline.predict``,
    node times from ``zerograph.profile.profile_step``.

    Per cluster: predicted ``step_s`` (graphs on two streams plus the time outside them),
    ``compute_s``, ``comm_s``, ``exposed_comm_s`` (seconds) and model-state bytes per rank from
    ``zerograph.plan`` at the cluster's world size (fp32 parameters and gradients, AdamW fp32
    states; activations not included).
    """
    local = next(c for c in clusters if c.name == LOCAL_CLUSTER)
    try:
        measured = profile_step(model, events, window, local.cost)
    except ConfigError as exc:
        return {"error": str(exc)}
    seconds, outside_s = measured.by_node(), measured.outside_s
    out: dict[str, Any] = {"matched_node_fraction": measured.matched_fraction, "outside_graphs_s": outside_s,
                           "profiled_step_s": measured.step_s}
    for cluster in clusters:
        scaled = {node: max(s * cluster.scale, cluster.cost.op_overhead_s) for node, s in seconds.items()}
        cost = ProfiledCost(**{f.name: getattr(cluster.cost, f.name) for f in dataclasses.fields(CostModel)},
                            node_seconds=scaled)
        schedule = predict(measured.graphs, cost)
        out[cluster.name] = {
            "world_size": cluster.world_size,
            "step_s": schedule.step_s + outside_s * cluster.scale,
            "graphs_step_s": schedule.step_s, "compute_s": schedule.compute_s + outside_s * cluster.scale,
            "comm_s": schedule.comm_s, "exposed_comm_s": schedule.exposed_comm_s,
            "model_state_bytes_per_rank": _planned_bytes(spec, workload, cluster.world_size),
        }
    return out


def _planned_bytes(spec: SystemSpec, workload: Workload, world_size: int) -> dict[str, int] | None:
    """``zerograph.plan``'s per-rank model-state bytes (formula and with overheads), or ``None``
    when the plan fails for this model."""
    try:
        plan = memory_plan(shapes_only(workload), spec.stage, world_size, param_dtype=torch.float32,
                              master_dtype=torch.float32, prefetch_depth=spec.prefetch_depth)
    except Exception as exc:  # a user model zerograph.plan cannot read: report without memory
        log.warning("no memory plan for %s: %s", workload.name, exc)
        return None
    return {"formula": int(plan.bytes_per_rank["total"]), "with_overheads": int(plan.total_with_overheads)}


def simulation_summary(systems: Mapping[str, dict], clusters: Sequence[Cluster], args: argparse.Namespace) -> dict | None:
    if not clusters:
        return None
    requested = args.simulate.split(",")
    summary: dict[str, Any] = {"clusters": {c.name: {"description": c.description, "world_size": c.world_size,
                                                     "scale": c.scale, "cost_model": c.cost.to_dict(),
                                                     "assumptions": list(c.assumptions)}
                                            for c in clusters if c.name in requested}}
    if LOCAL_CLUSTER in requested:
        summary["self_check"] = {name: _self_check(s) for name, s in systems.items()
                                 if LOCAL_CLUSTER in s.get("simulate", {})}
    return summary


def _self_check(system: dict) -> dict:
    """Simulated 'local' step against the profiled step it was built from (which differs from it
    only in how communication and waits are modelled) and against the timed median (which adds
    step-to-step variation of the machine)."""
    sim = system["simulate"]
    predicted = sim[LOCAL_CLUSTER]["step_s"]
    return {"predicted_s": predicted, "measured_profiled_step_s": sim["profiled_step_s"],
            "relative_error": predicted / sim["profiled_step_s"] - 1,
            "measured_median_s": system["median_s"], "relative_error_vs_median": predicted / system["median_s"] - 1}
