"""``activation_partition`` on a hand-built stage-3 joint graph of MLP blocks (``joint_mlp``):
given a budget in bytes, whole units are recomputed, offloaded or partitioned (P_a), most bytes
freed per second first, until the estimate of saved bytes fits; under budget nothing changes.

Bytes saved for backward per unit (fp32): ``hidden`` 128, the unit's output 32 (not the last
unit's: only the loss reads it), so 160, 160, 128 = 448 for three units; recomputing unit
``i > 1`` saves its input (32) instead. Every test prices the options with an explicit cost model,
so no decision depends on the pass's nominal rates."""
import dataclasses
import logging

import pytest
from torch.utils.checkpoint import CheckpointPolicy

import zerograph.passes.activation_partition as ap
from tests.passes.graphs import aten, gathered_joint, gathers, graph_text, recompute_note, run_pass
from zerograph.graph.costmodel import CostModel
from zerograph.graph.ops import GATHER_ACTIVATION, SHARD_ACTIVATION
from zerograph.graph.vocab import TAG
from zerograph.passes.activation_partition import ACTIVATION, KEEP, OFFLOAD, PARTITION, RECOMPUTE, activation_partition
from zerograph.passes.selective_unshard import selective_unshard
from zerograph.policies import ActivationPolicy, MemoryPolicy

HIDDEN, OUT = 2 * 16 * 4, 2 * 4 * 4  # bytes of a unit's hidden activation and of its output
UNITS_SAVED = 2 * (HIDDEN + OUT) + HIDDEN  # 448
# what the estimate counts outside every unit: nothing (the loss goes to the caller, not to
# backward: test_a_user_output_is_not_counted_as_saved)
ROOT = 0
UNCONSTRAINED = UNITS_SAVED + ROOT
# compute priced as on a fast device: recompute is the cheapest way to free bytes (no other option)
FAST = CostModel(world_size=2, flops_per_s=1e12, bytes_per_s=1e12, op_overhead_s=1e-6, collectives={})
# compute 10^6 times slower, an all-gather over 2 ranks and the host link (PCIe 5's 64 GB/s) cheap:
# offload and P_a beat recompute
SLOW = CostModel(world_size=2, flops_per_s=1e6, bytes_per_s=1e6, op_overhead_s=1e-3,
                 collectives={"all_gather": (1e-5, 1e-9)}, host_bytes_per_s=64e9)


def _joint(units: int = 3, budget: int | None = None, cost: CostModel = FAST, *, offload: bool = False,
           group: tuple[str, int] | None = None, dropout: bool = False, **knobs):
    policy = ActivationPolicy(budget_bytes=budget, offload=offload, cost_model=cost if budget is not None else None)
    return gathered_joint(units, dropout=dropout, activations=policy, activation_group=group, **knobs)


def _unit_nodes(gm, unit: int) -> list:
    """The forward nodes traced in unit ``unit``'s module (``joint_mlp`` puts them there)."""
    return [n for n in gm.graph.nodes if f"L['self'].u{unit}" in str(n.meta.get("nn_module_stack", ""))]


def _tags(gm) -> dict[str, tuple]:
    """Every node's recompute-related meta, by name."""
    return {n.name: (n.meta.get("recompute"), n.meta.get("ac_graph_id"), n.meta.get("should_offload"))
            for n in gm.graph.nodes}


def _recomputed_by_pass(gm) -> set[int]:
    return {n.meta[ACTIVATION]["unit"] for n in gm.graph.nodes if n.meta.get(ACTIVATION, {}).get("decision") == RECOMPUTE
            and n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}


def test_no_budget_changes_nothing():
    b, gm, ctx = _joint(budget=None)
    code, tags = gm.code, _tags(gm)
    assert not activation_partition(gm, ctx).modified
    assert gm.code == code and _tags(gm) == tags
    assert not any(ACTIVATION in n.meta for n in gm.graph.nodes)


def test_only_the_joint_graph():
    b, gm, ctx = _joint(budget=0)
    tags = _tags(gm)
    assert not activation_partition(gm, dataclasses.replace(ctx, graph_kind="forward")).modified
    assert _tags(gm) == tags


