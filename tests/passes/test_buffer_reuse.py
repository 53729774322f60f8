"""``buffer_reuse`` on hand-built graphs: comm buffers whose lifetimes do not intersect share a
pool slot; at stage 3 with ``prefetch_depth = d`` the gathered slots number at most ``d + 1``."""
import pytest
import torch

from tests.passes.graphs import aten, collectives, count, gathered_forward, linear_chain
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG
from zerograph.passes.bucketing import bucketing
from zerograph.passes.buffer_reuse import PooledBuffer, assign_slots, buffer_reuse, plan_buffers
from zerograph.passes.insert_allgather import insert_allgather
from zerograph.passes.liveness import storage_root
from zerograph.passes.manager import check_collectives_waited
from zerograph.passes.prefetch import prefetch
from zerograph.passes.schedule_overlap import schedule_overlap
from zerograph.policies import SchedulePolicy
from zerograph.runtime.buffer_pool import POOL_BUFFER

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
