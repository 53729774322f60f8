"""Fit the activations saved for backward into ``activation_budget_bytes`` by recomputing units.

Pre: a joint graph (before the min-cut partitioner) whose forward nodes carry Dynamo's
``nn_module_stack``; the gather chains of ``insert_allgather`` and the kept gathers of
``selective_unshard`` already carry their own ``recompute`` tags (left as they are).
Post: with ``ctx.activation_budget_bytes`` None, nothing changes. Otherwise every non-root unit is
planned ``keep`` or ``recompute`` (``plan_activations``); the forward nodes of a recomputed unit
are tagged ``meta["recompute"] = MUST_RECOMPUTE`` and ``meta["ac_graph_id"]`` = the unit's rank in
forward order, which is what ``torch.utils.checkpoint`` puts on the nodes of a checkpointed region
when Dynamo traces it. The partitioner then saves what the unit reads from outside (its input;
the output of the unit before it when both are recomputed, since ``cleanup_recompute_tags``
saves values at the boundary of two regions) and runs the unit's forward again in backward: per
unit activation checkpointing, decided ahead of time. The first forward node of every planned
unit carries ``meta[ACTIVATION]["note"]`` (the decision and its numbers), which the dump prints.

What is never tagged, and why:
- the root unit (embedding, final norm, LM head and loss sit at both ends of the graph);
- ops tagged ``torch.Tag.nondeterministic_seeded`` and their ``getitem``s (dropout, and every
  fused attention kernel, even at ``dropout_p=0``): their outputs stay saved. Recomputing one
  makes the partitioner functionalize the RNG (``functionalize_rng_ops``), which in torch 2.13
  appends the saved RNG states after the saved opaque objects: the ``DeviceMesh`` every DTensor
  parameter's gradient carries is always saved, so it lands among the saved tensors and
  AOTAutograd's ``save_from_forward`` asserts. Plain ``torch.utils.checkpoint`` around a block
  fails the same way under zerograph. Saving the seeded outputs is also exact without RNG replay.
- nodes that already carry ``recompute`` (zerograph's gathers, a user's own checkpointing).

The choice. Estimates come from the graph's fake values (bytes of each storage, views counted
once; graph inputs and gathered parameters are not activations). Per unit: ``saved_bytes``, the
unit's activations backward reads when kept; ``input_bytes``, what recomputing saves instead
(values it reads from outside, plus its seeded outputs); ``recompute_flops`` / ``recompute_bytes``
(``zerograph.costmodel.node_flops`` / ``node_bytes``) and, given a ``CostModel``, ``recompute_s``
(its roofline). Units are recomputed in decreasing order of bytes freed per second of recompute
(per byte recompute moves, without a cost model: the pass runs without one, so every rank decides
alike from shapes alone), until the estimate of everything saved fits the budget; a unit that
frees nothing is never recomputed. If it cannot fit, every useful unit is recomputed and a
warning says by how much the estimate exceeds the budget.

Not done: offload to host memory (an async device-to-host copy after the last forward use,
fetched back before the backward use: meaningless on a CPU-only run) and ZeRO-R's P_a
(partitioning saved activations across a tensor-parallel group and all-gathering them in backward:
zerograph has no tensor-parallel group). Both would be further decisions of this plan.

Units: bytes (per rank); seconds.
Source: ZeRO (arXiv 1910.02054) section 6.1 (activation checkpointing, P_a, CPU offload); Chen et
al., "Training Deep Nets with Sublinear Memory Cost" (arXiv 1604.06174); PyTorch's selective
activation checkpointing (``torch.utils.checkpoint.CheckpointPolicy``).
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import re
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.costmodel import CostModel, is_view, node_bytes, node_flops, tensor_bytes
from zerograph.sharding import Unit

from ._fx import TAG
from .context import PassContext, PassResult
from .liveness import storage_root

log = logging.getLogger(__name__)

ACTIVATION = "zerograph_activation"  # node.meta key of the decision (not TAG: these are the model's nodes)
KEEP, RECOMPUTE = "keep", "recompute"


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """One unit's activations: estimates (bytes, FLOPs, seconds) and the decision."""

    unit: int
    name: str
    saved_bytes: int         # activations backward reads if the unit is kept
    input_bytes: int         # what recomputing saves instead (its inputs, its seeded outputs)
    recompute_flops: int     # FLOPs of the forward ops backward would run again
    recompute_bytes: int     # bytes those ops read and write
    recompute_s: float | None  # their roofline time under the given cost model
    decision: str            # KEEP or RECOMPUTE

    @property
    def freed_bytes(self) -> int:
        return self.saved_bytes - self.input_bytes


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """The plan for one joint graph: per-unit decisions and the whole graph's estimates (bytes)."""

    budget_bytes: int
    root_bytes: int          # activations of the root unit and of nodes outside every unit (kept)
    unconstrained_bytes: int  # estimate with every unit kept
    planned_bytes: int       # estimate with the decisions below
    units: tuple[UnitPlan, ...]  # non-root units, in unit order

    @property
    def recomputed(self) -> list[int]:
        return [u.unit for u in self.units if u.decision == RECOMPUTE]