def test_estimates_count_each_storage_once_and_no_parameter():
    """Saved bytes per unit: ``hidden`` and the output's storage (read by backward through a view,
    counted once), never the gathered weights backward reads nor the batch; recompute saves the
    unit's input instead (nothing for unit 1, whose input is the batch). The root is never planned."""
    b, gm, ctx = _joint()
    plan = ap.plan_activations(gm.graph, ctx.units, UNCONSTRAINED, FAST)
    assert [(u.unit, u.saved_bytes, u.input_bytes) for u in plan.units] == [
        (1, HIDDEN + OUT, 0), (2, HIDDEN + OUT, OUT), (3, HIDDEN, OUT)]
    assert plan.unconstrained_bytes == UNCONSTRAINED and plan.root_bytes == ROOT
    assert all(u.recompute_flops > 0 and u.recompute_s > 0 for u in plan.units)
    assert all(u.offload_s is None and u.partition_s is None for u in plan.units)  # neither was allowed


def test_under_budget_tags_nothing():
    b, gm, ctx = _joint(budget=UNCONSTRAINED)
    tags = _tags(gm)
    result = activation_partition(gm, ctx)
    assert not result.modified
    assert result.counts == {"recompute_units": 0, "offload_units": 0, "partition_units": 0, "units": 3,
                             "estimated_saved_bytes": UNCONSTRAINED}
    assert _tags(gm) == tags
    notes = [n.meta[ACTIVATION] for n in gm.graph.nodes if ACTIVATION in n.meta]
    assert [(d["unit"], d["decision"]) for d in notes] == [(1, KEEP), (2, KEEP), (3, KEEP)]  # one note per unit


@pytest.mark.parametrize("budget, recomputed, estimate", [
    (UNCONSTRAINED - 1, [1], UNCONSTRAINED - (HIDDEN + OUT)),  # unit 1 frees the most: 160
    (UNCONSTRAINED - (HIDDEN + OUT), [1], UNCONSTRAINED - (HIDDEN + OUT)),  # the budget is inclusive
    (UNCONSTRAINED - (HIDDEN + OUT) - 1, [1, 2], ROOT + OUT + HIDDEN),  # then unit 2 (frees 128) before 3 (96)
    (ROOT + OUT + HIDDEN, [1, 2], ROOT + OUT + HIDDEN),
])
def test_budget_recomputes_whole_units_most_bytes_freed_first(budget, recomputed, estimate):
    b, gm, ctx = _joint(budget=budget)
    before = _tags(gm)
    result = activation_partition(gm, ctx)
    assert result.modified and result.counts["recompute_units"] == len(recomputed)
    assert result.counts["estimated_saved_bytes"] == estimate <= budget
    assert _recomputed_by_pass(gm) == set(recomputed)
    for unit in (1, 2, 3):
        for node in _unit_nodes(gm, unit):
            if before[node.name][0] is not None:
                continue  # a view of a gathered weight: insert_allgather's tag, left as it was
            if unit in recomputed:  # the whole unit, with one region id per unit, in forward order
                assert node.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE, node
                assert node.meta["ac_graph_id"] == recomputed.index(unit) + 1, node
            else:
                assert "recompute" not in node.meta and "ac_graph_id" not in node.meta, node


def test_budget_out_of_reach_recomputes_every_unit_and_warns(caplog):
    """Budget 0: every unit is recomputed; what stays saved (the inputs of units 2 and 3) misses the
    budget, which a warning says. Nodes outside every unit (the loss) are never tagged."""
    b, gm, ctx = _joint(budget=0)
    with caplog.at_level(logging.WARNING):
        result = activation_partition(gm, ctx)
    assert _recomputed_by_pass(gm) == {1, 2, 3}
    assert result.counts["estimated_saved_bytes"] == ROOT + 2 * OUT
    assert "cannot be met" in caplog.text
    (loss,) = gm.graph.find_nodes(op="call_function", target=aten.sum.default)
    assert "recompute" not in loss.meta


def test_recompute_tags_of_earlier_passes_are_left_alone():
    """``selective_unshard`` keeps unit 2's gather (``MUST_SAVE`` on what compute reads), a user's
    own checkpointing tags one of unit 3's matmuls ``PREFER_RECOMPUTE``; with every unit
    recomputed, those tags are as they were, and the pre-tagged node gets no region id."""
    b, gm, ctx = _joint(budget=0)
    sizes = [g.full_bytes for g in gathers(gm)]
    ctx = dataclasses.replace(ctx, memory=MemoryPolicy(unshard_budget_bytes=sizes[0]))
    assert selective_unshard(gm, ctx).counts["kept"] == 1
    user_tagged = [n for n in _unit_nodes(gm, 3) if n.target is aten.mm.default][0]
    user_tagged.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    before = {name: tag for name, tag in _tags(gm).items() if tag[0] is not None}
    assert CheckpointPolicy.MUST_SAVE in {tag[0] for tag in before.values()}  # the kept gather's
    activation_partition(gm, ctx)
    after = _tags(gm)
    assert {name: after[name] for name in before} == before
    assert _recomputed_by_pass(gm) == {1, 2, 3}


