"""``expand_inference_unit_calls`` on a hand-built inference graph of one templated unit
(``unit_graphs.inference_unit``): the call becomes the template's ``unit_forward``, of which only
the output is read."""
import operator

from tests.passes.graphs import graph_text, linear_chain, run_pass
from tests.passes.unit_graphs import block_kind, inference_unit
from zerograph.graph.ops import UNIT_FORWARD
from zerograph.passes.expand_inference_unit_calls import expand_inference_unit_calls


def test_expected_graph_of_one_unit_call():
    b, gm = inference_unit()
    kind, mode, call, _ = block_kind()
    result = run_pass(expand_inference_unit_calls, gm, b.ctx("inference", stage=0))
    assert result.modified and result.counts == {"unit_forwards": 1}
    assert graph_text(gm) == f"""\
input x
input w
unit_forward_default = zerograph.unit_forward({kind}, {mode}, 0, [x, w], {call})
getitem_1 = getitem(unit_forward_default, 0)
sum_default = aten.sum(getitem_1)
return (sum_default,)"""
    # the docstring's invariant: only the output is read; the activations saved for backward are dropped
    (forward,) = gm.graph.find_nodes(op="call_function", target=UNIT_FORWARD)
    assert [(u.target, u.args[1]) for u in forward.users] == [(operator.getitem, 0)]


def test_a_graph_without_unit_calls_is_left_alone():
    b, gm = linear_chain(2)
    before = graph_text(gm)
    assert not run_pass(expand_inference_unit_calls, gm, b.ctx("inference")).modified
    assert graph_text(gm) == before
