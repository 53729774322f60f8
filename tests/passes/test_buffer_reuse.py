"""``buffer_reuse`` on hand-built graphs: comm buffers whose lifetimes do not intersect share a
pool slot; at stage 3 with ``prefetch_depth = d`` the gathered slots number at most ``d + 1``."""
import pytest
import torch

from tests.passes.graphs import aten, collectives, count, gathered_forward, graph_text, linear_chain, run_pass
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG
from zerograph.kernels.ops import PACK_SHARDS
from zerograph.passes.bucketing import bucketing
from zerograph.passes.buffer_reuse import PooledBuffer, assign_slots, buffer_reuse, plan_buffers
from zerograph.passes.insert_allgather import insert_allgather
from zerograph.passes.liveness import storage_root
from zerograph.passes.manager import check_collectives_waited
from zerograph.passes.prefetch import prefetch
from zerograph.passes.schedule_overlap import schedule_overlap
from zerograph.policies import SchedulePolicy
from zerograph.runtime.buffer_pool import PACK_SHARDS_OUT, POOL_BUFFER

ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


def _scheduled(units: int, depth: int):
    b, gm, ctx = gathered_forward(units, schedule=SchedulePolicy(prefetch_depth=depth), buffer_pool=0)
    prefetch(gm, ctx)
    schedule_overlap(gm, ctx)
    return b, gm, ctx


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_gathered_slots_at_most_depth_plus_one(depth):
    b, gm, ctx = _scheduled(5, depth)
    plan = plan_buffers(gm.graph)
    gathered = {p.slot for p in plan if p.role == "gathered"}
    assert len([p for p in plan if p.role == "gathered"]) == 5  # every unit's gathered buffer is pooled
    assert len(gathered) <= depth + 1


def test_intersecting_lifetimes_get_different_slots():
    b, gm, ctx = _scheduled(4, 1)
    plan = plan_buffers(gm.graph)
    for i, a in enumerate(plan):
        for c in plan[i + 1:]:
            if a.role == c.role and a.first <= c.last and c.first <= a.last:
                assert a.slot != c.slot, (a, c)


def test_rewrite_gathers_into_pool_buffers():
    b, gm, ctx = _scheduled(3, 1)
    result = buffer_reuse(gm, ctx)
    assert result.modified and result.counts["pooled"] == 6  # per unit: its gathered and its send buffer
    check_collectives_waited(gm.graph)
    gathers = collectives(gm, "all_gather")
    assert len(gathers) == 3 and all(g.target is ALL_GATHER_OUT for g in gathers)
    assert all(g.kwargs["out"].target is POOL_BUFFER for g in gathers)
    assert count(gm, POOL_BUFFER) == 6
    assert all(n.args[0] == 0 for n in gm.graph.find_nodes(op="call_function", target=POOL_BUFFER))  # ctx.buffer_pool


def test_root_units_buffers_stay_transient():
    b, gm = linear_chain(2, root=True)
    ctx = b.ctx(buffer_pool=0)
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    plan = plan_buffers(gm.graph)
    root_gather = [c for c in collectives(gm) if c.meta[TAG]["units"] == [0]]
    assert root_gather and root_gather[0].name not in {p.node for p in plan}
    assert len([p for p in plan if p.role == "gathered"]) == 2  # the two blocks only


def test_buffer_that_escapes_the_graph_is_not_pooled():
    b, gm = linear_chain(2)
    insert_allgather(gm, b.ctx(buffer_pool=0))  # one gather per parameter: the weight is a view of its buffer
    # stage 1-2 style: the first unit's gathered weight is saved for backward (a graph output)
    t = gm.graph.find_nodes(op="call_function", target=aten.t.default)[0]
    output = gm.graph.output_node()
    output.args = ((*output.args[0], t.args[0]),)
    pooled = {p.node for p in plan_buffers(gm.graph) if p.role == "gathered"}
    saved = storage_root(t.args[0])
    while saved.target not in COLLECTIVE_KINDS:
        saved = saved.args[0]
    assert len(pooled) == 3 and saved.name not in pooled


def test_copied_out_buffer_is_pooled_though_its_views_escape():
    b, gm, ctx = gathered_forward(2, buffer_pool=0)
    # a bucket's copy-out is a new buffer: a saved parameter keeps that one, not the gathered one
    t = gm.graph.find_nodes(op="call_function", target=aten.t.default)[0]
    output = gm.graph.output_node()
    output.args = ((*output.args[0], t.args[0]),)
    assert len([p for p in plan_buffers(gm.graph) if p.role == "gathered"]) == 2