@dataclasses.dataclass
class _Region:
    """A unit's forward nodes (internal: holds graph nodes, never leaves this module)."""

    unit: int
    nodes: list[fx.Node]        # its forward nodes, graph order
    tagged: list[fx.Node]       # those recompute would tag
    saved: set[fx.Node]         # storage roots backward reads when kept
    instead: set[fx.Node]       # storage roots saved when recomputed


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of the joint graph's backward half: AOTAutograd's ``partitioner_tag`` says
    ``is_backward``, or the node depends on a tangent."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.meta.get("partitioner_tag") == "is_backward"
                or (node.op == "placeholder" and node.name.startswith("tangents"))
                or any(i in found for i in node.all_input_nodes)):
            found.add(node)
    return found


def module_path(node: fx.Node) -> str | None:
    """The innermost module a forward node was traced in, as ``named_modules`` spells it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).lstrip(".")  # h[0] -> h.0


def unit_of(path: str, units: Sequence[Unit]) -> int | None:
    """The innermost non-root unit whose module contains ``path``, or ``None``."""
    owners = [u for u in units[1:] if u.name and (path == u.name or path.startswith(u.name + "."))]
    return max(owners, key=lambda u: len(u.name)).index if owners else None


def is_seeded(node: fx.Node) -> bool:
    """An RNG op (``nondeterministic_seeded``) or a ``getitem`` of one."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _nbytes(node: fx.Node) -> int:
    """Bytes of a node's tensor value (a symbolic size counts at its size hint, adding no guard)."""
    val = node.meta.get("val")
    return tensor_bytes(val) if isinstance(val, torch.Tensor) else 0


def _activation_root(node: fx.Node) -> fx.Node | None:
    """The storage an activation lives in, or ``None`` for a graph input (parameters, batch) or a
    gathered parameter (model state, not an activation)."""
    root = storage_root(node)
    if root.op == "placeholder" or root.meta.get(TAG, {}).get("role") == "gather" or not _nbytes(root):
        return None
    return root


def regions(graph: fx.Graph, units: Sequence[Unit]) -> tuple[dict[int, _Region], set[fx.Node]]:
    """Each non-root unit's forward nodes, and the roots of the activations outside every unit."""
    backward = backward_nodes(graph)
    owner: dict[fx.Node, int | None] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node in backward or TAG in node.meta:
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            owner[node] = owner.get(node.args[0])
        else:
            path = module_path(node)
            owner[node] = unit_of(path, units) if path is not None else None
    found: dict[int, _Region] = {}
    for node, unit in owner.items():
        if unit is not None:
            region = found.setdefault(unit, _Region(unit, [], [], set(), set()))
            region.nodes.append(node)
            if "recompute" not in node.meta and not is_seeded(node):
                region.tagged.append(node)
    root_saved: set[fx.Node] = set()
    for node, unit in owner.items():
        if any(u in backward for u in node.users):
            root = _activation_root(node)
            if root is not None:
                (root_saved if owner.get(root) is None else found[owner[root]].saved).add(root)
    for region in found.values():
        tagged = set(region.tagged)
        for node in region.tagged:
            for inp in node.all_input_nodes:
                if inp not in tagged and inp not in backward and "recompute" not in inp.meta:
                    root = _activation_root(inp)
                    if root is not None:
                        region.instead.add(root)
        for node in region.nodes:  # what stays saved inside the unit: seeded outputs, pre-tagged nodes
            if node not in tagged and any(u in backward for u in node.users):
                root = _activation_root(node)
                if root is not None:
                    region.instead.add(root)
    return dict(sorted(found.items())), root_saved


def _bytes(roots: set[fx.Node]) -> int:
    return sum(_nbytes(r) for r in roots)


def plan_activations(graph: fx.Graph, units: Sequence[Unit], budget_bytes: int,
                     cost: CostModel | None = None) -> ActivationPlan:
    """Decide keep / recompute per non-root unit (see the module doc); plain data, no rewrite."""
    found, root_saved = regions(graph, units)
    return _choose(found, root_saved, units, budget_bytes, cost)


