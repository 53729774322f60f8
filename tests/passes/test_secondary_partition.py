"""``secondary_partition`` (hpZ, ZeRO++) on a hand-built stage-3 joint graph of MLP blocks
(``joint_mlp``): each gather that backward would re-run keeps this rank's 1/M of the gathered
buffer from forward (over the node group ``secondary_group``), and backward all-gathers it over
that group instead of reading the forward's gathered parameters; kept gathers and graphs without
a secondary group are left alone."""
import dataclasses

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from tests.passes.graphs import aten, collectives, count, gathered_joint, gathers, graph_text, recompute_note, run_pass
from zerograph.graph.ops import GATHER_ACTIVATION, SHARD_ACTIVATION
from zerograph.graph.vocab import TAG, WAIT
from zerograph.passes._fx import is_alias_of_input
from zerograph.passes.activation_partition import backward_nodes
from zerograph.passes.liveness import storage_root
from zerograph.passes.secondary_partition import secondary_partition
from zerograph.passes.selective_unshard import selective_unshard
from zerograph.policies import MemoryPolicy

NODE = ("node", 2)  # the secondary group: 2 ranks of a world of 4


def _hpz(units: int = 3, *, world_size: int = 4, group=NODE, bucketed: bool = True):
    return gathered_joint(units, world_size=world_size, bucketed=bucketed, secondary_group=group)


def _chain(collective) -> list:
    """A gather's chain and every node sharing the storage of what it hands to compute."""
    nodes = [*collective.issue, *collective.finish]
    stack = list(collective.finish)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in nodes and storage_root(user) is storage_root(node):
                nodes.append(user)
                stack.append(user)
    return nodes


def _backward_reads(gm) -> dict[tuple[str, int], list]:
    """Per backward compute node and argument index, the view chain from the storage it reads:
    (target, args but the first) from the root down; only arguments that are gathered parameters."""
    backward = backward_nodes(gm.graph)
    forward_params = {n for c in gathers(gm) for n in _chain(c)}
    reads = {}
    for node in backward:
        if is_alias_of_input(node):
            continue  # a view itself (the pass's replayed views): part of a chain, not a read
        for i, arg in enumerate(node.args):
            if not hasattr(arg, "op") or arg.op != "call_function":
                continue
            chain, cur = [], arg
            while cur is not storage_root(cur):
                chain.append((cur.target, cur.args[1:]))
                cur = cur.args[0]
            if arg in forward_params or cur.target is GATHER_ACTIVATION:
                reads[(node.name, i)] = chain[::-1]
    return reads


def test_no_secondary_group_is_a_no_op():
    b, gm, ctx = _hpz(group=None)
    code = gm.code
    assert not secondary_partition(gm, ctx).modified
    assert gm.code == code and count(gm, SHARD_ACTIVATION) == 0


def test_only_the_stage3_joint_graph():
    b, gm, ctx = _hpz()
    code = gm.code
    assert not secondary_partition(gm, dataclasses.replace(ctx, stage=2)).modified
    assert not secondary_partition(gm, dataclasses.replace(ctx, graph_kind="forward")).modified
    assert gm.code == code


