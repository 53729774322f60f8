"""The "partitioned" pipeline: rewrites of the forward / backward pair the partitioner returns,
run by the pass manager with its contracts, checks and dump like every other pipeline.

The pair is built by hand in AOTAutograd's convention (``zerograph.passes.context.PartitionedGraphs``): the
forward returns its own outputs, the saved tensors, then opaque objects and symbols; the backward
takes the saved symbols, the saved values in the same order, then the tangents.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from tests.passes.graphs import graph_text
from zerograph.errors import PassError
from zerograph.graph.ops import REDUCE_GRAD
from zerograph.passes.context import PartitionedGraphs, PassContext
from zerograph.passes.manager import pipeline, run_pipeline
from zerograph.passes.saved_opaque_objects_last import saved_opaque_objects_last

aten = torch.ops.aten


def _placeholder(graph: fx.Graph, name: str, val) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _op(graph: fx.Graph, target, args: tuple, val) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def opaque_before_a_tensor() -> PartitionedGraphs:
    """The torch 2.13 order the pass exists for: a saved tensor, an opaque object (a generator,
    standing for the per-parameter build's ``DeviceMesh``), then another saved tensor (an RNG state
    the partitioner appended), then a saved symbol."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x_val, state_val = torch.empty(4, 4), torch.empty(2, dtype=torch.int64)
    n_val = mode.shape_env.create_unbacked_symint()
    fwd = fx.Graph()
    x = _placeholder(fwd, "x", x_val)
    mesh = _placeholder(fwd, "mesh", torch.Generator())
    n = _placeholder(fwd, "n", n_val)
    state = _placeholder(fwd, "rng_state", state_val)
    y = _op(fwd, aten.relu.default, (x,), x_val)
    fwd.output([y, x, mesh, state, n])
    bwd = fx.Graph()
    n_in = _placeholder(bwd, "n_saved", n_val)
    x_in = _placeholder(bwd, "x_saved", x_val)
    mesh_in = _placeholder(bwd, "mesh_saved", torch.Generator())
    state_in = _placeholder(bwd, "rng_state_saved", state_val)
    tangent = _placeholder(bwd, "tangent", x_val)
    grad = _op(bwd, aten.threshold_backward.default, (tangent, x_in, 0), x_val)
    bwd.output([grad, mesh_in, state_in, n_in])
    return PartitionedGraphs(fx.GraphModule({}, fwd), fx.GraphModule({}, bwd), num_fwd_outputs=1)


def _ctx(kind: str = "partitioned", stage: int = 3) -> PassContext:
    return PassContext(kind, stage, 2, "0", {}, ())


def _names(nodes) -> list[str]:
    return [n.name for n in nodes]


def test_opaque_objects_move_after_every_saved_tensor_on_both_sides() -> None:
    pair = opaque_before_a_tensor()
    result = saved_opaque_objects_last(pair, _ctx())
    assert result.modified and result.counts == {"opaque_objects_moved": 1}
    fwd_outputs = pair.forward.graph.output_node().args[0]
    assert _names(fwd_outputs) == ["relu_default", "x", "rng_state", "mesh", "n"]
    placeholders = pair.backward.graph.find_nodes(op="placeholder")
    assert _names(placeholders) == ["n_saved", "x_saved", "rng_state_saved", "mesh_saved", "tangent"]
    for gm in (pair.forward, pair.backward):
        gm.graph.lint()


def test_expected_pair_after_the_move() -> None:
    """Both graphs whole: only the forward's saved outputs and the backward's saved inputs
    change order (tensors, then the opaque object, then the symbol); nothing else moves."""
    pair = opaque_before_a_tensor()
    saved_opaque_objects_last(pair, _ctx())
    assert graph_text(pair.forward) == """\
input x
input mesh
input n
input rng_state
relu_default = aten.relu(x)
return [relu_default, x, rng_state, mesh, n]"""
    assert graph_text(pair.backward) == """\
input n_saved
input x_saved
input rng_state_saved
input mesh_saved
input tangent
threshold_backward_default = aten.threshold_backward(tangent, x_saved, 0)
return [threshold_backward_default, mesh_saved, rng_state_saved, n_saved]"""


def test_a_pair_already_in_order_is_left_alone() -> None:
    pair = opaque_before_a_tensor()
    saved_opaque_objects_last(pair, _ctx())
    before = (pair.forward.code, pair.backward.code)
    result = saved_opaque_objects_last(pair, _ctx())
    assert not result.modified
    assert (pair.forward.code, pair.backward.code) == before


def test_the_pipeline_runs_under_the_manager_and_dumps_both_graphs(tmp_path) -> None:
    pair = opaque_before_a_tensor()
    dump_dir = os.path.join(tmp_path, "rank0", "graph0_partitioned")
    out = run_pipeline(pair, _ctx(), pipeline("partitioned"), dump_dir=dump_dir)
    assert isinstance(out, PartitionedGraphs)
    assert list(out.meta["zerograph_passes"]["seconds"]) == [p.__name__ for p in pipeline("partitioned")]
    with open(os.path.join(dump_dir, "passes.json")) as f:
        entries = json.load(f)
    assert [e["pass"] for e in entries] == ["input"] + [p.__name__ for p in pipeline("partitioned")]
    moved = entries[1]
    assert moved["pass"] == "saved_opaque_objects_last" and moved["file"]
    with open(os.path.join(dump_dir, moved["file"])) as f:
        text = f.read()
    assert "# ---- forward graph ----" in text and "# ---- backward graph ----" in text
    assert not any(e.get("file") for e in entries[2:])  # no unit calls, no hpZ: the others change nothing


def test_a_forward_that_reduces_a_gradient_is_refused_at_the_pipelines_end() -> None:
    pair = opaque_before_a_tensor()
    fwd = pair.forward.graph
    relu = next(n for n in fwd.nodes if n.target is aten.relu.default)
    with fwd.inserting_after(relu):
        _op(fwd, REDUCE_GRAD, (relu, 0), relu.meta["val"])
    with pytest.raises(PassError, match="the forward graph reduces gradients"):
        run_pipeline(pair, _ctx(), pipeline("partitioned"))


def test_the_pipeline_cannot_end_without_its_required_passes() -> None:
    with pytest.raises(PassError, match="'saved_opaque_objects_last' would provide"):
        run_pipeline(opaque_before_a_tensor(), _ctx(), pipeline("partitioned"),
                     disabled=("saved_opaque_objects_last",))
