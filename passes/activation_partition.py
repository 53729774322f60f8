"""Fit the activations saved for backward into ``ActivationPolicy.budget_bytes``: per unit, keep,
recompute, offload to host memory, or partition across the activation group (ZeRO-R P_a).

Pre: a joint graph (before the min-cut partitioner) whose forward nodes carry Dynamo's
``nn_module_stack``; the gather chains of ``insert_allgather`` and the kept gathers of
``selective_unshard`` already carry their own ``recompute`` tags (left as they are).
Post: with ``ctx.activations.budget_bytes`` None, nothing changes. Otherwise every non-root unit is
planned (``plan_activations``: most bytes freed per second first, priced by
``ctx.activations.cost_model``) and the plan is carried out:

- ``recompute``: the unit's forward nodes get ``meta["recompute"] = MUST_RECOMPUTE`` and
  ``meta["ac_graph_id"]`` (its rank in forward order), as ``torch.utils.checkpoint`` marks a
  checkpointed region; the partitioner saves what the unit reads from outside and runs it again.
- ``offload`` (``ctx.activations.offload``): each storage offload can move (``offloadable``) is
  marked ``should_offload`` and ``MUST_SAVE`` for PyTorch's partitioner-level offloading.
- ``partition`` (``ctx.activation_group``, M ranks): each storage P_a can partition (``shardable``)
  gets ``zerograph::shard_activation`` after it (1/M saved) and ``zerograph::gather_activation``
  before its first backward use. Every rank of the group must hold bitwise the same activations.

Never recomputed: the root unit, ops tagged ``torch.Tag.nondeterministic_seeded`` (dropout, fused
attention) and their ``getitem``s, nodes that already carry ``recompute``. The first forward node
of every planned unit carries ``meta[ACTIVATION]["note"]`` (the decision and every option's price),
which the dump prints. docs/design.md, "The activation plan", has how the plan is chosen and why
seeded ops stay saved.

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

from zerograph.errors import ConfigError
from zerograph.graph.costmodel import CostModel, is_view, node_bytes, node_flops, tensor_bytes
from zerograph.graph.vocab import TAG
from zerograph.shard.sharding import Unit

from .context import PassContext, PassResult
from .contract import contract
from .liveness import storage_root
from .storage_rewrite import SHOULD_OFFLOAD, offload_storage, partition_storage

log = logging.getLogger(__name__)

ACTIVATION = "zerograph_activation"  # node.meta key of the decision (not TAG: these are the model's nodes)
KEEP, RECOMPUTE, OFFLOAD, PARTITION = "keep", "recompute", "offload", "partition"

@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """One unit's activations: estimates (bytes, FLOPs, seconds) and the decision."""

    unit: int
    name: str
    saved_bytes: int         # activations backward reads if the unit is kept
    input_bytes: int         # what recomputing saves instead (its inputs, its seeded outputs)
    recompute_flops: int     # FLOPs of the forward ops backward would run again
    recompute_bytes: int     # bytes those ops read and write
    recompute_s: float       # their roofline time under the cost model
    offload_bytes: int       # of saved_bytes, what offload can move (``offloadable``)
    partition_bytes: int     # of saved_bytes, what P_a can partition (``shardable``)
    offload_s: float | None  # host round trip of offload_bytes; None: offload not allowed
    partition_s: float | None  # all-gather of partition_bytes over the group; None: no group
    decision: str            # KEEP, RECOMPUTE, OFFLOAD or PARTITION

    @property
    def freed_bytes(self) -> int:
        return self.saved_bytes - self.input_bytes


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """The plan for one joint graph: per-unit decisions and the whole graph's estimates (bytes)."""

    budget_bytes: int
    root_bytes: int          # activations of the root unit and of nodes outside every unit (kept)
    unconstrained_bytes: int  # estimate with every unit kept
    planned_bytes: int       # estimate of device bytes with the decisions below
    units: tuple[UnitPlan, ...]  # non-root units, in unit order

    def decided(self, decision: str) -> list[int]:
        return [u.unit for u in self.units if u.decision == decision]

    @property
    def recomputed(self) -> list[int]:
        return self.decided(RECOMPUTE)


