"""``bucketing`` on hand-built forward and backward graphs: which markers share a collective."""
from tests.passes.graphs import backward_chain, collectives, graph_text, linear_chain
from zerograph.graph.ops import REDUCE_GRAD, UNSHARD
from zerograph.graph.vocab import TAG
from zerograph.passes.bucketing import assign_buckets, bucketing
from zerograph.passes.insert_allgather import insert_allgather
from zerograph.passes.insert_reduce_scatter import insert_reduce_scatter
from zerograph.policies import SchedulePolicy

UNIT_BYTES = (4 * 4 + 4) * 4  # a (4, 4) weight and a (4,) bias in fp32, full bytes


def _buckets(gm, marker) -> dict[int, set[int]]:
    """key -> bucket id of each marker."""
    found: dict[int, set[int]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=marker):
        found.setdefault(node.args[1], set()).add(node.meta[TAG]["bucket"])
    return found


def test_one_bucket_per_unit_and_graph_unchanged():
    b, gm = linear_chain(3)
    before = [(n.name, n.target, n.args) for n in gm.graph.nodes]
    result = bucketing(gm, b.ctx())
    assert result.modified and result.counts == {"buckets": 3, "units": 3}
    assert [(n.name, n.target, n.args) for n in gm.graph.nodes] == before
    bucket_of = _buckets(gm, UNSHARD)
    for unit in (1, 2, 3):
        assert len({bucket for key in b.keys_of(unit) for bucket in bucket_of[key]}) == 1
    assert len({next(iter(bucket_of[b.keys_of(u)[0]])) for u in (1, 2, 3)}) == 3


def test_cap_fuses_adjacent_units_never_splits_one():
    b, gm = linear_chain(3)
    bucketing(gm, b.ctx(schedule=SchedulePolicy(bucket_bytes=2 * UNIT_BYTES)))
    bucket_of = {key: ids.pop() for key, ids in _buckets(gm, UNSHARD).items()}
    assert bucket_of[b.keys_of(1)[0]] == bucket_of[b.keys_of(2)[0]] != bucket_of[b.keys_of(3)[0]]
    # a cap below one unit: each unit is still one bucket (never split)
    b, gm = linear_chain(3)
    bucketing(gm, b.ctx(schedule=SchedulePolicy(bucket_bytes=UNIT_BYTES // 2)))
    assert len({ids.pop() for ids in _buckets(gm, UNSHARD).values()}) == 3


def test_assign_buckets_walks_units_in_order():
    assert assign_buckets([5, 3, 7], {5: 10, 3: 10, 7: 10}, cap=0) == {5: 0, 3: 1, 7: 2}
    assert assign_buckets([5, 3, 7], {5: 10, 3: 10, 7: 10}, cap=20) == {5: 0, 3: 0, 7: 2}
    assert assign_buckets([5, 3, 7], {5: 30, 3: 10, 7: 10}, cap=20) == {5: 0, 3: 1, 7: 1}


def test_world_size_one_does_nothing():
    b, gm = linear_chain(2, world_size=1)
    assert not bucketing(gm, b.ctx()).modified
    assert not any(TAG in n.meta for n in gm.graph.nodes)


def test_backward_buckets_fuse_each_units_reductions():
    b, gm = backward_chain(3)
    ctx = b.ctx("backward")
    bucketing(gm, ctx)
    bucket_of = _buckets(gm, REDUCE_GRAD)
    assert all(len(bucket_of[k] | bucket_of[b.keys_of(u)[0]]) == 1 for u in (1, 2, 3) for k in b.keys_of(u))
    insert_reduce_scatter(gm, ctx)
    assert len(collectives(gm, "reduce_scatter")) == 3  # one per unit, not one per parameter (6)


def test_gathers_follow_the_buckets():
    b, gm = linear_chain(3)
    ctx = b.ctx(schedule=SchedulePolicy(bucket_bytes=3 * UNIT_BYTES))
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    (gather,) = collectives(gm, "all_gather")  # three units under one cap: one flat all-gather
    assert gather.meta[TAG]["units"] == [1, 2, 3]


def test_expected_buckets_under_a_two_unit_cap():
    """Every marker in graph order with its bucket: units 1 and 2 fill the cap (bucket 0, the
    index of its first unit), unit 3 opens bucket 2; no node is added, removed or moved."""
    b, gm = linear_chain(3)
    before = graph_text(gm)
    bucketing(gm, b.ctx(schedule=SchedulePolicy(bucket_bytes=2 * UNIT_BYTES)))
    assert graph_text(gm) == before
    tagged = [(n.name, n.args[1], n.meta[TAG]["bucket"]) for n in gm.graph.find_nodes(op="call_function", target=UNSHARD)]
    assert tagged == [("unshard_default", 0, 0), ("unshard_default_1", 1, 0), ("unshard_default_2", 2, 0),
                      ("unshard_default_3", 3, 0), ("unshard_default_4", 4, 2), ("unshard_default_5", 5, 2)]
