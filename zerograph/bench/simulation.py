"""``--simulate``: a zerograph system's profiled step projected onto another cluster.

Each measured node time (``zerograph.report.profile``) is scaled by this machine's calibrated FLOP/s
over the cluster's and replayed by ``zerograph.report.timeline.predict`` with the cluster's alpha-beta
collectives; the cluster named ``local`` is this machine as calibrated, a self-check of the
projection. Clusters are described in ``clusters.json`` (bus bandwidth, latency, rates).

Source: the bus-bandwidth convention of NCCL's nccl-tests (``PERFORMANCE.md``);
``zerograph.graph.costmodel.calibrate``; ``zerograph.plan`` for the model-state bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ..errors import ConfigError
from ..graph.costmodel import (
    CostModel,
    calibrate,
    cluster_bandwidth,
    cluster_cost_model,
    cluster_figure,
    cluster_rank_count,
    load_cluster_table,
    ring_collectives,
)
from ..graph.ops import GATHER_ACTIVATION
from ..graph.vocab import COLLECTIVE_KINDS, REPLICATE_DIM, SECONDARY_DIM, SHARD_DIM, group_name_of
from ..planning.plan import plan as memory_plan
from ..report.profile import ProfiledCost, profile_step
from ..report.timeline import predict
from ..runtime.state import runtime_of_model
from .systems import SystemSpec
from .workloads import Workload, shapes_only

log = logging.getLogger(__name__)

LOCAL_CLUSTER = "local"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster to project onto: one data-parallel rank per device (see ``clusters.json``).

    ``scale``: factor applied to this machine's measured op times (this machine's calibrated
    FLOP/s over the cluster's); ``cost``: the cluster's ``CostModel`` (its collectives are used);
    ``links``: what prices a mesh dim's collectives (``None`` for this machine, where every group
    is priced by ``cost``, as calibrated).
    """

    name: str
    description: str
    world_size: int
    scale: float
    cost: CostModel
    assumptions: tuple[str, ...]
    links: Links | None = None


@dataclasses.dataclass(frozen=True)
class Links:
    """The cluster's links as cost models, one per kind of group a mesh dim maps onto.

    ``world``: a ring over every rank (a 1-D mesh's collectives); ``node``: a ring inside one node
    (``devices_per_node`` ranks: hybrid sharding's shard dim, hpZ's secondary group);
    ``cross_node``: a ring with one rank in each node (``nodes`` ranks: hybrid sharding's
    replicate dim; every device runs its own such ring at once, over its own NIC).
    """

    world: CostModel
    node: CostModel
    cross_node: CostModel
    devices_per_node: int


def cluster_links(entry: Mapping[str, Any]) -> Links:
    """``Links`` of a cluster entry. ``node_bus_bandwidth_bytes_per_s`` / ``node_latency_s`` and
    ``cross_node_bus_bandwidth_bytes_per_s`` / ``cross_node_latency_s`` price the node and
    cross-node rings; an entry without them prices both as the world ring (say so in the
    assumptions). Raises ``ConfigError`` for an incomplete or invalid entry."""
    world = cluster_cost_model(entry)
    nodes, per_node = cluster_rank_count(entry, "nodes"), cluster_rank_count(entry, "devices_per_node")
    busbw, latency = cluster_bandwidth(entry, "bus_bandwidth_bytes_per_s"), cluster_figure(entry, "latency_s")

    def ring(n: int, prefix: str) -> CostModel:
        return dataclasses.replace(world, world_size=n, collectives=ring_collectives(
            n, cluster_bandwidth(entry, f"{prefix}_bus_bandwidth_bytes_per_s", busbw),
            cluster_figure(entry, f"{prefix}_latency_s", latency)))

    return Links(world, ring(per_node, "node"), ring(nodes, "cross_node"), per_node)


def group_cost_models(links: Links, dims: Mapping[str, tuple[str, int]], shard_size: int) -> dict[str, CostModel]:
    """Which link prices each process group of a measured model on the cluster
    (``timeline.predict``'s ``group_costs``).

    ``dims``: process-group name -> ``(mesh dim, group size here)`` (``Topology.comm_dim``);
    ``shard_size``: ranks of the shard dim here. A model with a replicate dim (hybrid sharding)
    maps its shard dim onto one node and its replicate dim onto the cross-node ring; hpZ's
    secondary group maps onto one node; a 1-D model's shard dim is the whole world (``world``, so
    it is left out). The replicate dim all-reduces one shard-dim shard, which on the cluster is
    ``shard_size / devices_per_node`` of the one measured here, so its bytes are scaled by that.
    """
    hybrid = any(dim == REPLICATE_DIM for dim, _ in dims.values())
    costs = {}
    for name, (dim, _) in dims.items():
        if dim == SECONDARY_DIM or (dim == SHARD_DIM and hybrid):
            costs[name] = links.node
        elif dim == REPLICATE_DIM:
            scale = shard_size / links.devices_per_node
            costs[name] = dataclasses.replace(links.cross_node, collectives={
                kind: (alpha, beta * scale) for kind, (alpha, beta) in links.cross_node.collectives.items()})
    return costs