@pytest.mark.parametrize("world_size, group", [(4, ("node", 2)), (6, ("node3", 3))])
def test_each_regathered_unit_keeps_a_piece_over_the_node_group(world_size, group):
    """One piece per unit's gather, over ``group``: this rank's 1/M of the unpacked buffer, rounded
    up (``MUST_SAVE``, role ``secondary_shard``), and one node-group all-gather of it in backward
    (role ``secondary_gather``) before backward's first read of the unit's parameters. The graph
    lints, holds no new all-gather over the N ranks, and backward reads nothing of the forward's
    gathered buffers, so they die after their last forward use."""
    b, gm, ctx = _hpz(world_size=world_size, group=group)
    result = secondary_partition(gm, ctx)
    assert result.modified and result.counts == {"secondary_partitions": 3}
    gm.graph.lint()
    name, size = group
    backward = backward_nodes(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert len(collectives(gm, "all_gather")) == 3 and not any(c in backward for c in collectives(gm))
    pieces = gm.graph.find_nodes(op="call_function", target=SHARD_ACTIVATION)
    assert len(pieces) == 3
    for collective, piece in zip(gathers(gm), pieces):
        (unpacked,) = [n for n in collective.finish if n.target.__name__ == "unpack_gathered.default"]
        assert piece.args == (unpacked, name, size) and piece not in backward
        assert piece.meta["recompute"] == CheckpointPolicy.MUST_SAVE and piece.meta[TAG] == {"role": "secondary_shard"}
        assert piece.meta["val"].numel() == -(-unpacked.meta["val"].numel() // size)
        (full,) = piece.users
        assert full.target is GATHER_ACTIVATION and full in backward
        assert full.args[1:] == (list(unpacked.meta["val"].shape), name, size)
        assert full.meta[TAG] == {"role": "secondary_gather"} and full.meta["partitioner_tag"] == "is_backward"
        readers = [u for n in gm.graph.nodes if storage_root(n) is full for u in n.users if storage_root(u) is not full]
        assert readers and order[full] < min(order[r] for r in readers)
        for node in _chain(collective):
            assert not any(u in backward for u in node.users), node


def test_backward_reads_the_same_parameters_from_the_node_gather():
    """Every backward read of a gathered parameter reads the same slice and view of the same
    layout, now cut from the node group's all-gather: the replayed views match the originals."""
    b, gm, ctx = _hpz()
    before = _backward_reads(gm)
    assert len(before) == 5  # both weights of each unit, but unit 1's up weight (its input needs no gradient)
    secondary_partition(gm, ctx)
    after = _backward_reads(gm)
    assert after == before
    backward = backward_nodes(gm.graph)
    for (name, i) in after:
        node = next(n for n in backward if n.name == name)
        assert storage_root(node.args[i]).target is GATHER_ACTIVATION


def test_kept_gathers_are_left_alone():
    """``selective_unshard`` keeps unit 1's gathered parameters for backward: no piece for it,
    backward still reads them; units 2 and 3 get theirs."""
    b, gm, ctx = _hpz()
    ctx = dataclasses.replace(ctx, memory=MemoryPolicy(unshard_budget_bytes=gathers(gm)[0].full_bytes))
    assert selective_unshard(gm, ctx).counts["kept"] == 1
    assert secondary_partition(gm, ctx).counts == {"secondary_partitions": 2}
    backward = backward_nodes(gm.graph)
    kept, *rest = gathers(gm)
    assert kept.units == [1]
    assert not any(u.target is SHARD_ACTIVATION for n in kept.finish for u in n.users)
    assert any(u in backward for n in _chain(kept) for u in n.users)
    assert [p.args[0] for p in gm.graph.find_nodes(op="call_function", target=SHARD_ACTIVATION)] == [
        n for c in rest for n in c.finish if n.target.__name__ == "unpack_gathered.default"]


def test_unbucketed_pieces_are_cut_after_the_wait_and_only_where_backward_reads():
    """One gather per parameter: no copy-out, the gathered storage is the collective's own output,
    so the piece is cut from its ``wait_tensor`` (the result is readable only after it). Unit 1's
    up weight is read by no backward op (the batch needs no gradient): it gets no piece."""
    b, gm, ctx = _hpz(bucketed=False)
    assert len(gathers(gm)) == 6
    assert secondary_partition(gm, ctx).counts == {"secondary_partitions": 5}
    gm.graph.lint()
    pieces = gm.graph.find_nodes(op="call_function", target=SHARD_ACTIVATION)
    assert all(p.args[0].target is WAIT for p in pieces)
    first_wait = next(n for n in gathers(gm)[0].finish if n.target is WAIT)
    assert first_wait not in {p.args[0] for p in pieces}  # unit 1's up weight


def test_checkpointed_unit_keeps_its_chain_tagged():
    """A user's activation checkpoint recomputes unit 2's first matmul (a recompute tag on a forward
    op, not zerograph's): the unit still gets its piece, and its gather chain stays
    ``MUST_RECOMPUTE`` so the partitioner re-gathers for that recomputation (for
    ``hand_over_secondary_pieces`` to replace by the node gather)."""
    b, gm, ctx = _hpz()
    unit2 = gathers(gm)[1]
    backward = backward_nodes(gm.graph)
    matmul = next(u for n in _chain(unit2) for u in n.users if u.target is aten.mm.default and u not in backward)
    matmul.meta.update({"recompute": CheckpointPolicy.PREFER_RECOMPUTE, "ac_graph_id": 1})  # as checkpoint tags it
    secondary_partition(gm, ctx)
    assert any(u.target is SHARD_ACTIVATION for n in unit2.finish for u in n.users)
    assert all(n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE for n in unit2.issue + unit2.finish)


def test_plain_unit_chain_is_untagged():
    """No activation checkpoint: backward reads only the node gather, so the N-rank chain loses its
    recompute tags (else the partitioner re-runs the all-gather over all N ranks in backward to
    cut the piece there, and backward gathers twice)."""
    b, gm, ctx = _hpz()
    secondary_partition(gm, ctx)
    for collective in gathers(gm):
        assert not any("recompute" in n.meta for n in collective.issue + collective.finish), collective.units


def test_expected_joint_of_one_unit():
    """One MLP block over 4 ranks, a node of 2: right after the copy-out the forward cuts its half
    of the unpacked buffer (``shard_activation``, ``MUST_SAVE``); the backward's one read of a
    gathered weight (the hidden gradient's ``mm`` with the down weight) reads it from the node
    all-gather of that piece, through the same slice and view replayed on it. The N-rank chain
    loses its recompute tags: only the forward reads it now."""
    b, gm, ctx = _hpz(1)
    result = run_pass(secondary_partition, gm, ctx)
    assert result.modified and result.counts == {"secondary_partitions": 1}
    assert graph_text(gm, note=recompute_note) == """\
input x
input tangents_1
input shard_0
input shard_1
view_default = aten.view(shard_0, [4, 4])
view_default_1 = aten.view(shard_1, [1, 16])
pack_shards = zerograph.pack_shards([view_default, view_default_1], [4, 1], 1, torch.float32)
all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(pack_shards, 4, '0')
wait_tensor = _c10d_functional.wait_tensor(all_gather_into_tensor)
unpack_gathered = zerograph.unpack_gathered(wait_tensor, 4, [4, 1], [16, 4], [4, 16])
shard_activation_default = zerograph.shard_activation(unpack_gathered, 'node', 2)  # must save
slice_1 = aten.slice(unpack_gathered, 0, 0, 64)
view = aten.view(slice_1, [16, 4])
slice_2 = aten.slice(unpack_gathered, 0, 64, 128)
view_1 = aten.view(slice_2, [4, 16])
t_default = aten.t(view)
mm_default = aten.mm(x, t_default)
relu_default = aten.relu(mm_default)
t_default_1 = aten.t(view_1)
mm_default_1 = aten.mm(relu_default, t_default_1)
view_default_2 = aten.view(mm_default_1, [2, 4])
sum_default = aten.sum(view_default_2)
expand_default = aten.expand(tangents_1, [2, 4])
t_default_2 = aten.t(expand_default)
mm_default_2 = aten.mm(t_default_2, relu_default)
reduce_grad_default = zerograph.reduce_grad(mm_default_2, 1)
gather_activation_default = zerograph.gather_activation(shard_activation_default, [128], 'node', 2)
slice_tensor = aten.slice(gather_activation_default, 0, 64, 128)  # must recompute
view_default_3 = aten.view(slice_tensor, [4, 16])  # must recompute
mm_default_3 = aten.mm(expand_default, view_default_3)
threshold_backward_default = aten.threshold_backward(mm_default_3, relu_default, 0)
t_default_3 = aten.t(threshold_backward_default)
mm_default_4 = aten.mm(t_default_3, x)
reduce_grad_default_1 = zerograph.reduce_grad(mm_default_4, 0)
return (sum_default, reduce_grad_default_1, reduce_grad_default)"""
    # the docstring's invariant: no backward node reads the N-rank gather or its views
    backward = backward_nodes(gm.graph)
    assert not any(u in backward for n in _chain(gathers(gm)[0]) for u in n.users)
