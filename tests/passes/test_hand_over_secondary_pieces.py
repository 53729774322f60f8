"""``hand_over_secondary_pieces`` (hpZ's second half, ZeRO++ section 3.2) on a hand-built
partitioned pair: a unit under an activation checkpoint whose backward recomputed its N-rank
all-gather gets a node-group all-gather of a piece the forward saves instead."""
import dataclasses

from tests.passes.graphs import GraphBuilder, aten, collectives, graph_text, run_pass
from zerograph.graph.ops import GATHER_ACTIVATION, SHARD_ACTIVATION
from zerograph.graph.vocab import TAG
from zerograph.passes.context import PartitionedGraphs
from zerograph.passes.hand_over_secondary_pieces import hand_over_secondary_pieces
from zerograph.passes.insert_allgather import insert_allgather

NODE = ("node", 2)  # the secondary group: 2 ranks of a world of 4


def _half(backward: bool) -> tuple[GraphBuilder, object]:
    """One graph of the pair: a checkpointed unit ``relu(x @ unshard(w).t())`` (``w`` (4, 4),
    over 4 ranks), its gather expanded. The forward returns ``sum`` and saves ``x`` and the shard;
    the backward reads them (with the names the partitioner keeps), recomputes the gather and the
    unit's forward, and reduces the weight's gradient."""
    b = GraphBuilder([[(4, 4)]], world_size=4)
    x = b.input("x", 2, 4)
    shard = b.input("shard_0", 1, 4)
    tangent = b.input("tangents_1", 2, 4) if backward else None
    weight = b.unshard(b.op(aten.view.default, shard, [1, 4]), 0)
    hidden = b.op(aten.relu.default, b.op(aten.mm.default, x, b.op(aten.t.default, weight)))
    if not backward:
        gm = b.output(b.op(aten.sum.default, hidden), x, shard)
    else:
        g_pre = b.op(aten.threshold_backward.default, tangent, hidden, 0)
        gm = b.output(b.reduce_grad(b.op(aten.mm.default, b.op(aten.t.default, g_pre), x), 0))
    insert_allgather(gm, b.ctx("backward" if backward else "forward"))
    return b, gm


def _recomputed_pair(**knobs):
    b, fwd = _half(backward=False)
    _, bwd = _half(backward=True)
    return PartitionedGraphs(fwd, bwd, num_fwd_outputs=1), b.ctx("partitioned", **knobs)


def test_expected_pair_after_the_hand_over():
    """The forward cuts this rank's half of its gathered weight right after the wait
    (``shard_activation`` over the node group) and saves it first; the backward all-gathers that
    piece over the node group where it re-gathered over all 4 ranks, and its compute reads the
    result through the same views. The N-rank chain is gone from the backward."""
    pair, ctx = _recomputed_pair(secondary_group=NODE)
    result = run_pass(hand_over_secondary_pieces, pair, ctx)
    assert result.modified and result.counts == {"secondary_pieces_handed_over": 1}
    assert graph_text(pair.forward) == """\
input x
input shard_0
view_default = aten.view(shard_0, [1, 4])
view = aten.view(view_default, [-1])
all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(view, 4, '0')
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor)
shard_activation_default = zerograph.shard_activation(wait_tensor, 'node', 2)
view_1 = aten.view(wait_tensor, [4, -1])
alias = aten.alias(view_1)
view_2 = aten.view(alias, [4, 4])
slice_1 = aten.slice(view_2, 0, 0, 4)
t_default = aten.t(slice_1)
mm_default = aten.mm(x, t_default)
relu_default = aten.relu(mm_default)
sum_default = aten.sum(relu_default)
return [sum_default, shard_activation_default, x, shard_0]"""
    assert graph_text(pair.backward) == """\
input shard_activation_default_saved
input x
input shard_0
input tangents_1
gather_activation_default = zerograph.gather_activation(shard_activation_default_saved, [16], 'node', 2)
view_1 = aten.view(gather_activation_default, [4, -1])
alias = aten.alias(view_1)
view_2 = aten.view(alias, [4, 4])
slice_1 = aten.slice(view_2, 0, 0, 4)
t_default = aten.t(slice_1)
mm_default = aten.mm(x, t_default)
relu_default = aten.relu(mm_default)
threshold_backward_default = aten.threshold_backward(tangents_1, relu_default, 0)
t_default_1 = aten.t(threshold_backward_default)
mm_default_1 = aten.mm(t_default_1, x)
reduce_grad_default = zerograph.reduce_grad(mm_default_1, 0)
return (reduce_grad_default,)"""
    # the docstring's invariant: backward holds no all-gather over the N ranks; the piece is tagged
    assert not collectives(pair.backward)
    (piece,) = pair.forward.graph.find_nodes(op="call_function", target=SHARD_ACTIVATION)
    (gather,) = pair.backward.graph.find_nodes(op="call_function", target=GATHER_ACTIVATION)
    assert piece.meta[TAG] == {"role": "secondary_shard"} and gather.meta[TAG] == {"role": "secondary_gather"}


def test_nothing_to_do_without_a_group_or_a_recomputed_gather():
    pair, ctx = _recomputed_pair()
    before = graph_text(pair.forward), graph_text(pair.backward)
    assert not run_pass(hand_over_secondary_pieces, pair, ctx).modified  # no secondary group: plain stage 3
    assert (graph_text(pair.forward), graph_text(pair.backward)) == before
    b, fwd = _half(backward=False)
    saved = GraphBuilder([[(4, 4)]], world_size=4)  # a backward that reads saved values only, gathers nothing
    x, _, tangent = saved.input("x", 2, 4), saved.input("shard_0", 1, 4), saved.input("tangents_1", 2, 4)
    bwd = saved.output(saved.op(aten.mm.default, saved.op(aten.t.default, tangent), x))
    pair = PartitionedGraphs(fwd, bwd, num_fwd_outputs=1)
    assert not run_pass(hand_over_secondary_pieces, pair, dataclasses.replace(ctx, secondary_group=NODE)).modified
