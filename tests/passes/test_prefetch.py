"""``prefetch`` on a hand-built forward graph: each gather's start moves ``prefetch_depth``
gathers earlier (within the byte budget), its wait and copy-out stay, and the collectives keep
their order."""
from torch.testing import FileCheck

from tests.passes.graphs import aten, collectives, gathered_forward, gathers, graph_text, positions
from zerograph.passes.prefetch import is_free_view, prefetch, prefetch_distance
from zerograph.policies import SchedulePolicy

GATHER_BYTES = 2 * (2 * 4 + 2) * 4  # one unit's gathered buffer: N x (weight + bias shard) fp32


def _not_issued(gm) -> list[str]:
    """The graph's order with every gather's copy-in and start left out, and the shards' views
    (free to hoist): what prefetch must not move."""
    moved = {n for g in gathers(gm) for n in g.issue}
    return [n.name for n in gm.graph.nodes if n not in moved and not is_free_view(n)]


def _start_after(gm) -> list[str]:
    """For each gather in order, the name of the node right before its copy-in."""
    return [g.issue[0].prev.name for g in gathers(gm)]


def _copy_outs(gm) -> list[str]:
    return [g.finish[1].name for g in gathers(gm)]  # unpack_gathered, right after each wait


def test_depth_one_starts_each_gather_after_the_previous_copy_out():
    b, gm, ctx = gathered_forward(4, schedule=SchedulePolicy(prefetch_depth=1))
    kept = _not_issued(gm)
    result = prefetch(gm, ctx)
    assert result.counts == {"prefetched": 4, "gathers": 4}
    assert _not_issued(gm) == kept  # waits, copy-outs and compute did not move
    copy_outs = _copy_outs(gm)
    assert _start_after(gm)[1:] == copy_outs[:-1]  # gather i starts right after gather i-1's copy-out
    pos = positions(gm)
    first_matmul = min(pos[n] for n in gm.graph.find_nodes(op="call_function", target=aten.addmm.default))
    assert pos[gathers(gm)[0].start] < first_matmul and pos[gathers(gm)[1].start] < first_matmul


def test_depth_two_starts_two_gathers_ahead():
    b, gm, ctx = gathered_forward(4, schedule=SchedulePolicy(prefetch_depth=2))
    prefetch(gm, ctx)
    assert _start_after(gm)[2:] == _copy_outs(gm)[:-2]


def test_depth_zero_moves_nothing():
    b, gm, ctx = gathered_forward(3, schedule=SchedulePolicy(prefetch_depth=0))
    before = [n.name for n in gm.graph.nodes]
    result = prefetch(gm, ctx)
    assert not result.modified and [n.name for n in gm.graph.nodes] == before


def test_byte_budget_shrinks_the_distance():
    # room for two gathered units in flight: depth 3 acts as depth 1
    b, gm, ctx = gathered_forward(4, schedule=SchedulePolicy(prefetch_depth=3, max_inflight_bytes=2 * GATHER_BYTES))
    prefetch(gm, ctx)
    assert _start_after(gm)[2:] == _copy_outs(gm)[1:-1]
    # room for one: no gather starts before the previous one's wait
    b, gm, ctx = gathered_forward(3, schedule=SchedulePolicy(prefetch_depth=1, max_inflight_bytes=GATHER_BYTES))
    prefetch(gm, ctx)
    pos = positions(gm)
    found = gathers(gm)
    assert all(pos[found[i - 1].wait] < pos[found[i].start] for i in range(1, len(found)))


def test_collectives_keep_their_order():
    b, gm, ctx = gathered_forward(4, schedule=SchedulePolicy(prefetch_depth=2))
    before = [c.name for c in collectives(gm)]
    prefetch(gm, ctx)
    assert [c.name for c in collectives(gm)] == before  # every rank issues them in one order


def test_prefetch_distance_within_depth_and_budget():
    b, gm, ctx = gathered_forward(4)
    found = gathers(gm)
    assert prefetch_distance(found, 3, depth=2, max_inflight_bytes=None) == 2
    assert prefetch_distance(found, 1, depth=2, max_inflight_bytes=None) == 1  # nothing further back
    assert prefetch_distance(found, 3, depth=2, max_inflight_bytes=2 * GATHER_BYTES) == 1
    assert prefetch_distance(found, 3, depth=2, max_inflight_bytes=GATHER_BYTES) == 0


def test_expected_order_at_depth_one():
    """The first gather starts at the top, before any compute; gather ``i + 1``'s copy-in and
    start follow gather ``i``'s copy-out at once, ahead of unit ``i``'s compute; waits stay."""
    b, gm, ctx = gathered_forward(3)
    prefetch(gm, ctx)
    (FileCheck().check_not("aten.addmm").check("all_gather_into_tensor = ")
     .check("wait_tensor = ").check_next("unpack_gathered = ").check_next("pack_shards_1 = ")
     .check_next("all_gather_into_tensor_1 = ").check("addmm_default = ")
     .check("wait_tensor_1 = ").check_next("unpack_gathered_1 = ").check_next("pack_shards_2 = ")
     .check_next("all_gather_into_tensor_2 = ").check("addmm_default_1 = ")
     .check("wait_tensor_2 = ").check_next("unpack_gathered_2 = ").check("addmm_default_2 = ")
     .run(graph_text(gm, args=False)))
