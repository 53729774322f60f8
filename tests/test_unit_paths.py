"""A unit kind's path as a state machine (``templates.unit_paths``), and the trace flags as one
object (``shard.trace_state.TRACE``). In process, nothing compiled: a ``UnitKind`` over a plain
block, moved with ``UnitKind.leave`` through every pair of paths; what the moves write (the unit
attributes Dynamo guards on, the exits ``stats`` and ``explain`` show) checked as the compiled
forward reads it. The end-to-end paths (a dynamic shape, an object argument, an island, a
changed unit) are tests/test_unit_templates_inline.py's, tests/test_unit_template_calls.py's and
tests/test_islands.py's."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from zerograph.errors import TemplateFallbackError, TemplateUnavailable, UnitPathError
from zerograph.graph.vocab import GRAD_ACCUMULATE, GRAD_SYNC
from zerograph.shard.trace_state import TRACE, TraceState
from zerograph.templates.kinds import UnitKind
from zerograph.templates.unit_paths import INLINE_ATTR, INLINE_MODE_PREFIX, ISLAND_ATTR, TRANSITIONS, UnitPath

ORDER = list(UnitPath)  # fastest first


def _kind(units: int = 2) -> UnitKind:
    """A kind of ``units`` blocks as ``install_unit_templates`` leaves it: on its templates."""
    modules = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(units)]
    kind = UnitKind(0, "0", modules[0], "eager", [])
    kind.units, kind.modules, kind.flat_reason = [str(i) for i in range(units)], modules, None
    for module in modules:
        object.__setattr__(module, INLINE_ATTR, False)
        object.__setattr__(module, ISLAND_ATTR, False)
    return kind


def _moved_to(path: UnitPath) -> UnitKind:
    """A kind moved from its templates to ``path`` the way zerograph moves one."""
    kind = _kind()
    if path is UnitPath.MODES_INLINE:
        kind.run_inline("dropout in training", mode=0b11)
    elif path is UnitPath.INLINE:
        kind.run_inline("an nn.LSTM")
    elif path is UnitPath.ISLAND:
        with pytest.raises(TemplateUnavailable, match="gathered once on entry"):
            kind.run_as_islands("data-dependent control flow")
    assert kind.current_path is path
    return kind


def test_the_table_moves_only_toward_eager() -> None:
    """No path leads back to a faster one; every path may stay (an exit that keeps it)."""
    for source, targets in TRANSITIONS.items():
        assert source in targets
        assert all(ORDER.index(target) >= ORDER.index(source) for target in targets), source
    assert set(TRANSITIONS) == set(UnitPath)


@pytest.mark.parametrize(("source", "target"), list(itertools.product(UnitPath, UnitPath)))
def test_leave_takes_the_moves_of_the_table_and_refuses_the_rest(source: UnitPath, target: UnitPath) -> None:
    kind = _moved_to(source)
    exits = dict(kind.exits)
    if target not in TRANSITIONS[source]:
        with pytest.raises(UnitPathError, match=f"from path {source.name} to {target.name}"):
            kind.leave(target, "a move back", mode=0b1)
        assert kind.current_path is source and kind.exits == exits  # refused: nothing moved, nothing counted
        return
    kind.leave(target, "why", mode=0b1)
    assert kind.current_path is target and kind.inline_reason == "why"
    assert kind.exits["why (in training-flag mode 0b1)"] == exits.get("why (in training-flag mode 0b1)", 0) + 1
    for unit in kind.modules:  # what the units' forward reads, and Dynamo guards on
        assert getattr(unit, f"{INLINE_MODE_PREFIX}1") is True
        assert getattr(unit, INLINE_ATTR) is (target in (UnitPath.INLINE, UnitPath.ISLAND))
        assert getattr(unit, ISLAND_ATTR) is (target is UnitPath.ISLAND)
    assert kind.path()["path"] == {UnitPath.ISLAND: "island", UnitPath.INLINE: "inline"}.get(target, "template")


def test_inline_in_some_modes_names_the_mode() -> None:
    kind = _kind()
    with pytest.raises(UnitPathError, match="MODES_INLINE"):
        kind.leave(UnitPath.MODES_INLINE, "no mode given")
    kind.run_inline("dropout in training", mode=0b11)
    kind.run_inline("a batch norm's statistics", mode=0b01)
    path = kind.path()
    assert kind.current_path is UnitPath.MODES_INLINE and path["path"] == "template"
    assert path["inline_modes"] == {"0b11": "dropout in training", "0b1": "a batch norm's statistics"}
    assert path["exits"] == {"dropout in training (in training-flag mode 0b11)": 1,
                             "a batch norm's statistics (in training-flag mode 0b1)": 1}


def test_an_island_stays_one_when_asked_to_run_inline() -> None:
    kind = _moved_to(UnitPath.ISLAND)
    kind.run_inline("a unit changed since compile")
    kind.run_inline("an object argument", mode=0b1)
    assert kind.current_path is UnitPath.ISLAND and kind.path()["path"] == "island"
    assert all(getattr(unit, ISLAND_ATTR) and getattr(unit, INLINE_ATTR) for unit in kind.modules)


def test_strict_templates_refuse_after_the_move() -> None:
    """``Config(strict_templates=True)``: the exit raises, and the kind has moved all the same (the
    graphs that called its template must not run it again)."""
    kind = _kind()
    kind.strict = True
    with pytest.raises(TemplateFallbackError, match="an nn.LSTM"):
        kind.run_inline("an nn.LSTM")
    assert kind.current_path is UnitPath.INLINE and getattr(kind.modules[1], INLINE_ATTR)


def test_trace_state_scopes_nest_and_restore_on_error() -> None:
    state = TraceState()
    with state.scope(gathering=True, grad_mode=GRAD_ACCUMULATE):
        with pytest.raises(RuntimeError, match="inside"), state.scope(gathering=False, tracing_unit=True):
            assert (state.gathering, state.tracing_unit, state.grad_mode) == (False, True, GRAD_ACCUMULATE)
            raise RuntimeError("inside")
        assert (state.gathering, state.tracing_unit, state.grad_mode) == (True, False, GRAD_ACCUMULATE)
    assert state == TraceState()
    with pytest.raises(TypeError, match="'gatherin'"), state.scope(gatherin=True):
        pass
    with pytest.raises(ValueError, match="'nosync'"), state.scope(grad_mode="nosync"):
        pass
    assert state == TraceState() and TRACE == TraceState()  # no test left the process's flags set


def test_a_parameter_read_follows_the_trace_state() -> None:
    """A sharded module's parameter attribute reads ``TRACE``: its shard outside a forward, what
    ``init_read`` hands back inside ``init_weights``, and its slot in a unit's trace."""
    from zerograph.shard.sharding import _param_property

    module = nn.Linear(2, 2)
    cls = type("ShardedLinear", (nn.Linear,), {"weight": _param_property("weight", 0)})
    module.__class__ = cls
    slot = module._parameters["weight"]
    assert module.weight is slot
    stand_in = torch.zeros(2, 2)
    with TRACE.scope(init_read=lambda mod, name: stand_in):
        assert module.weight is stand_in
    with TRACE.scope(gathering=True, tracing_unit=True):
        assert module.weight is slot
    assert TRACE.grad_mode == GRAD_SYNC