def test_seeded_ops_are_never_recomputed():
    """With dropout in every unit: the ``native_dropout`` and its outputs stay saved (what
    recompute saves instead includes them), every other op of the unit is recomputed."""
    b, gm, ctx = _joint(budget=0, dropout=True)
    plan = ap.plan_activations(gm.graph, ctx.units, 0, FAST)
    dropped, mask = HIDDEN, 2 * 16  # the dropout's output (fp32) and its mask (bool)
    assert plan.units[0].saved_bytes == HIDDEN + dropped + mask + OUT
    assert plan.units[0].input_bytes == dropped + mask
    activation_partition(gm, ctx)
    for unit in (1, 2, 3):
        nodes = _unit_nodes(gm, unit)
        seeded = [n for n in nodes if n.target is aten.native_dropout.default or "getitem" in n.name]
        assert len(seeded) == 3
        assert all("recompute" not in n.meta for n in seeded)
        assert all(n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE for n in nodes if n not in seeded)


def test_offload_only_when_asked():
    """Compute priced slow, so offload frees the most bytes per second, if allowed: every unit's
    saved storages are marked for PyTorch's offloading and ``MUST_SAVE``; nothing is recomputed.
    Backward's read of a forward view (the next unit's input, a view of this unit's matmul) is
    replayed on the offloaded storage itself, in backward. Without ``offload``, units are recomputed."""
    b, gm, ctx = _joint(budget=ROOT, cost=SLOW, offload=True)
    result = activation_partition(gm, ctx)
    assert result.counts["offload_units"] == 3 and result.counts["recompute_units"] == 0
    assert result.counts["estimated_saved_bytes"] == ROOT
    marked = [n for n in gm.graph.nodes if ap.wants_offload(n)]
    assert sorted(n.target.__name__ for n in marked) == ["mm.default"] * 2 + ["relu.default"] * 3
    assert all(n.meta["recompute"] == CheckpointPolicy.MUST_SAVE for n in marked)
    assert not _recomputed_by_pass(gm)
    backward = ap.backward_nodes(gm.graph)
    for node in backward - set(gm.graph.find_nodes(op="output")):  # it reads what is offloaded, or views it made
        for inp in node.all_input_nodes:
            if inp not in backward and inp.op == "call_function" and TAG not in inp.meta:
                assert ap.wants_offload(inp), (node, inp)
    replayed = [n for n in backward if n.target is aten.view.default and ap.wants_offload(n.args[0])]
    assert len(replayed) == 2 and all(n.meta["partitioner_tag"] == "is_backward" for n in replayed)

    b, gm, ctx = _joint(budget=0, cost=SLOW, offload=False)
    activation_partition(gm, ctx)
    assert not any(ap.wants_offload(n) for n in gm.graph.nodes)
    assert _recomputed_by_pass(gm) == {1, 2, 3}


