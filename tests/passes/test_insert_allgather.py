"""``insert_allgather`` on hand-built graphs: each ``unshard`` marker becomes shard -> all-gather
-> wait -> view of the full parameter, one collective per bucket."""
import torch
from torch.utils.checkpoint import CheckpointPolicy

from tests.passes.graphs import GraphBuilder, aten, collectives, count, graph_text, linear_chain, positions, waits
from zerograph.graph.ops import UNSHARD
from zerograph.graph.vocab import TAG, WAIT
from zerograph.kernels.ops import PACK_SHARDS, UNPACK_GATHERED
from zerograph.passes._fx import is_alias_of_input
from zerograph.passes.bucketing import bucketing
from zerograph.passes.insert_allgather import insert_allgather
from zerograph.passes.manager import check_collectives_waited


def _full_values(gm) -> list[torch.Tensor]:
    """The values the compute reads in place of the markers: the first input of each ``t``."""
    return [n.args[0] for n in gm.graph.find_nodes(op="call_function", target=aten.t.default)]


def test_single_parameter_is_shard_gather_wait_view():
    b, gm = linear_chain(2)  # no bucketing: one gather per parameter
    result = insert_allgather(gm, b.ctx())
    assert result.counts == {"all_gather": 4}
    assert count(gm, UNSHARD) == 0 and count(gm, PACK_SHARDS) == 0 and count(gm, UNPACK_GATHERED) == 0
    check_collectives_waited(gm.graph)
    for full in _full_values(gm):  # the weight the matmul reads: views of a wait of a gather of a shard view
        node = full
        while node.target is not WAIT:
            assert is_alias_of_input(node), node.target  # no copy for a single parameter
            node = node.args[0]
        gather = source = node.args[0]
        while source.op != "placeholder":  # this rank's shard, through views (an even shard needs no pad)
            source = source.args[0]
            assert source.op == "placeholder" or is_alias_of_input(source), source.target
        assert tuple(full.meta["val"].shape) == (4, 4)
        assert gather.meta["val"].numel() == 2 * 2 * 4  # world size x padded shard


def test_bucket_is_one_copy_in_gather_wait_copy_out():
    b, gm = linear_chain(3)
    ctx = b.ctx()
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    gathers = collectives(gm, "all_gather")
    assert len(gathers) == len(waits(gm)) == 3
    assert count(gm, PACK_SHARDS) == count(gm, UNPACK_GATHERED) == 3
    for gather in gathers:
        assert gather.args[0].target is PACK_SHARDS
        (wait,) = gather.users
        (unpack,) = wait.users
        assert unpack.target is UNPACK_GATHERED
        assert gather.meta[TAG]["role"] == "gather" and len(gather.meta[TAG]["units"]) == 1
        assert gather.meta["val"].numel() == 2 * (2 * 4 + 2)  # N x (weight shard + bias shard)


def test_gather_sits_before_the_units_first_use():
    b, gm = linear_chain(3)
    ctx = b.ctx()
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    pos = positions(gm)
    matmuls = list(gm.graph.find_nodes(op="call_function", target=aten.addmm.default))
    wait_pos = sorted(pos[w] for w in waits(gm))
    for unit, (matmul, wait) in enumerate(zip(matmuls, wait_pos)):
        assert wait < pos[matmul], unit
        if unit:  # and after the previous unit's compute: gathered just in time (prefetch moves it)
            assert wait > pos[matmuls[unit - 1]]


def test_tied_parameter_is_gathered_once():
    b = GraphBuilder([[(4, 4)]])
    x = b.input("x", 2, 4)
    shard = b.shard(0)
    first = b.op(aten.mm.default, x, b.op(aten.t.default, b.unshard(shard, 0)))
    second = b.op(aten.mm.default, first, b.unshard(shard, 0))  # the same weight, read again
    gm = b.output(b.op(aten.sum.default, second))
    insert_allgather(gm, b.ctx())
    assert len(collectives(gm)) == 1 and count(gm, UNSHARD) == 0


def test_stage3_joint_tags_chain_and_views_recompute():
    b, gm = linear_chain(2)
    ctx = b.ctx("joint")
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    tagged = [n for n in gm.graph.nodes if TAG in n.meta]
    assert tagged and all(n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE for n in tagged)
    transposes = gm.graph.find_nodes(op="call_function", target=aten.t.default)
    assert all(t.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE for t in transposes)
    matmuls = gm.graph.find_nodes(op="call_function", target=aten.addmm.default)
    assert not any("recompute" in m.meta for m in matmuls)  # compute is not a gathered parameter


def test_forward_graph_is_not_tagged_recompute():
    b, gm = linear_chain(2)
    insert_allgather(gm, b.ctx("forward"))
    assert not any("recompute" in n.meta for n in gm.graph.nodes)


def test_world_size_one_marker_becomes_its_shard():
    b, gm = linear_chain(2, world_size=1)
    result = insert_allgather(gm, b.ctx())
    assert result.modified and count(gm, UNSHARD) == 0 and not collectives(gm)
    for full in _full_values(gm):
        assert full.target is aten.view.default and full.args[0].op == "placeholder"


def test_mixed_precision_gathers_in_param_dtype():
    b, gm = linear_chain(2, param_dtype=torch.bfloat16)
    ctx = b.ctx()
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    gathers = collectives(gm, "all_gather")
    assert len(gathers) == 2
    assert all(g.meta["val"].dtype == torch.bfloat16 for g in gathers)  # cast before the wire: half the bytes
    assert all(f.meta["val"].dtype == torch.bfloat16 for f in _full_values(gm))


def test_uneven_rows_are_padded_to_chunk_rows():
    b = GraphBuilder([[(5, 4)]], world_size=2)  # 5 rows over 2 ranks: chunks of 3, rank 0 holds 3
    x = b.input("x", 2, 4)
    w = b.unshard(b.shard(0), 0)
    gm = b.output(b.op(aten.mm.default, x, b.op(aten.t.default, w)))
    insert_allgather(gm, b.ctx())
    (gather,) = collectives(gm)
    assert gather.meta["val"].numel() == 2 * 3 * 4  # N x chunk_rows x row
    (t,) = gm.graph.find_nodes(op="call_function", target=aten.t.default)
    assert tuple(t.args[0].meta["val"].shape) == (5, 4)  # padding dropped in the copy-out


def test_expected_graph_of_one_units_gather():
    """The exact replacement of a unit's two markers over 2 ranks: one flat copy-in of both
    shards (2 rows each), the all-gather, its wait, then ``unpack_gathered`` and a view per
    parameter, right before the unit's first use."""
    b, gm = linear_chain(1)
    ctx = b.ctx()
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    assert graph_text(gm) == """\
input x
input shard_0
input shard_1
view_default = aten.view(shard_0, [2, 4])
view_default_1 = aten.view(shard_1, [2])
pack_shards = zerograph.pack_shards([view_default, view_default_1], [2, 2], 1, torch.float32)
all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(pack_shards, 2, '0')
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor)
unpack_gathered = zerograph.unpack_gathered(wait_tensor, 2, [2, 2], [4, 4], [4, 1])
slice_1 = aten.slice(unpack_gathered, 0, 0, 16)
view = aten.view(slice_1, [4, 4])
slice_2 = aten.slice(unpack_gathered, 0, 16, 20)
view_1 = aten.view(slice_2, [4])
t_default = aten.t(view)
addmm_default = aten.addmm(view_1, x, t_default)
relu_default = aten.relu(addmm_default)
sum_default = aten.sum(relu_default)
return (sum_default,)"""