@dataclasses.dataclass
class _Region:
    """A unit's forward nodes (internal: holds graph nodes, never leaves this module)."""

    unit: int
    nodes: list[fx.Node]        # its forward nodes, graph order
    tagged: list[fx.Node]       # those recompute would tag
    saved: set[fx.Node]         # storage roots backward reads when kept
    instead: set[fx.Node]       # storage roots saved when recomputed
    offloadable: set[fx.Node] = dataclasses.field(default_factory=set)  # of saved, what offload moves
    shardable: set[fx.Node] = dataclasses.field(default_factory=set)  # of saved, what P_a partitions


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
    # the output node returns the gradients, so backward_nodes counts it in backward; a forward
    # value it returns (the loss) goes to the caller, not to backward: it is not saved
    backward = backward_nodes(graph) - set(graph.find_nodes(op="output"))
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
        region.offloadable = {r for r in region.saved if offloadable(r)}
        region.shardable = {r for r in region.saved if shardable(r)}
    return dict(sorted(found.items())), root_saved


def shardable(root: fx.Node) -> bool:
    """Whether P_a can partition this saved storage: a contiguous tensor the forward computes (no
    view: ``shard_activation`` copies this rank's piece, and the all-gather rebuilds a contiguous
    tensor), not a user output of the graph."""
    val = root.meta.get("val")
    return (root.op == "call_function" and not is_view(root) and isinstance(val, torch.Tensor)
            and val.is_contiguous() and not any(u.op == "output" for u in root.users))


def offloadable(root: fx.Node) -> bool:
    """Whether offload can move it: ``shardable`` and not a ``getitem`` of a multi-output op (such
    as ``native_layer_norm``'s output), which PyTorch's offloading refuses (``can_offload``)."""
    return shardable(root) and root.target is not operator.getitem


def _bytes(roots: set[fx.Node]) -> int:
    return sum(_nbytes(r) for r in roots)


def plan_activations(graph: fx.Graph, units: Sequence[Unit], budget_bytes: int, cost: CostModel,
                     *, offload: bool = False, group_size: int | None = None) -> ActivationPlan:
    """Decide keep / recompute / offload / partition per non-root unit (see the module doc); plain
    data, no rewrite. ``cost`` prices the options; ``offload``: host memory may hold activations
    (``cost`` must then know ``host_bytes_per_s``); ``group_size``: M, ranks of the group over
    which activations are replicated (``None``: no P_a).

    Raises:
        ConfigError: ``cost`` cannot price an allowed option (no host link rate, no all-gather)."""
    found, root_saved = regions(graph, units)
    return _choose(found, root_saved, units, budget_bytes, cost, offload, group_size)


