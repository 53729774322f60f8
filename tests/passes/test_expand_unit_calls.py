"""``expand_unit_calls`` on a hand-built partitioned pair of one templated unit
(``unit_graphs.partitioned_unit``): the forward's ``unit_call`` becomes ``unit_forward``, the
backward's ``unit_call_backward`` becomes ``unit_backward`` reading the activations handed over
(or, for a checkpointed unit, a ``unit_forward`` run again in backward), and saved values no
backward node reads any more (the token) are dropped from both sides."""
from tests.passes.graphs import graph_text, run_pass
from tests.passes.unit_graphs import block_kind, partitioned_unit
from zerograph.graph.ops import UNIT_BACKWARD, UNIT_CALL, UNIT_CALL_BACKWARD, UNIT_FORWARD
from zerograph.passes._fx import saved_tensor_inputs
from zerograph.passes.expand_unit_calls import expand_unit_calls, template_of


def _expanded(recomputed: bool):
    b, pair = partitioned_unit(recomputed=recomputed)
    (call,) = pair.forward.graph.find_nodes(op="call_function", target=UNIT_CALL)
    template = template_of(call).id
    ctx = b.ctx("partitioned", stage=0)
    result = run_pass(expand_unit_calls, pair, ctx)
    assert result.modified and result.counts == {"unit_forwards": 1, "unit_backwards": 1}  # calls expanded
    return pair, template, ctx


def _check_post(pair) -> None:
    """The docstring's post: no unit call is left, and every saved tensor is read by backward,
    the forward saving exactly what the backward takes."""
    graphs = (pair.forward.graph, pair.backward.graph)
    assert not any(n.target in (UNIT_CALL, UNIT_CALL_BACKWARD) for g in graphs for n in g.nodes)
    saved = saved_tensor_inputs(pair.forward, pair.backward, pair.num_fwd_outputs)[:-1]  # less the tangent
    assert all(p.users for p in saved)
    outputs = pair.forward.graph.output_node().args[0][pair.num_fwd_outputs:]
    assert [o.meta["val"].shape for o in outputs] == [p.meta["val"].shape for p in saved]


def test_expected_pair_with_the_units_activation_handed_over():
    """The activation ``unit_forward`` returns after the output (``getitem_3``) becomes the first
    saved tensor; the token, read by nothing once ``unit_backward`` reads the activation, is no
    longer saved."""
    pair, template, _ = _expanded(recomputed=False)
    kind, mode, call, _ = block_kind()
    assert graph_text(pair.forward) == f"""\
input x
input w
unit_forward_default = zerograph.unit_forward({kind}, {mode}, 0, [x, w], {call})
getitem_2 = getitem(unit_forward_default, 0)
getitem_3 = getitem(unit_forward_default, 1)
sum_default = aten.sum(getitem_2)
return [sum_default, getitem_3, x]"""
    assert graph_text(pair.backward) == f"""\
input getitem_3_saved
input x
input tangents_1
expand_default = aten.expand(tangents_1, [2, 4])
unit_backward_default = zerograph.unit_backward({template}, [x], [getitem_3_saved], [expand_default])
getitem = getitem(unit_backward_default, 0)
return (getitem,)"""
    _check_post(pair)


def test_expected_pair_of_a_recomputed_unit():
    """A unit ``mark_recomputed_unit_calls`` marked: nothing is handed over; the backward runs
    ``unit_forward`` again on the saved primals and its ``unit_backward`` reads that activation."""
    pair, template, _ = _expanded(recomputed=True)
    kind, mode, call, _ = block_kind()
    assert graph_text(pair.forward) == f"""\
input x
input w
unit_forward_default = zerograph.unit_forward({kind}, {mode}, 0, [x, w], {call})
getitem_2 = getitem(unit_forward_default, 0)
sum_default = aten.sum(getitem_2)
return [sum_default, x, w]"""
    assert graph_text(pair.backward) == f"""\
input x
input w
input tangents_1
expand_default = aten.expand(tangents_1, [2, 4])
unit_forward_default = zerograph.unit_forward({kind}, {mode}, 0, [x, w], {call})
getitem_3 = getitem(unit_forward_default, 1)
unit_backward_default = zerograph.unit_backward({template}, [x], [getitem_3], [expand_default])
getitem = getitem(unit_backward_default, 0)
return (getitem,)"""
    _check_post(pair)
    (recomputed,) = pair.backward.graph.find_nodes(op="call_function", target=UNIT_FORWARD)
    (backward,) = pair.backward.graph.find_nodes(op="call_function", target=UNIT_BACKWARD)
    assert backward.args[2] == [next(iter(recomputed.users))]


def test_a_pair_without_unit_calls_is_left_alone():
    pair, _, ctx = _expanded(recomputed=False)  # expanded already
    before = graph_text(pair.forward), graph_text(pair.backward)
    assert not run_pass(expand_unit_calls, pair, ctx).modified
    assert (graph_text(pair.forward), graph_text(pair.backward)) == before