def _choose(found: dict[int, _Region], root_saved: set[fx.Node], units: Sequence[Unit], budget: int,
            cost: CostModel | None) -> ActivationPlan:
    def estimate(recomputed: set[int]) -> int:
        roots = set(root_saved)
        for unit, region in found.items():
            roots |= region.instead if unit in recomputed else region.saved
        return _bytes(roots)

    stats = {}
    for unit, region in found.items():
        work = [n for n in region.tagged if isinstance(n.target, torch._ops.OpOverload) and not is_view(n)]
        stats[unit] = (_bytes(region.saved), _bytes(region.instead), sum(node_flops(n) for n in work),
                       sum(node_bytes(n) for n in work),
                       sum(cost.node_time(n) for n in region.tagged) if cost is not None else None)

    def freed_per_cost(unit: int) -> float:
        saved, instead, _, moved, seconds = stats[unit]
        return (saved - instead) / max(seconds if seconds is not None else moved, 1e-12)

    chosen: set[int] = set()
    for unit in sorted(found, key=lambda u: (-freed_per_cost(u), u)):
        if estimate(chosen) <= budget:
            break
        if stats[unit][0] > stats[unit][1]:
            chosen.add(unit)
    plans = tuple(UnitPlan(unit, units[unit].name, *stats[unit], RECOMPUTE if unit in chosen else KEEP)
                  for unit in found)
    return ActivationPlan(budget, _bytes(root_saved), estimate(set()), estimate(chosen), plans)


def activation_partition(gm: fx.GraphModule, ctx: PassContext, *, cost: CostModel | None = None) -> PassResult:
    """Plan (``plan_activations``), then tag the recomputed units' nodes (see the module doc).
    ``cost``: rank by seconds of recompute under this model; the pipeline passes none (bytes moved)."""
    if ctx.graph_kind != "joint" or ctx.activation_budget_bytes is None:
        return PassResult(gm, False)
    found, root_saved = regions(gm.graph, ctx.units)
    plan = _choose(found, root_saved, ctx.units, ctx.activation_budget_bytes, cost)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    order = sorted(plan.recomputed, key=lambda u: pos[found[u].nodes[0]])
    region_id = {unit: i + 1 for i, unit in enumerate(order)}  # increasing along forward, as checkpoint's ids
    for p in plan.units:
        region = found[p.unit]
        if p.decision == RECOMPUTE:
            for node in region.tagged:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = region_id[p.unit]
                node.meta[ACTIVATION] = {"unit": p.unit, "decision": RECOMPUTE}
        first = region.nodes[0]
        first.meta[ACTIVATION] = {"unit": p.unit, "decision": p.decision, "note": _note(p)}
        log.debug("unit %d %r: %s", p.unit, p.name, _note(p))
    if plan.planned_bytes > plan.budget_bytes:
        log.warning("activation budget %d bytes cannot be met: the estimate is %d bytes with every useful unit "
                    "recomputed (%d of it the root unit's)", plan.budget_bytes, plan.planned_bytes, plan.root_bytes)
    log.info("activations: %d of %d units recomputed; estimate %d -> %d bytes (budget %d)", len(plan.recomputed),
             len(plan.units), plan.unconstrained_bytes, plan.planned_bytes, plan.budget_bytes)
    if plan.recomputed:
        gm.recompile()
    return PassResult(gm, bool(plan.recomputed), {"recomputed_units": len(plan.recomputed), "units": len(plan.units),
                                                  "estimated_saved_bytes": plan.planned_bytes})


def _note(p: UnitPlan) -> str:
    seconds = f", ~{p.recompute_s * 1e6:.0f} us" if p.recompute_s is not None else ""
    what = (f"recompute in backward: saves ~{p.input_bytes:,} instead of ~{p.saved_bytes:,} bytes"
            if p.decision == RECOMPUTE else f"keep: ~{p.saved_bytes:,} bytes saved for backward "
            f"(recompute would save ~{p.input_bytes:,})")
    return (f"activations of unit {p.unit} '{p.name}': {what}; recompute costs {p.recompute_flops:,} FLOPs, "
            f"{p.recompute_bytes:,} bytes moved{seconds}")


def saved_activation_outputs(graph: fx.Graph, num_fwd_outputs: int) -> list[int]:
    """Indices of a partitioned forward graph's outputs that are activations saved for backward:
    past the ``num_fwd_outputs`` user outputs (AOTAutograd's layout: user outputs, then saved
    tensors, opaque objects, SymInts), tensors that are neither a graph input (a parameter or its
    shard, a batch tensor) nor a view of one, nor a gathered parameter."""
    output = graph.find_nodes(op="output")[0]
    return [i for i, node in enumerate(output.args[0]) if i >= num_fwd_outputs and isinstance(node, fx.Node)
            and isinstance(node.meta.get("val"), torch.Tensor) and _activation_root(node) is not None]

