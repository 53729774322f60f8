"""``schedule_overlap`` on hand-built graphs: gather waits sink to their first use, reduction
waits sink as far as the in-flight bound allows; starts stay put, every wait precedes its uses."""
from torch.testing import FileCheck

from tests.passes.graphs import (
    aten,
    collectives,
    gathered_forward,
    gathers,
    graph_text,
    linear_chain,
    positions,
    reduced_backward,
)
from zerograph.graph.vocab import COLLECTIVE_KINDS, WAIT
from zerograph.passes.manager import check_collectives_waited
from zerograph.passes.prefetch import prefetch
from zerograph.passes.schedule_overlap import schedule_overlap
from zerograph.policies import SchedulePolicy

REDUCE_BYTES = 2 * (2 * 4 + 2) * 4  # one unit's reduce-scatter send buffer: N x (weight + bias chunk) fp32


def _starts(gm) -> list[str]:
    return [c.name for c in collectives(gm)]


def test_gather_wait_sinks_to_first_use():
    b, gm, ctx = gathered_forward(3)
    prefetch(gm, ctx)
    starts = _starts(gm)
    schedule_overlap(gm, ctx)
    check_collectives_waited(gm.graph)
    assert _starts(gm) == starts
    pos = positions(gm)
    for i, gather in enumerate(gathers(gm)):
        finish = set(gather.finish)
        after = max(gather.finish, key=pos.__getitem__).next  # the first node after the copy-out
        assert any(inp in finish for inp in after.all_input_nodes), (gather.wait.name, after.name)
        between = [n for n in gm.graph.nodes if pos[gather.start] < pos[n] < pos[gather.wait]]
        if i:  # prefetched: compute runs while it is in flight
            assert any(n.target is aten.addmm.default for n in between)


def test_reduction_waits_keep_one_in_flight_at_depth_one():
    b, gm, ctx = reduced_backward(3, schedule=SchedulePolicy(prefetch_depth=1))
    assert schedule_overlap(gm, ctx).modified
    check_collectives_waited(gm.graph)
    inflight, most = 0, 0
    for node in gm.graph.nodes:
        if node.target in COLLECTIVE_KINDS:
            inflight += 1
            most = max(most, inflight)
        elif node.target is WAIT:
            inflight -= 1
    assert most == 1  # reduction j runs during the next unit's compute, waited before j + 1 is issued
    pos = positions(gm)
    reductions = collectives(gm)
    for j in range(len(reductions) - 1):
        (wait,) = reductions[j].users
        assert pos[wait] < pos[reductions[j + 1]]
        assert any(n.target is aten.mul.Tensor for n in gm.graph.nodes if pos[reductions[j]] < pos[n] < pos[wait])


def test_last_reduction_waits_at_the_end():
    b, gm, ctx = reduced_backward(3)
    schedule_overlap(gm, ctx)
    (wait,) = collectives(gm)[-1].users
    pos = positions(gm)
    later = [n for n in gm.graph.nodes if pos[n] > pos[wait]]
    assert not any(n.target in (aten.mm.default, aten.mul.Tensor) for n in later)  # no compute left to hide behind


def test_byte_bound_waits_each_reduction_before_the_next():
    b, gm, ctx = reduced_backward(3, schedule=SchedulePolicy(prefetch_depth=2, max_inflight_bytes=REDUCE_BYTES))
    schedule_overlap(gm, ctx)
    pos = positions(gm)
    reductions = collectives(gm)
    assert all(pos[next(iter(reductions[j].users))] < pos[reductions[j + 1]] for j in range(len(reductions) - 1))


def test_deeper_bound_leaves_two_reductions_running():
    b, gm, ctx = reduced_backward(3, schedule=SchedulePolicy(prefetch_depth=2))
    schedule_overlap(gm, ctx)
    pos = positions(gm)
    first, second, third = collectives(gm)
    assert pos[second] < pos[next(iter(first.users))] < pos[third]


def test_no_collectives_is_unchanged():
    b, gm = linear_chain(2)  # markers not expanded: nothing to schedule
    assert not schedule_overlap(gm, b.ctx()).modified


def test_expected_order_of_prefetched_forward():
    """After ``prefetch``: each later gather's wait and copy-out sink below the previous unit's
    compute, to just before the transpose that first reads the gathered weight."""
    b, gm, ctx = gathered_forward(2)
    prefetch(gm, ctx)
    schedule_overlap(gm, ctx)
    (FileCheck().check("all_gather_into_tensor_1 = ").check("addmm_default = ").check_next("relu_default = ")
     .check_next("wait_tensor_1 = ").check_next("unpack_gathered_1 = ").check_next("slice_3 = aten.slice")
     .check_next("view_2 = aten.view").check_next("t_default_1 = aten.t").check("addmm_default_1 = ")
     .run(graph_text(gm, args=False)))


def test_expected_order_of_backward_at_depth_one():
    """Reduction ``j`` is issued after its unit's gradients, runs during the next unit's
    backward compute, and is waited, divided and copied out before reduction ``j + 1``."""
    b, gm, ctx = reduced_backward(3, schedule=SchedulePolicy(prefetch_depth=1))
    schedule_overlap(gm, ctx)
    (FileCheck().check("reduce_scatter_tensor = ").check_next("mul_tensor_1 = aten.mul").check("sum_dim_int_list_1 = ")
     .check_next("wait_tensor = ").check_next("div = ").check("clone = ").check_next("pack_shards_1 = ")
     .check_next("reduce_scatter_tensor_1 = ").check_next("mul_tensor_2 = aten.mul").check("sum_dim_int_list_2 = ")
     .check_next("wait_tensor_1 = ").check("clone_2 = ").check_next("pack_shards_2 = ")
     .check_next("reduce_scatter_tensor_2 = ").check_next("wait_tensor_2 = ").check("return")
     .run(graph_text(gm, args=False)))