def test_no_pool_or_one_rank_does_nothing():
    b, gm, ctx = gathered_forward(2)
    assert not buffer_reuse(gm, ctx).modified  # ctx.buffer_pool is None
    b, gm = linear_chain(2, world_size=1)
    assert not buffer_reuse(gm, b.ctx(buffer_pool=0)).modified


def test_assign_slots_colours_by_start():
    found = [PooledBuffer("a", "gathered", 10, 0, 5), PooledBuffer("b", "gathered", 20, 3, 8),
             PooledBuffer("c", "gathered", 30, 6, 9), PooledBuffer("d", "send", 5, 0, 9)]
    slots = {p.node: p.slot for p in assign_slots(found)}
    assert slots["a"] != slots["b"] and slots["b"] != slots["c"]
    assert slots["a"] == slots["c"]  # a ends before c starts: one slot, reused
    assert slots["d"] == 0  # another role: its own numbering


def test_expected_graph_of_two_units_sharing_their_slots():
    """Two units gathered just in time (no prefetch): each unit's send buffer is a ``pool_buffer``
    that ``pack_shards_out`` writes and the all-gather reads, and its gathered buffer the
    ``out=`` of ``all_gather_into_tensor_out``. Unit 1's buffers are dead (copied out) before
    unit 2's are taken, so both units take slot 0 of each role. Every other node keeps its
    place and its arguments."""
    b, gm, ctx = gathered_forward(2, buffer_pool=0)
    others_before = [n.name for n in gm.graph.nodes if n.target not in (ALL_GATHER, PACK_SHARDS)]
    result = run_pass(buffer_reuse, gm, ctx)
    assert result.counts == {"pooled": 4, "slots": 2, "slot_bytes": (10 + 20) * 4}
    assert graph_text(gm) == """\
input x
input shard_0
input shard_1
input shard_2
input shard_3
view_default = aten.view(shard_0, [2, 4])
view_default_1 = aten.view(shard_1, [2])
view_default_2 = aten.view(shard_2, [2, 4])
view_default_3 = aten.view(shard_3, [2])
pool_buffer_default = zerograph.pool_buffer(0, 'send', 0, 10, torch.float32, device(type='cpu'))
pack_shards_out_default = zerograph.pack_shards_out([view_default, view_default_1], [2, 2], 1, out=pool_buffer_default)
pool_buffer_default_1 = zerograph.pool_buffer(0, 'gathered', 0, 20, torch.float32, device(type='cpu'))
all_gather_into_tensor_out_default = _c10d_functional.all_gather_into_tensor_out(pool_buffer_default, 2, '0', out=pool_buffer_default_1)
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default)
unpack_gathered = zerograph.unpack_gathered(wait_tensor, 2, [2, 2], [4, 4], [4, 1])
slice_1 = aten.slice(unpack_gathered, 0, 0, 16)
view = aten.view(slice_1, [4, 4])
slice_2 = aten.slice(unpack_gathered, 0, 16, 20)
view_1 = aten.view(slice_2, [4])
t_default = aten.t(view)
addmm_default = aten.addmm(view_1, x, t_default)
relu_default = aten.relu(addmm_default)
pool_buffer_default_2 = zerograph.pool_buffer(0, 'send', 0, 10, torch.float32, device(type='cpu'))
pack_shards_out_default_1 = zerograph.pack_shards_out([view_default_2, view_default_3], [2, 2], 1, out=pool_buffer_default_2)
pool_buffer_default_3 = zerograph.pool_buffer(0, 'gathered', 0, 20, torch.float32, device(type='cpu'))
all_gather_into_tensor_out_default_1 = _c10d_functional.all_gather_into_tensor_out(pool_buffer_default_2, 2, '0', out=pool_buffer_default_3)
wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_out_default_1)
unpack_gathered_1 = zerograph.unpack_gathered(wait_tensor_1, 2, [2, 2], [4, 4], [4, 1])
slice_3 = aten.slice(unpack_gathered_1, 0, 0, 16)
view_2 = aten.view(slice_3, [4, 4])
slice_4 = aten.slice(unpack_gathered_1, 0, 16, 20)
view_3 = aten.view(slice_4, [4])
t_default_1 = aten.t(view_2)
addmm_default_1 = aten.addmm(view_3, relu_default, t_default_1)
relu_default_1 = aten.relu(addmm_default_1)
sum_default = aten.sum(relu_default_1)
return (sum_default,)"""  # noqa: E501 (the graph's own lines)
    # the docstring's invariant: the graph's order stays the same (the pass only swaps allocations)
    assert [n.name for n in gm.graph.nodes if n.target not in (POOL_BUFFER, PACK_SHARDS_OUT, ALL_GATHER_OUT)] \
        == others_before
