"""``zerograph.report.profile``: a profiled step of a compiled model turned into seconds per graph node
(world size 1, in process; the attribution rules themselves are tested in test_bench.py)."""
from __future__ import annotations

import pytest
import torch

import zerograph
from zerograph.errors import ConfigError
from zerograph.graph.costmodel import WAIT
from zerograph.report.profile import measure_node_seconds, profile_step
from zerograph.runtime.state import graphs_of

from .models import build, global_batch


def _compiled_mlp_step():
    model = zerograph.compile(build("mlp"), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(*global_batch("mlp", 0, 4)).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def test_measured_seconds_name_the_nodes_of_every_captured_graph():
    model, step = _compiled_mlp_step()
    measured = measure_node_seconds(model, step, warmup=1)
    captured = graphs_of(model)
    assert len(measured) == len(captured) == 1
    for kind in ("forward", "backward"):
        seconds = measured[0][kind]
        nodes = {n.name: n for n in captured[0][kind].graph.nodes}
        operators = [n for n in nodes.values() if n.op == "call_function" and n.target is not WAIT
                     and isinstance(n.target, torch._ops.OpOverload)]
        assert seconds and set(seconds) <= set(nodes), kind  # plain data: node name -> seconds
        assert len(seconds) >= 0.9 * len(operators), kind  # eager lowering: ops match their events
        assert all(isinstance(s, float) for s in seconds.values())
        assert sum(seconds.values()) > 0  # the matched events carry their durations


def test_a_step_that_ran_other_graphs_is_refused():
    model, step = _compiled_mlp_step()
    step()
    with torch.profiler.profile() as prof, torch.profiler.record_function("window"):
        model(*global_batch("mlp", 0, 4))  # a forward only: no backward graph ran
    events = list(prof.events())
    window = next(e for e in events if e.name == "window")
    with pytest.raises(ConfigError, match="captured 1 forward and 1 backward"):
        profile_step(model, events, window)
