"""``insert_reduce_scatter`` on hand-built backward graphs: every trainable gradient reduced
exactly once, where the stage says, averaged over the ranks."""
import torch
from torch.testing import FileCheck

from tests.passes.graphs import GraphBuilder, aten, backward_chain, collectives, count, graph_text, positions
from zerograph.graph.ops import REDUCE_GRAD
from zerograph.graph.vocab import WAIT
from zerograph.kernels.ops import PACK_SHARDS
from zerograph.passes.bucketing import bucketing
from zerograph.passes.insert_reduce_scatter import insert_reduce_scatter
from zerograph.passes.manager import check_collectives_waited


def _reduced_grads(gm) -> dict[str, int]:
    """Full gradient name -> number of collectives whose copy-in reads it."""
    seen: dict[str, int] = {}
    for collective in collectives(gm):
        frontier, chain = [collective.args[0]], set()
        while frontier:  # walk the copy-in back to the full gradients (mm / sum nodes)
            node = frontier.pop()
            if node in chain:
                continue
            chain.add(node)
            if node.target in (aten.mm.default, aten.t.default, aten.sum.dim_IntList):
                name = node.name if node.target is not aten.t.default else node.args[0].name
                seen[name] = seen.get(name, 0) + 1
                continue
            frontier.extend(node.all_input_nodes)
    return seen


def _full_grads(b, gm):
    return [n.args[0] for n in gm.graph.find_nodes(op="call_function", target=REDUCE_GRAD)]


def test_every_gradient_reduced_exactly_once():
    b, gm = backward_chain(3)
    grads = {n.name for n in _full_grads(b, gm)}
    ctx = b.ctx("backward")
    bucketing(gm, ctx)
    result = insert_reduce_scatter(gm, ctx)
    assert result.counts == {"reduce_scatter": 3}
    assert count(gm, REDUCE_GRAD) == 0
    check_collectives_waited(gm.graph)
    assert _reduced_grads(gm) == dict.fromkeys(grads, 1)
    assert all(c.args[0].target is PACK_SHARDS for c in collectives(gm))


def test_without_bucketing_one_reduction_per_parameter():
    b, gm = backward_chain(2)
    insert_reduce_scatter(gm, b.ctx("backward"))
    assert len(collectives(gm, "reduce_scatter")) == 4 and count(gm, PACK_SHARDS) == 0


def test_outputs_are_shards_averaged_over_ranks():
    b, gm = backward_chain(2)
    ctx = b.ctx("backward")
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    outputs = gm.graph.output_node().args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs] == [b.layouts[k].local_shape(0) for k in sorted(b.layouts)]
    for wait in gm.graph.find_nodes(op="call_function", target=WAIT):
        (div,) = wait.users
        assert div.target is aten.div.Tensor and div.args[1] == 2  # the mean over N = 2 ranks


def test_stage0_all_reduces_whole_gradients():
    b, gm = backward_chain(2, stage=0)
    ctx = b.ctx("backward", stage=0)
    bucketing(gm, ctx)
    assert insert_reduce_scatter(gm, ctx).counts == {"all_reduce": 2}
    assert len(collectives(gm, "all_reduce")) == 2 and not collectives(gm, "reduce_scatter")


def test_stage2_reduces_right_after_the_units_last_gradient():
    b, gm = backward_chain(3)
    ctx = b.ctx("backward", stage=2)
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    pos = positions(gm)
    compute = [pos[n] for n in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)]  # one per unit
    starts = [pos[c] for c in collectives(gm)]
    assert len(starts) == 3
    for unit in range(2):  # the unit's reduction is issued before the next unit's backward compute
        assert compute[unit] < starts[unit] < compute[unit + 1]


def test_stage1_reduces_at_the_end_of_backward():
    b, gm = backward_chain(3)
    ctx = b.ctx("backward", stage=1)
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    pos = positions(gm)
    last_compute = max(pos[n] for n in gm.graph.nodes if n.target in (aten.mm.default, aten.sum.dim_IntList))
    assert len(collectives(gm)) == 3 and all(pos[c] > last_compute for c in collectives(gm))


def test_tied_gradients_are_summed_then_reduced_once():
    b = GraphBuilder([[(4, 4)]])
    g1, g2 = b.input("g1", 4, 4), b.input("g2", 4, 4)
    first, second = b.reduce_grad(g1, 0), b.reduce_grad(g2, 0)  # one parameter read twice in forward
    gm = b.output(first, second)
    insert_reduce_scatter(gm, b.ctx("backward"))
    (collective,) = collectives(gm)
    assert count(gm, aten.add.Tensor) == 1  # the two full gradients summed before the reduction
    assert count(gm, aten.zeros_like.default) == 1  # the second marker's share is already in the first


