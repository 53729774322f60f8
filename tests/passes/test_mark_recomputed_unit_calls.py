"""``mark_recomputed_unit_calls`` on a hand-built joint graph of one templated unit
(``unit_graphs.joint_unit``): a unit call inside an activation checkpoint has its backward given
every primal of the call and marked, so that ``expand_unit_calls`` runs its forward again."""
from tests.passes.graphs import graph_text, recompute_note, run_pass
from tests.passes.unit_graphs import block_kind, joint_unit
from zerograph.graph.ops import UNIT_CALL, UNIT_CALL_BACKWARD
from zerograph.passes.expand_unit_calls import RECOMPUTED, template_of
from zerograph.passes.mark_recomputed_unit_calls import mark_recomputed_unit_calls


def _note(node) -> str:
    return ", ".join(text for text in (recompute_note(node), "recomputed" if node.meta.get(RECOMPUTED) else "") if text)


def test_expected_joint_of_a_checkpointed_unit():
    """The checkpoint's tag is on the call: its backward's primals grow from ``[x]`` (what the
    template saves) to every primal of the call, ``[x, w]``, and it is marked; nothing else moves."""
    b, gm = joint_unit(checkpointed=True)
    kind, mode, call, _ = block_kind()
    (unit_call,) = gm.graph.find_nodes(op="call_function", target=UNIT_CALL)
    template = template_of(unit_call).id
    result = run_pass(mark_recomputed_unit_calls, gm, b.ctx("joint", stage=0))
    assert result.modified and result.counts == {"recomputed_unit_calls": 1, "random_unit_calls_kept": 0}
    assert graph_text(gm, note=_note) == f"""\
input x
input tangents_1
input w
unit_call_default = zerograph.unit_call({kind}, {mode}, 0, [x, w], {call})  # prefer recompute
getitem = getitem(unit_call_default, 0)  # prefer recompute
getitem_1 = getitem(unit_call_default, 1)  # prefer recompute
sum_default = aten.sum(getitem)
expand_default = aten.expand(tangents_1, [2, 4])
unit_call_backward_default = zerograph.unit_call_backward({template}, [x, w], getitem_1, [expand_default])  # recomputed
getitem_2 = getitem(unit_call_backward_default, 0)
reduce_grad_default = zerograph.reduce_grad(getitem_2, 0)
return (sum_default, reduce_grad_default)"""
    # the docstring's invariant: the marked backward takes every primal of its call
    (backward,) = gm.graph.find_nodes(op="call_function", target=UNIT_CALL_BACKWARD)
    assert backward.args[1] == unit_call.args[3] and backward.meta[RECOMPUTED]


def test_a_unit_outside_any_checkpoint_is_left_alone():
    b, gm = joint_unit()
    before = graph_text(gm, note=_note)
    assert not run_pass(mark_recomputed_unit_calls, gm, b.ctx("joint", stage=0)).modified
    assert graph_text(gm, note=_note) == before


def test_expected_joint_of_a_checkpointed_unit_that_draws_random_numbers():
    """A checkpointed ``DropoutBlock``: run again, it would draw other numbers, so its backward is
    left as it is and the call and its outputs are ``MUST_SAVE`` (the partitioner must not run it
    again either). The retagging is a change to the graph the partitioner reads: ``modified``."""
    b, gm = joint_unit(checkpointed=True, dropout=True)
    kind, mode, call, _ = block_kind(dropout=True)
    (unit_call,) = gm.graph.find_nodes(op="call_function", target=UNIT_CALL)
    template = template_of(unit_call)
    assert template.draws_random
    result = run_pass(mark_recomputed_unit_calls, gm, b.ctx("joint", stage=0))
    assert result.counts == {"recomputed_unit_calls": 0, "random_unit_calls_kept": 1}
    assert result.modified
    assert graph_text(gm, note=_note) == f"""\
input x
input tangents_1
input w
unit_call_default = zerograph.unit_call({kind}, {mode}, 0, [x, w], {call})  # must save
getitem = getitem(unit_call_default, 0)  # must save
getitem_1 = getitem(unit_call_default, 1)  # must save
sum_default = aten.sum(getitem)
expand_default = aten.expand(tangents_1, [2, 4])
unit_call_backward_default = zerograph.unit_call_backward({template.id}, [x], getitem_1, [expand_default])
getitem_2 = getitem(unit_call_backward_default, 0)
reduce_grad_default = zerograph.reduce_grad(getitem_2, 0)
return (sum_default, reduce_grad_default)"""
