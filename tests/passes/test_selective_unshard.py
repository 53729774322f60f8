"""``selective_unshard`` on a hand-built stage-3 joint graph: the chosen gathers lose their
recompute tags (saved for backward, not gathered again), smallest first within the budget."""
from torch.utils.checkpoint import CheckpointPolicy

from tests.passes.graphs import aten, gathers, graph_text, linear_chain, recompute_note, run_pass
from zerograph.graph.vocab import TAG
from zerograph.passes.bucketing import bucketing
from zerograph.passes.insert_allgather import insert_allgather
from zerograph.passes.selective_unshard import choose_kept, selective_unshard
from zerograph.policies import MemoryPolicy

UNIT_BYTES = 2 * (2 * 4 + 2) * 4  # one block's gathered bytes


def _joint(units: int = 3, root: bool = False, **memory):
    b, gm = linear_chain(units, root=root)
    ctx = b.ctx("joint", memory=MemoryPolicy(**memory))
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    return b, gm, ctx


def _kept(gm) -> list[list[int]]:
    """Units of each gather whose chain is kept (tagged ``kept``, no ``MUST_RECOMPUTE``)."""
    kept = []
    for gather in gathers(gm):
        flags = {n.meta[TAG].get("kept", False) for n in gather.issue + gather.finish if TAG in n.meta}
        recompute = {n.meta.get("recompute") for n in gather.issue + gather.finish if TAG in n.meta}
        assert len(flags) == 1, "a chain is kept whole or not at all"
        if flags.pop():
            assert CheckpointPolicy.MUST_RECOMPUTE not in recompute
            kept.append(gather.units)
        else:
            assert recompute == {CheckpointPolicy.MUST_RECOMPUTE}
    return kept


def test_no_budget_keeps_nothing():
    b, gm, ctx = _joint()
    assert not selective_unshard(gm, ctx).modified
    assert _kept(gm) == []


def test_budget_keeps_units_in_order_of_size_then_position():
    b, gm, ctx = _joint(3, unshard_budget_bytes=2 * UNIT_BYTES)
    result = selective_unshard(gm, ctx)
    assert result.counts == {"kept": 2, "gathers": 3}
    assert _kept(gm) == [[1], [2]]  # equal sizes: the first two


def test_kept_parameter_read_by_compute_is_must_save():
    b, gm, ctx = _joint(2, unshard_budget_bytes=UNIT_BYTES)
    selective_unshard(gm, ctx)
    first_matmul = gm.graph.find_nodes(op="call_function", target=aten.addmm.default)[0]
    bias = first_matmul.args[0]  # the first unit's gathered bias, read by the matmul
    assert bias.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
    transposes = gm.graph.find_nodes(op="call_function", target=aten.t.default)
    assert transposes[0].meta["recompute"] == CheckpointPolicy.MUST_SAVE  # the kept weight's view, read by compute
    assert transposes[1].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE  # the other unit's is not kept


def test_root_kept_when_not_resharded_after_forward():
    b, gm, ctx = _joint(2, root=True, reshard_root_after_forward=False)
    selective_unshard(gm, ctx)
    assert _kept(gm) == [[0]]


def test_only_the_stage3_joint_graph():
    b, gm = linear_chain(2)
    ctx = b.ctx("forward", memory=MemoryPolicy(unshard_budget_bytes=10 * UNIT_BYTES))
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    assert not selective_unshard(gm, ctx).modified
    b, gm, ctx = _joint(2, unshard_budget_bytes=10 * UNIT_BYTES)
    assert not selective_unshard(gm, b.ctx("joint", stage=2, memory=ctx.memory)).modified


def test_choose_kept_smallest_first_within_budget():
    assert choose_kept([30, 10, 20], budget=30) == [1, 2]
    assert choose_kept([30, 10, 20], budget=9) == []
    assert choose_kept([10, 10, 10], budget=25) == [0, 1]


def test_expected_graph_with_one_unit_kept():
    """Two units, a budget of one unit's bytes: the first unit's gather chain loses its recompute
    tags (``kept``), the gathered bias and the weight's transpose that compute reads are
    ``MUST_SAVE``; the second unit's chain stays ``MUST_RECOMPUTE``. No node is added, removed or
    moved: the pass only retags."""
    b, gm, ctx = _joint(2, unshard_budget_bytes=UNIT_BYTES)
    before = graph_text(gm)
    result = run_pass(selective_unshard, gm, ctx)
    assert result.modified and result.counts == {"kept": 1, "gathers": 2}
    assert graph_text(gm) == before
    assert graph_text(gm, note=recompute_note) == """\
input x
input shard_0
input shard_1
input shard_2
input shard_3
view_default = aten.view(shard_0, [2, 4])
view_default_1 = aten.view(shard_1, [2])
view_default_2 = aten.view(shard_2, [2, 4])
view_default_3 = aten.view(shard_3, [2])
pack_shards = zerograph.pack_shards([view_default, view_default_1], [2, 2], 1, torch.float32)  # kept
all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(pack_shards, 2, '0')  # kept
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor)  # kept
unpack_gathered = zerograph.unpack_gathered(wait_tensor, 2, [2, 2], [4, 4], [4, 1])  # kept
slice_1 = aten.slice(unpack_gathered, 0, 0, 16)  # kept
view = aten.view(slice_1, [4, 4])  # kept
slice_2 = aten.slice(unpack_gathered, 0, 16, 20)  # kept
view_1 = aten.view(slice_2, [4])  # must save, kept
t_default = aten.t(view)  # must save
addmm_default = aten.addmm(view_1, x, t_default)
relu_default = aten.relu(addmm_default)
pack_shards_1 = zerograph.pack_shards([view_default_2, view_default_3], [2, 2], 1, torch.float32)  # must recompute
all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(pack_shards_1, 2, '0')  # must recompute
wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_1)  # must recompute
unpack_gathered_1 = zerograph.unpack_gathered(wait_tensor_1, 2, [2, 2], [4, 4], [4, 1])  # must recompute
slice_3 = aten.slice(unpack_gathered_1, 0, 0, 16)  # must recompute
view_2 = aten.view(slice_3, [4, 4])  # must recompute
slice_4 = aten.slice(unpack_gathered_1, 0, 16, 20)  # must recompute
view_3 = aten.view(slice_4, [4])  # must recompute
t_default_1 = aten.t(view_2)  # must recompute
addmm_default_1 = aten.addmm(view_3, relu_default, t_default_1)
relu_default_1 = aten.relu(addmm_default_1)
sum_default = aten.sum(relu_default_1)
return (sum_default,)"""
    assert _kept(gm) == [[1]]  # the docstring's invariant: a chain is kept whole, or left recompute-tagged