def test_partition_over_the_activation_group():
    """P_a over ``("tp", 2)`` (cheap all-gather, slow compute), budget one byte under: unit 1 alone
    is partitioned (P_a frees half of its 160 bytes). Forward keeps this rank's half of each saved
    storage (``MUST_SAVE``), backward all-gathers it over the group before its first use and reads
    nothing else of unit 1's activations; units 2 and 3 are untouched."""
    b, gm, ctx = _joint(budget=UNCONSTRAINED - 1, cost=SLOW, group=("tp", 2))
    result = activation_partition(gm, ctx)
    assert result.counts["partition_units"] == 1 and result.counts["recompute_units"] == 0
    assert result.counts["estimated_saved_bytes"] == UNCONSTRAINED - (HIDDEN + OUT) // 2
    decisions = {n.meta[ACTIVATION]["unit"]: n.meta[ACTIVATION]["decision"] for n in gm.graph.nodes
                 if "note" in n.meta.get(ACTIVATION, {})}
    assert decisions == {1: PARTITION, 2: KEEP, 3: KEEP}
    pieces = gm.graph.find_nodes(op="call_function", target=SHARD_ACTIVATION)
    unit1 = _unit_nodes(gm, 1)
    assert sorted(p.args[0].target.__name__ for p in pieces) == ["mm.default", "relu.default"]
    backward = ap.backward_nodes(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for piece in pieces:
        root = piece.args[0]
        assert root in unit1 and piece.args[1:] == ("tp", 2)
        assert piece.meta["recompute"] == CheckpointPolicy.MUST_SAVE and piece.meta[TAG]["role"] == "activation_shard"
        assert piece.meta["val"].numel() == root.meta["val"].numel() // 2
        (full,) = piece.users
        assert full.target is GATHER_ACTIVATION and full in backward
        assert full.args[1:] == (list(root.meta["val"].shape), "tp", 2)
        assert full.meta["partitioner_tag"] == "is_backward" and full.meta[TAG]["role"] == "activation_gather"
        first_read = min((u for n in (full, *full.users) for u in n.users), key=order.__getitem__)
        assert order[full] < order[first_read]
    for node in unit1:  # backward reads none of unit 1's forward values
        assert not any(u in backward for u in node.users), node
    for unit in (2, 3):
        assert any(u in backward for n in _unit_nodes(gm, unit) for u in n.users)


def test_storage_a_recomputed_unit_reads_is_never_partitioned():
    """Unit 2's recomputed forward reads unit 1's output whole, so P_a of unit 1 leaves it whole;
    P_a covers a getitem of a multi-output op (the dropout's), offload cannot move one."""
    b, gm, ctx = _joint(dropout=True)
    found, _ = ap.regions(gm.graph, ctx.units)
    boundary = found[1].shardable & found[2].instead
    assert [r.target for r in boundary] == [aten.mm.default]  # unit 1's output
    _, partitioned = ap.moved_roots(found, {1: PARTITION, 2: RECOMPUTE})
    assert partitioned == found[1].shardable - boundary and len(partitioned) == 3
    getitems = {r for r in found[1].saved if r.target.__name__ == "getitem"}
    assert len(getitems) == 2 and all(ap.shardable(r) and not ap.offloadable(r) for r in getitems)
    offloaded, partitioned = ap.moved_roots(found, {1: OFFLOAD, 2: PARTITION})
    assert offloaded == found[1].offloadable == found[1].saved - getitems
    assert not partitioned & offloaded


def test_a_graph_output_is_never_moved():
    """A saved activation that is also a user output of the graph (here unit 1's ``hidden``) is
    neither partitioned nor offloaded: ``shardable`` refuses it."""
    b, gm, ctx = _joint()
    (hidden,) = [n for n in _unit_nodes(gm, 1) if n.target is aten.relu.default]
    output = gm.graph.output_node()
    output.args = ((*output.args[0], hidden),)
    found, _ = ap.regions(gm.graph, ctx.units)
    assert hidden in found[1].saved and not ap.shardable(hidden) and hidden not in found[1].offloadable


def test_a_user_output_is_not_counted_as_saved():
    """The loss is returned to the caller, not saved for backward: no activation outside every unit
    is saved here, so the root's estimate is 0 and the estimate is the units' bytes alone."""
    b, gm, ctx = _joint()
    plan = ap.plan_activations(gm.graph, ctx.units, UNCONSTRAINED, FAST)
    assert plan.root_bytes == 0 and plan.unconstrained_bytes == UNITS_SAVED


# one MLP block's joint graph up to its compute, as both expected graphs below share it
_GATHERED_BLOCK = """\
input x
input tangents_1
input shard_0
input shard_1
view_default = aten.view(shard_0, [8, 4])
view_default_1 = aten.view(shard_1, [2, 16])
pack_shards = zerograph.pack_shards([view_default, view_default_1], [8, 2], 1, torch.float32)  # must recompute
all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(pack_shards, 2, '0')  # must recompute
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor)  # must recompute
unpack_gathered = zerograph.unpack_gathered(wait_tensor, 2, [8, 2], [16, 4], [4, 16])  # must recompute
slice_1 = aten.slice(unpack_gathered, 0, 0, 64)  # must recompute
view = aten.view(slice_1, [16, 4])  # must recompute
slice_2 = aten.slice(unpack_gathered, 0, 64, 128)  # must recompute
view_1 = aten.view(slice_2, [4, 16])  # must recompute
t_default = aten.t(view)  # must recompute
"""


def _region_note(node) -> str:
    """``recompute_note`` and the checkpoint region (``ac_graph_id``) the pass gave the node."""
    region = f"region {node.meta['ac_graph_id']}" if "ac_graph_id" in node.meta else ""
    return ", ".join(text for text in (recompute_note(node), region) if text)


def test_expected_joint_of_one_recomputed_unit():
    """A budget of 0 bytes: the block's four forward compute nodes are tagged ``MUST_RECOMPUTE``
    in checkpoint region 1 (as ``torch.utils.checkpoint`` tags a region); the loss, the backward
    and the gather chain (tagged by ``insert_allgather``) keep their tags; no node is added."""
    b, gm, ctx = _joint(1, budget=0)
    before = graph_text(gm)
    result = run_pass(activation_partition, gm, ctx)
    assert result.counts == {"recompute_units": 1, "offload_units": 0, "partition_units": 0, "units": 1,
                             "estimated_saved_bytes": 0}
    assert graph_text(gm) == before
    assert graph_text(gm, note=_region_note) == _GATHERED_BLOCK + """\
mm_default = aten.mm(x, t_default)  # must recompute, region 1
relu_default = aten.relu(mm_default)  # must recompute, region 1
t_default_1 = aten.t(view_1)  # must recompute
mm_default_1 = aten.mm(relu_default, t_default_1)  # must recompute, region 1
view_default_2 = aten.view(mm_default_1, [2, 4])  # must recompute, region 1
sum_default = aten.sum(view_default_2)
expand_default = aten.expand(tangents_1, [2, 4])
t_default_2 = aten.t(expand_default)
mm_default_2 = aten.mm(t_default_2, relu_default)
reduce_grad_default = zerograph.reduce_grad(mm_default_2, 1)
mm_default_3 = aten.mm(expand_default, view_1)
threshold_backward_default = aten.threshold_backward(mm_default_3, relu_default, 0)
t_default_3 = aten.t(threshold_backward_default)
mm_default_4 = aten.mm(t_default_3, x)
reduce_grad_default_1 = zerograph.reduce_grad(mm_default_4, 0)
return (sum_default, reduce_grad_default_1, reduce_grad_default)"""
    assert _recomputed_by_pass(gm) == {1}


def test_expected_joint_of_one_partitioned_unit():
    """A budget of half the block's hidden activation, P_a cheaper than recompute: the forward
    keeps this rank's half of ``relu`` (``shard_activation`` right after it, ``MUST_SAVE``) and
    the backward all-gathers it over the activation group before its first read; both backward
    reads of ``relu`` read the gathered copy (the docstring's invariant)."""
    b, gm, ctx = _joint(1, budget=HIDDEN // 2, cost=SLOW, group=("act", 2))
    result = run_pass(activation_partition, gm, ctx)
    assert result.counts == {"recompute_units": 0, "offload_units": 0, "partition_units": 1, "units": 1,
                             "estimated_saved_bytes": HIDDEN // 2}
    assert graph_text(gm, note=recompute_note) == _GATHERED_BLOCK + """\
mm_default = aten.mm(x, t_default)
relu_default = aten.relu(mm_default)
shard_activation_default = zerograph.shard_activation(relu_default, 'act', 2)  # must save
t_default_1 = aten.t(view_1)  # must recompute
mm_default_1 = aten.mm(relu_default, t_default_1)
view_default_2 = aten.view(mm_default_1, [2, 4])
sum_default = aten.sum(view_default_2)
expand_default = aten.expand(tangents_1, [2, 4])
t_default_2 = aten.t(expand_default)
gather_activation_default = zerograph.gather_activation(shard_activation_default, [2, 16], 'act', 2)
mm_default_2 = aten.mm(t_default_2, gather_activation_default)
reduce_grad_default = zerograph.reduce_grad(mm_default_2, 1)
mm_default_3 = aten.mm(expand_default, view_1)
threshold_backward_default = aten.threshold_backward(mm_default_3, gather_activation_default, 0)
t_default_3 = aten.t(threshold_backward_default)
mm_default_4 = aten.mm(t_default_3, x)
reduce_grad_default_1 = zerograph.reduce_grad(mm_default_4, 0)
return (sum_default, reduce_grad_default_1, reduce_grad_default)"""
    (hidden,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
    assert not set(hidden.users) & ap.backward_nodes(gm.graph)  # backward reads the gathered copy only