def moved_roots(found: dict[int, _Region], decisions: dict[int, str]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The storages ``decisions`` offload and partition. Offload wins where both apply; a storage a
    recomputed unit reads (its ``instead``) is never partitioned: the recomputed forward reads it
    whole, so it stays saved whole and an all-gather of it would be wasted."""
    offloaded, partitioned, read_by_recompute = set(), set(), set()
    for unit, region in found.items():
        decision = decisions.get(unit, KEEP)
        if decision == OFFLOAD:
            offloaded |= region.offloadable
        elif decision == PARTITION:
            partitioned |= region.shardable
        elif decision == RECOMPUTE:
            read_by_recompute |= region.instead
    return offloaded, partitioned - offloaded - read_by_recompute


def _choose(found: dict[int, _Region], root_saved: set[fx.Node], units: Sequence[Unit], budget: int,
            cost: CostModel, offload: bool = False, group_size: int | None = None) -> ActivationPlan:
    group_size = group_size if group_size and group_size > 1 else None
    if offload and cost.host_bytes_per_s is None:
        raise ConfigError("the activation cost model has no host_bytes_per_s to price offload: give it one "
                          "(clusters.json's host_link_bytes_per_s), or build the policy through Config")
    group_cost = cost.resized(group_size) if group_size else None

    def estimate(decisions: dict[int, str]) -> int:
        """Device bytes saved for backward: what is kept, less what goes to the host, less
        (M - 1) / M of what is partitioned (each piece rounds up)."""
        device = set(root_saved)
        for unit, region in found.items():
            device |= region.instead if decisions.get(unit, KEEP) == RECOMPUTE else region.saved
        offloaded, partitioned = moved_roots(found, decisions)
        pieces = sum(-(-_nbytes(r) // (group_size or 1)) for r in partitioned)
        return _bytes(device - offloaded - partitioned) + pieces

    plans, options = [], []
    for unit, region in found.items():
        work = [n for n in region.tagged if isinstance(n.target, torch._ops.OpOverload) and not is_view(n)]
        saved, instead = _bytes(region.saved), _bytes(region.instead)
        offload_bytes, partition_bytes = _bytes(region.offloadable), _bytes(region.shardable)
        flops, moved = sum(node_flops(n) for n in work), sum(node_bytes(n) for n in work)
        recompute_s = sum(cost.node_time(n) for n in region.tagged)
        offload_s = 2 * offload_bytes / cost.host_bytes_per_s if offload else None
        partition_s = group_cost.collective_time("all_gather", partition_bytes) if group_cost else None
        plans.append([unit, units[unit].name, saved, instead, flops, moved, recompute_s, offload_bytes,
                      partition_bytes, offload_s, partition_s])
        freed = {RECOMPUTE: (saved - instead, recompute_s), OFFLOAD: (offload_bytes, offload_s),
                 PARTITION: (partition_bytes - partition_bytes // group_size if group_size else 0, partition_s)}
        for order, (decision, (nbytes, seconds)) in enumerate(freed.items()):
            if seconds is not None and nbytes > 0:
                options.append((-nbytes / max(seconds, 1e-12), unit, order, decision, nbytes))

    def greedy(allowed: set[str]) -> dict[int, str]:
        """Most bytes freed per second first. A unit takes its cheapest option; a dearer one
        replaces it only if it frees more, so a budget P_a alone cannot meet falls back to offload
        or recompute of the same unit."""
        decisions: dict[int, str] = {}
        freed_by: dict[int, int] = {}
        for _, unit, _, decision, nbytes in sorted(options):
            if estimate(decisions) <= budget:
                break
            if decision in allowed and nbytes > freed_by.get(unit, 0):
                decisions[unit], freed_by[unit] = decision, nbytes
        return decisions

    # Per-unit prices miss what neighbours free together (a recomputed unit's input is its
    # predecessor's output, freed only when that one is recomputed too), so the mixed plan can
    # miss a budget one kind of option alone meets: then that plan, the first of those that fits.
    kinds = {d for *_, d, _ in options}
    candidates = [greedy(kinds)] + [greedy({kind}) for kind in (RECOMPUTE, OFFLOAD, PARTITION) if kind in kinds]
    decisions = next((c for c in candidates if estimate(c) <= budget), min(candidates, key=estimate))
    units_planned = tuple(UnitPlan(*p, decisions.get(p[0], KEEP)) for p in plans)
    return ActivationPlan(budget, _bytes(root_saved), estimate({}), estimate(decisions), units_planned)


@contract(requires=("gathers",))
def activation_partition(gm: fx.GraphModule, ctx: PassContext, *, cost: CostModel | None = None) -> PassResult:
    """Plan (``plan_activations``), then carry the decisions out (see the module doc).
    ``cost``: price the options under this model (default ``ctx.activations.cost_model``, which
    ``Config`` always fills in when there is a budget).

    Raises:
        ConfigError: no cost model at all (a ``PassContext`` built without ``Config``)."""
    if ctx.graph_kind != "joint" or ctx.activations.budget_bytes is None:
        return PassResult(gm, False)
    cost = cost if cost is not None else ctx.activations.cost_model
    if cost is None:
        raise ConfigError("activation_partition needs a cost model: ctx.activations.cost_model (Config fills it "
                          "in from clusters.json's nominal cluster) or cost=")
    found, root_saved = regions(gm.graph, ctx.units)
    group_name, group_size = ctx.activation_group or (None, None)
    plan = _choose(found, root_saved, ctx.units, ctx.activations.budget_bytes, cost, ctx.activations.offload,
                   group_size)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    order = sorted(plan.recomputed, key=lambda u: pos[found[u].nodes[0]])
    region_id = {unit: i + 1 for i, unit in enumerate(order)}  # increasing along forward, as checkpoint's ids
    backward = backward_nodes(gm.graph) if plan.decided(PARTITION) or plan.decided(OFFLOAD) else set()
    offloaded, partitioned = moved_roots(found, {p.unit: p.decision for p in plan.units})
    for p in plan.units:
        region = found[p.unit]
        if p.decision == RECOMPUTE:
            for node in region.tagged:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = region_id[p.unit]
                node.meta[ACTIVATION] = {"unit": p.unit, "decision": RECOMPUTE}
        elif p.decision == OFFLOAD:
            for root in sorted(region.offloadable & offloaded, key=pos.__getitem__):
                offload_storage(gm.graph, root, backward, pos)
        elif p.decision == PARTITION:
            for root in sorted(region.shardable & partitioned, key=pos.__getitem__):
                partition_storage(gm.graph, root, backward, pos, group_name, group_size)
        first = region.nodes[0]
        first.meta[ACTIVATION] = {"unit": p.unit, "decision": p.decision, "note": _note(p)}
        log.debug("unit %d %r: %s", p.unit, p.name, _note(p))
    if plan.planned_bytes > plan.budget_bytes:
        log.warning("activation budget %d bytes cannot be met: the estimate is %d bytes with every useful option "
                    "taken (%d of it the root unit's)", plan.budget_bytes, plan.planned_bytes, plan.root_bytes)
    counts = {f"{d}_units": len(plan.decided(d)) for d in (RECOMPUTE, OFFLOAD, PARTITION)}
    log.info("activations: %s of %d units; estimate %d -> %d bytes (budget %d)", counts, len(plan.units),
             plan.unconstrained_bytes, plan.planned_bytes, plan.budget_bytes)
    changed = any(counts.values())
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed, {**counts, "units": len(plan.units), "estimated_saved_bytes": plan.planned_bytes})


def _note(p: UnitPlan) -> str:
    """The decision and the numbers behind it, as the dump prints it."""
    what = {KEEP: f"keep ~{p.saved_bytes:,} bytes saved for backward",
            RECOMPUTE: f"recompute in backward: saves ~{p.input_bytes:,} instead of ~{p.saved_bytes:,} bytes",
            OFFLOAD: f"offload ~{p.offload_bytes:,} of ~{p.saved_bytes:,} saved bytes to host memory",
            PARTITION: f"partition ~{p.partition_bytes:,} of ~{p.saved_bytes:,} saved bytes over the activation "
                       f"group (P_a)"}[p.decision]
    priced = [f"recompute frees {p.freed_bytes:,} B in ~{p.recompute_s * 1e6:.1f} us "
              f"({p.recompute_flops:,} FLOPs, {p.recompute_bytes:,} B moved)"]
    if p.offload_s is not None:
        priced.append(f"offload frees {p.offload_bytes:,} B in ~{p.offload_s * 1e6:.1f} us of host transfer")
    if p.partition_s is not None:
        priced.append(f"partition frees most of {p.partition_bytes:,} B in ~{p.partition_s * 1e6:.1f} us of all-gather")
    return f"activations of unit {p.unit} '{p.name}': {what}; " + "; ".join(priced)


def wants_offload(node: fx.Node) -> bool:
    """Whether this pass marked a joint-graph node for PyTorch's activation offloading."""
    return bool(node.meta.get(SHOULD_OFFLOAD))


def offloaded_outputs(graph: fx.Graph) -> list[int]:
    """Indices of a partitioned forward graph's outputs that PyTorch's activation offloading put
    in host memory: made by ``prims.device_put`` (to the CPU) or by an ``ao.offload`` (through its
    ``ao.wait_tensor``)."""
    def offloaded(node: object) -> bool:
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        name = str(node.target)
        if name.startswith("ao.wait_tensor"):
            return offloaded(node.args[0])
        return name.startswith("ao.offload") or (name.startswith("prims.device_put")
                                                 and torch.device(node.args[1]).type == "cpu")
    output = graph.find_nodes(op="output")[0]
    return [i for i, node in enumerate(output.args[0]) if offloaded(node)]


def saved_activation_outputs(graph: fx.Graph, num_fwd_outputs: int) -> list[int]:
    """Indices of a partitioned forward graph's outputs that are activations saved for backward:
    past the ``num_fwd_outputs`` user outputs (AOTAutograd's layout: user outputs, then saved
    tensors, opaque objects, SymInts), tensors that are neither a graph input (a parameter or its
    shard, a batch tensor) nor a view of one, nor a gathered parameter."""
    output = graph.find_nodes(op="output")[0]
    return [i for i, node in enumerate(output.args[0]) if i >= num_fwd_outputs and isinstance(node, fx.Node)
            and isinstance(node.meta.get("val"), torch.Tensor) and _activation_root(node) is not None]

