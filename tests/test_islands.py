"""The Inductor lowering of a graph that calls unit templates (``zerograph/capture/islands.py``): the graph
is cut into islands of consecutive ATen compute, each distinct island lowered once, the rest run
as Python in the graph's order. In process, with a compiler that records what it is handed and
runs the island eagerly (Inductor itself is exercised by the parity tests:
``test_parity.test_inductor_lowering_matches_single_process`` runs the MLP's templated units
through this path on two gloo ranks)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import zerograph
from zerograph.capture import lowering
from zerograph.capture.islands import lower_islands
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.runtime.state import graphs_of

from .distributed import fake_rank

aten = torch.ops.aten


def _barrier(x: torch.Tensor) -> torch.Tensor:
    """Stands for a collective or a unit call: not an ATen op, so no island may hold it."""
    return x


class _Recorder:
    """An island compiler that records each island it is handed and runs it eagerly."""

    def __init__(self) -> None:
        self.islands: list[fx.GraphModule] = []

    def __call__(self, island: fx.GraphModule, inputs: list[torch.Tensor], kind: str):
        self.islands.append(island)
        return lambda args: list(island(*args))


def _call_sequence(gm: fx.GraphModule) -> list:
    """The targets of the graph's calls in the order they run, each island's calls in its place
    (and the getitems that unpack an island's tuple left out)."""
    sequence = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            inner = gm.get_submodule(node.target)
            inner = getattr(inner, "island", inner)
            sequence.extend(_call_sequence(inner))
        elif node.op == "call_function" and not (node.target is operator.getitem
                                                  and node.args[0].op == "call_module"):
            sequence.append(node.target)
    return sequence


def _propagated(graph: fx.Graph, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(*inputs)
    return gm


def _synthetic() -> fx.GraphModule:
    """x -> (x * 2 + 1) -> barrier -> (* 2 + 1) -> barrier -> view, - 3 -> barrier -> -(x - 3) -> out:
    two identical runs of compute, a run of one op and a view, and a different run."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    for _ in range(2):
        x = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (x, 2.0)), 1.0))
        x = graph.call_function(_barrier, (x,))
    x = graph.call_function(aten.sub.Tensor, (graph.call_function(aten.view.default, (x, [-1])), 3.0))
    x = graph.call_function(_barrier, (x,))
    graph.output(graph.call_function(aten.neg.default, (graph.call_function(aten.sub.Tensor, (x, 3.0)),)))
    return _propagated(graph, torch.empty(2, 3))


def test_identical_runs_of_compute_are_lowered_once_and_keep_their_place() -> None:
    gm = _synthetic()
    recorder = _Recorder()
    split, islands, compiled = lower_islands(gm, "forward", recorder)
    # the two x * 2 + 1 runs share one; one op and a view are no island (nothing to fuse)
    assert (islands, compiled) == (3, 2)
    assert [[n.target for n in i.graph.nodes if n.op == "call_function"] for i in recorder.islands] == [
        [aten.mul.Tensor, aten.add.Tensor], [aten.sub.Tensor, aten.neg.default]]
    assert _call_sequence(split) == _call_sequence(gm)  # every op where it was, barriers between
    x = torch.randn(2, 3)
    torch.testing.assert_close(split(x), gm(x), rtol=0, atol=0)
    assert all(n.op != "call_module" for n in gm.graph.nodes)  # the graph handed in is left as it was


def test_a_write_is_left_out_of_islands() -> None:
    """An op that writes its input (here ``add_``) is not an island's: the island would write a
    copy."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (x, 2.0)), 1.0))
    graph.call_function(aten.add_.Tensor, (y, 1.0))
    graph.output(graph.call_function(aten.exp.default, (graph.call_function(aten.neg.default, (y,)),)))
    gm = _propagated(graph, torch.empty(4))
    split, islands, _ = lower_islands(gm, "forward", _Recorder())
    assert islands == 2 and aten.add_.Tensor in [n.target for n in split.graph.nodes]
    x = torch.randn(4)
    torch.testing.assert_close(split(x), gm(x), rtol=0, atol=0)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_distinct_islands_do_not_grow_with_depth(monkeypatch) -> None:
    """The templated GPT's forward and backward at 2 and 8 blocks, stage 3, rank 0 of a fake world
    of 2: each block adds islands (its gradient's pre-divide) but no distinct one, and every call
    runs in the order the passes scheduled. Without ``Config.inductor_islands`` (the default) the
    Inductor lowering hands Inductor nothing of these graphs: they run as FX Python."""
    def no_inductor(*args):
        raise AssertionError("Inductor was asked to lower a graph that calls templates")

    monkeypatch.setattr(lowering, "_inductor", no_inductor)
    monkeypatch.setattr(lowering, "_inductor_island", no_inductor)
    found = {}
    for blocks in (2, 8):
        with fake_rank(2):
            torch.manual_seed(0)
            model = zerograph.compile(GPT(GPTConfig(n_layer=blocks, n_embd=32, n_head=2, block_size=16)), 3)
            idx = torch.randint(0, 256, (2, 16))
            model(idx, idx).backward()
            record = graphs_of(model)[0]
            for kind in ("forward", "backward"):
                inputs = [n.meta["val"] for n in record[kind].graph.find_nodes(op="placeholder")]
                lowered, counts = lowering.lower("inductor", record[kind], inputs, kind, with_islands=False)
                assert counts is None and lowered._boxed_call, kind  # the graph's own Python, boxed
                split, islands, compiled = lower_islands(record[kind], kind, _Recorder())
                assert _call_sequence(split) == _call_sequence(record[kind]), (blocks, kind)
                found[blocks, kind] = islands, compiled
    for kind in ("forward", "backward"):
        assert found[8, kind][1] == found[2, kind][1], found
    assert found[8, "backward"][0] >= found[2, "backward"][0] + 6, found  # one per block, at least


def test_a_multi_output_view_keeps_its_getitems_out_of_the_island() -> None:
    """``split`` (a view with a tuple of outputs) at the start of a run is left to Python with its
    getitems, and a getitem after a barrier stays in Python too: no tuple crosses an island's
    edge."""
    graph = fx.Graph()
    x = graph.call_function(_barrier, (graph.placeholder("x"),))
    halves = graph.call_function(aten.split.Tensor, (x, 2))
    first, second = (graph.call_function(operator.getitem, (halves, i)) for i in range(2))
    y = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (first, second)), 1.0))
    y = graph.call_function(_barrier, (y,))
    parts = graph.call_function(aten.split.Tensor, (y, 1))
    y = graph.call_function(_barrier, (parts,))
    z = graph.call_function(operator.getitem, (y, 0))
    graph.output(graph.call_function(aten.exp.default, (graph.call_function(aten.neg.default, (z,)),)))
    gm = _propagated(graph, torch.empty(4, 3))
    recorder = _Recorder()
    split, islands, _ = lower_islands(gm, "forward", recorder)
    assert [[n.target for n in i.graph.nodes if n.op == "call_function"] for i in recorder.islands] == [
        [aten.mul.Tensor, aten.add.Tensor], [aten.neg.default, aten.exp.default]]
    x = torch.randn(4, 3)
    torch.testing.assert_close(split(x), gm(x), rtol=0, atol=0)


@pytest.mark.parametrize("second_offset", [0, 5])
def test_inputs_at_other_storage_offsets_get_islands_of_their_own(second_offset: int) -> None:
    """Inductor compiles an ``as_strided`` relative to its example input's storage offset, so the
    offset is part of an island's key: the same ops on a view at another offset compile again."""
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    outs = []
    for x in (a, b):
        y = graph.call_function(aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (x, 2.0)), 1.0))
        outs.append(graph.call_function(_barrier, (y,)))
    graph.output(tuple(outs))
    base = torch.randn(10)
    gm = _propagated(graph, base[0:4], base[second_offset:second_offset + 4])
    _, islands, compiled = lower_islands(gm, "forward", _Recorder())
    assert (islands, compiled) == (2, 1 if second_offset == 0 else 2)