def mesh_dims_of(graphs: Sequence[fx.GraphModule], comm_dim: Callable[[str], tuple[str, int]]
                 ) -> dict[str, tuple[str, int]]:
    """``{process-group name: (mesh dim, group size)}`` of every group the graphs communicate over:
    the functional collectives' groups and ``zerograph::gather_activation``'s (hpZ's node group,
    P_a's group). ``comm_dim``: ``Topology.comm_dim``."""
    groups = {group_name_of(node) if node.target in COLLECTIVE_KINDS else node.args[2]
              for graph in graphs for node in graph.graph.nodes
              if node.target in COLLECTIVE_KINDS or node.target is GATHER_ACTIVATION}
    return {name: comm_dim(name) for name in groups if name is not None}


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
        links = cluster_links(entry)
        cost = links.world
        scale = local.flops_per_s / cost.flops_per_s
        clusters.append(Cluster(name, entry.get("description", name), cost.world_size, scale, cost, links=links,
                                assumptions=(
            f"op times: this machine's measured times x {scale:.3g} (its calibrated matmul rate "
            f"{local.flops_per_s / 1e9:.3g} GFLOP/s over the cluster's {cost.flops_per_s / 1e9:.3g} GFLOP/s), "
            f"floored at the cluster's op overhead {cost.op_overhead_s * 1e6:.3g} us; time outside the graphs "
            "(optimizer step, framework) scaled the same way",
            f"collectives: latency {float(entry['latency_s']) * 1e6:.3g} us + bytes / bus bandwidth "
            f"{float(entry['bus_bandwidth_bytes_per_s']) / 1e9:.3g} GB/s with nccl-tests' factors, at world size "
            f"{cost.world_size}, one at a time on one stream beside compute",
            "per-rank batch and graphs as measured here (weak scaling: the global batch grows with the "
            "world size); collectives move full buffers, so their sizes do not depend on the world size",
            _mesh_assumption(entry, links))))
    return clusters


def _mesh_assumption(entry: Mapping[str, Any], links: Links) -> str:
    node, cross = links.node.collectives["all_gather"], links.cross_node.collectives["all_gather"]
    told = all(f"{p}_bus_bandwidth_bytes_per_s" in entry for p in ("node", "cross_node"))
    return (f"mesh dims (-hsdp<S>, -hpz<M>): a shard group of a 2-D mesh and hpZ's secondary group are one node "
            f"({links.devices_per_node} ranks, latency {node[0] * 1e6:.3g} us, "
            f"{_busbw(links.node) / 1e9:.3g} GB/s busbw), the replicate "
            f"dim a ring with one rank per node ({links.cross_node.world_size} ranks, latency {cross[0] * 1e6:.3g} us, "
            f"{_busbw(links.cross_node) / 1e9:.3g} GB/s busbw, its all-reduced shard scaled to the node's shard dim)"
            + ("" if told else "; this entry gives no node / cross-node figures, so both are priced as the world ring"))


def _busbw(cost: CostModel) -> float:
    n = cost.world_size
    beta = cost.collectives["all_gather"][1]
    return float("inf") if n == 1 or beta == 0 else (n - 1) / n / beta


def simulate_system(spec: SystemSpec, model: nn.Module, events: Sequence[Any], window: Any,
                    clusters: Sequence[Cluster], workload: Workload, world_size: int) -> dict:
    """Project one zerograph system's profiled step onto each cluster with ``timeline.predict``,
    node times from ``zerograph.report.profile.profile_step``.

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
    runtime = runtime_of_model(model)
    dims = mesh_dims_of(measured.graphs, runtime.topology.comm_dim)
    out: dict[str, Any] = {"matched_node_fraction": measured.matched_fraction, "outside_graphs_s": outside_s,
                           "profiled_step_s": measured.step_s}
    for cluster in clusters:
        scaled = {node: max(s * cluster.scale, cluster.cost.op_overhead_s) for node, s in seconds.items()}
        cost = ProfiledCost(**{f.name: getattr(cluster.cost, f.name) for f in dataclasses.fields(CostModel)},
                            node_seconds=scaled)
        group_costs = {} if cluster.links is None else group_cost_models(cluster.links, dims, runtime.topology.world_size)
        schedule = predict(measured.graphs, cost, group_costs)
        out[cluster.name] = {
            "world_size": cluster.world_size,
            "step_s": schedule.step_s + outside_s * cluster.scale,
            "graphs_step_s": schedule.step_s, "compute_s": schedule.compute_s + outside_s * cluster.scale,
            "comm_s": schedule.comm_s, "exposed_comm_s": schedule.exposed_comm_s,
            "model_state_bytes_per_rank": _planned_bytes(spec, workload, cluster),
        }
    return out


def _planned_bytes(spec: SystemSpec, workload: Workload, cluster: Cluster) -> dict[str, int] | None:
    """``zerograph.plan``'s per-rank model-state bytes (formula and with overheads) on ``cluster``,
    with the system's mesh dims mapped as ``group_cost_models`` maps them (a shard group or hpZ's
    secondary group is one node), or ``None`` when the plan fails for this model."""
    world_size, mesh = cluster.world_size, {}
    per_node = cluster.links.devices_per_node if cluster.links is not None else None
    if spec.shard_size is not None:
        shard = per_node or spec.shard_size
        world_size, mesh = shard, {"replicas": cluster.world_size // shard}
    elif spec.config.secondary_partition_size is not None and (per_node or 0) < world_size:
        mesh = {"secondary_partition_size": per_node or spec.config.secondary_partition_size}  # one node: plain stage 3
    try:
        plan = memory_plan(shapes_only(workload), spec.stage, world_size, param_dtype=torch.float32,
                           master_dtype=torch.float32, prefetch_depth=spec.config.schedule.prefetch_depth, **mesh)
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