def test_world_size_one_marker_becomes_its_gradient():
    b, gm = backward_chain(2, world_size=1)
    grads = _full_grads(b, gm)
    insert_reduce_scatter(gm, b.ctx("backward"))
    assert not collectives(gm) and count(gm, REDUCE_GRAD) == 0
    assert list(gm.graph.output_node().args[0]) == [grads[i] for i in (2, 3, 0, 1)]  # keys 0..3, unit 2 first


def test_mixed_precision_reduces_in_reduce_dtype():
    b = GraphBuilder([[(4, 4)]], param_dtype=torch.bfloat16)
    grad = b.input("g", 4, 4, dtype=torch.bfloat16)
    gm = b.output(b.reduce_grad(grad, 0))
    insert_reduce_scatter(gm, b.ctx("backward"))
    (collective,) = collectives(gm)
    assert collective.args[0].meta["val"].dtype == torch.bfloat16  # reduce_dtype defaults to param_dtype
    (out,) = gm.graph.output_node().args[0]
    assert out.meta["val"].dtype == torch.float32  # .grad in the master shard's dtype


def test_a_bucket_of_twice_used_parameters_reduces_each_ones_own_sum():
    """Two parameters of one shape, each read twice (a block called twice): each key's two
    gradients are summed (one spliced template, whose copies share a fake value) and the bucket's
    copy-in packs each key's own sum. It once packed the first sum twice (``splice`` traced the
    two shared values as one input), and every later bucket of that template did too."""
    b = GraphBuilder([[(4, 4), (4, 4)]], stage=0)
    act = b.input("act", 4, 4)
    first_key, second_key = b.keys_of(1)
    grads = {key: [b.op(aten.mm.default, act, b.input(f"g{key}_{i}", 4, 4)) for i in range(2)]
             for key in (first_key, second_key)}
    outs = [b.reduce_grad(grad, key) for key in (first_key, second_key) for grad in grads[key]]
    gm = b.output(*outs)
    ctx = b.ctx("backward", stage=0)
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    (pack,) = gm.graph.find_nodes(op="call_function", target=PACK_SHARDS)

    def summed(node):  # the gradients a packed input sums: the mm nodes behind its views and adds
        if node.target is aten.mm.default:
            return {node}
        return set().union(*(summed(n) for n in node.all_input_nodes))

    assert [summed(part) for part in pack.args[0]] == [set(grads[first_key]), set(grads[second_key])]


def test_expected_graph_of_one_units_reduction():
    """The exact replacement at stage 3 for a unit of a (4, 4) weight and a (4,) bias over 2
    ranks: one flat copy-in of both gradients (2 rows per rank each), one reduce-scatter, the
    wait, the division by N, then each shard's rows cut out of the reduced buffer."""
    b, gm = backward_chain(1)
    ctx = b.ctx("backward")
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    assert graph_text(gm) == """\
input act
input tangent
mul_tensor = aten.mul(tangent, act)
t_default = aten.t(mul_tensor)
mm_default = aten.mm(t_default, act)
sum_dim_int_list = aten.sum(mul_tensor, [0])
pack_shards = zerograph.pack_shards([mm_default, sum_dim_int_list], [2, 2], 2, torch.float32)
reduce_scatter_tensor = _c10d_functional.reduce_scatter_tensor(pack_shards, 'sum', 2, '0')
wait_tensor = _c10d_functional.wait_tensor(reduce_scatter_tensor)
div = aten.div(wait_tensor, 2)
slice_1 = aten.slice(div, 0, 0, 8)
view = aten.view(slice_1, [-1, 4])
slice_2 = aten.slice(view, 0, 0, 2)
clone = aten.clone(slice_2)
slice_3 = aten.slice(div, 0, 8, 10)
view_1 = aten.view(slice_3, [-1])
slice_4 = aten.slice(view_1, 0, 0, 2)
clone_1 = aten.clone(slice_4)
return (clone, clone_1)"""


def test_expected_graph_stage1_reduces_after_all_compute():
    """Stage 1 keeps full gradients to the end of backward: both units' compute, then both
    reductions (last unit's first, as backward produced them)."""
    b, gm = backward_chain(2, stage=1)
    ctx = b.ctx("backward", stage=1)
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    (FileCheck().check("mul_tensor = aten.mul").check("mul_tensor_1 = aten.mul").check("sum_dim_int_list_1 = aten.sum")
     .check_not("aten.mul").check("pack_shards([mm_default, sum_dim_int_list]")
     .check("reduce_scatter_tensor(pack_shards,").check("pack_shards([mm_default_1, sum_dim_int_list_1]")
     .check("reduce_scatter_tensor(pack_shards_1,").check_not("aten.mm").check("return").run(graph_text(gm)))
