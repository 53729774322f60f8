"""The cost model (zerograph.graph.costmodel) and the predicted / measured timelines (zerograph.report.timeline).

Hand-built FX graphs with fake values check the simulation exactly; one spawned world-size-2 gloo
run calibrates, measures a compiled stage-3 step of the tiny GPT and predicts the same step.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import zerograph
from zerograph.graph.costmodel import (
    CLUSTERS_FILE,
    COLLECTIVE_KINDS,
    COLLECTIVE_OPS,
    NOMINAL_CLUSTER,
    CostModel,
    calibrate,
    cluster_cost_model,
    fit_alpha_beta,
    load_cluster_table,
    node_flops,
    nominal_cost_model,
)
from zerograph.graph.ops import GATHER_ACTIVATION
from zerograph.report.timeline import Schedule, measure, predict, schedule_from_profile
from zerograph.runtime.state import graphs_of

from .distributed import spawn
from .models import build, global_batch, rank_slice

C10D = torch.ops._c10d_functional
aten = torch.ops.aten
WORLD = 2

# a made-up cluster: every number is a parameter of the checks below, none is an expected result
COST = CostModel(world_size=WORLD, flops_per_s=1e9, bytes_per_s=1e10, op_overhead_s=1e-5,
                 collectives={"all_gather": (1e-3, 1e-9), "reduce_scatter": (2e-3, 2e-9), "all_reduce": (3e-3, 3e-9)})


class GraphBuilder:
    """Builds an fx.Graph node by node, each with a fake ``meta["val"]`` as captured graphs have."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def input(self, name: str, *shape: int) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape)
        return node

    def op(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        with self.mode:
            node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        return node

    def collective(self, kind: str, x: fx.Node, group: str = "g") -> fx.Node:
        """A functional collective on a made-up group, its output shape as the op defines it."""
        numel = x.meta["val"].numel()
        target, args, out = {
            "all_gather": (C10D.all_gather_into_tensor.default, (x, WORLD, group), numel * WORLD),
            "reduce_scatter": (C10D.reduce_scatter_tensor.default, (x, "sum", WORLD, group), numel // WORLD),
            "all_reduce": (C10D.all_reduce.default, (x, "sum", group), numel),
        }[kind]
        node = self.graph.call_function(target, args)
        with self.mode:
            node.meta["val"] = torch.empty(out)
        return node

    def wait(self, collective: fx.Node) -> fx.Node:
        node = self.graph.call_function(C10D.wait_tensor.default, (collective,))
        node.meta["val"] = collective.meta["val"]
        return node

    def done(self, *outputs: fx.Node) -> fx.Graph:
        self.graph.output(outputs)
        self.graph.lint()
        return self.graph


def gather_then(compute_between: bool) -> tuple[fx.Graph, fx.Node, fx.Node]:
    """x -> all_gather -> [independent matmul] -> wait -> use. Returns (graph, collective, matmul)."""
    b = GraphBuilder()
    x = b.input("x", 4096)
    a = b.input("a", 64, 64)
    gathered = b.collective("all_gather", x)
    if compute_between:
        mm = b.op(aten.mm.default, a, a)
        full = b.wait(gathered)
    else:
        full = b.wait(gathered)
        mm = b.op(aten.mm.default, a, a)
    used = b.op(aten.mul.Tensor, full, 2.0)
    return b.done(used, mm), gathered, mm


def test_wait_right_after_start_exposes_the_whole_collective():
    graph, gathered, _ = gather_then(compute_between=False)
    schedule = predict([graph], COST)
    full_bytes = gathered.meta["val"].numel() * 4
    assert schedule.exposed_comm_s == pytest.approx(COST.collective_time("all_gather", full_bytes), rel=1e-12)
    assert schedule.overlap_s() == 0.0
    assert len(schedule.waits) == 1 and schedule.waits[0].kind == "all_gather"


def test_independent_compute_between_start_and_wait_hides_exactly_its_time():
    exposed_graph, _, _ = gather_then(compute_between=False)
    hidden_graph, gathered, mm = gather_then(compute_between=True)
    mm_s = COST.node_time(mm)
    assert 0 < mm_s < COST.collective_time("all_gather", gathered.meta["val"].numel() * 4)  # fully hideable
    exposed, hidden = predict([exposed_graph], COST), predict([hidden_graph], COST)
    assert exposed.exposed_comm_s - hidden.exposed_comm_s == pytest.approx(mm_s, rel=1e-9)
    assert hidden.overlap_s() == pytest.approx(mm_s, rel=1e-9)
    assert exposed.compute_s == pytest.approx(hidden.compute_s, rel=1e-12)  # same work, reordered
    assert exposed.step_s - hidden.step_s == pytest.approx(mm_s, rel=1e-9)


def test_a_group_with_a_cost_model_of_its_own_is_priced_by_it():
    b = GraphBuilder()
    x = b.input("x", 4096)
    on_own_link = b.collective("all_gather", x, group="node")
    on_world = b.collective("all_gather", x, group="g")
    graph = b.done(b.wait(on_own_link), b.wait(on_world))
    node_link = CostModel(world_size=8, flops_per_s=1e9, bytes_per_s=1e10, op_overhead_s=1e-5,
                          collectives={"all_gather": (5e-4, 1e-10)})
    comm = predict([graph], COST, {"node": node_link}).track("comm")
    full_bytes = on_world.meta["val"].numel() * 4
    assert [e.dur_s for e in comm] == pytest.approx(
        [node_link.collective_time("all_gather", full_bytes), COST.collective_time("all_gather", full_bytes)], rel=1e-12)
    assert predict([graph], COST).track("comm")[0].dur_s == pytest.approx(comm[1].dur_s, rel=1e-12)


def test_a_re_gather_inside_one_op_is_communication_that_blocks_compute():
    """hpZ's and P_a's ``gather_activation`` holds its all-gather and its wait: priced on its
    group's link, for the padded full buffer, all of it exposed; no compute time of its own."""
    b = GraphBuilder()
    piece, a = b.input("piece", 1000), b.input("a", 64, 64)
    regathered = b.op(GATHER_ACTIVATION, piece, [7990], "node", 8)
    graph = b.done(b.op(aten.mul.Tensor, regathered, 2.0), b.op(aten.mm.default, a, a))
    node_link = CostModel(world_size=8, flops_per_s=1e9, bytes_per_s=1e10, op_overhead_s=1e-5,
                          collectives={"all_gather": (5e-4, 1e-10)})
    schedule = predict([graph], COST, {"node": node_link})
    gather_s = node_link.collective_time("all_gather", 8 * 1000 * 4)
    [comm] = schedule.track("comm")
    assert (comm.kind, comm.dur_s) == ("all_gather", pytest.approx(gather_s, rel=1e-12))
    assert schedule.exposed_comm_s == pytest.approx(gather_s, rel=1e-12)
    launch, *rest = schedule.track("compute")
    assert (launch.kind, launch.dur_s) == ("gather_activation.default", COST.op_overhead_s)  # no compute time of its own
    assert [e.kind for e in rest] == ["mul.Tensor", "mm.default"] and rest[0].start_s == pytest.approx(comm.end_s)
    # on the default cost model when its group has no link of its own
    assert predict([graph], COST).exposed_comm_s == pytest.approx(COST.collective_time("all_gather", 32000), rel=1e-12)


def test_comm_stream_runs_one_collective_at_a_time_across_graphs():
    first, second = GraphBuilder(), GraphBuilder()
    x, g = first.input("x", 1000), first.input("g", 2000)
    starts = [first.collective(kind, x if kind == "all_gather" else g) for kind in COLLECTIVE_KINDS]
    forward = first.done(*[first.wait(c) for c in reversed(starts)])  # waits in reverse issue order
    y = second.input("y", 3000)
    backward = second.done(second.wait(second.collective("all_reduce", y)))
    schedule = predict([forward, backward], COST)

    comm = schedule.track("comm")
    assert [e.kind for e in comm] == ["all_gather", "reduce_scatter", "all_reduce", "all_reduce"]
    for earlier, later in zip(comm, comm[1:]):
        assert later.start_s >= earlier.end_s - 1e-15  # never two collectives at once
    assert schedule.comm_s == pytest.approx(sum(e.dur_s for e in comm), rel=1e-12)
    assert schedule.step_s >= max(schedule.compute_s, schedule.comm_s)
    # nothing to hide behind: compute is only the launches, so all but the launches is exposed
    assert schedule.exposed_comm_s == pytest.approx(schedule.step_s - schedule.compute_s, rel=1e-9)


def test_node_time_follows_the_roofline_and_flop_counter():
    b = GraphBuilder()
    small, large = b.input("small", 32, 32), b.input("large", 128, 128)
    mm_small, mm_large = b.op(aten.mm.default, small, small), b.op(aten.mm.default, large, large)
    view = b.op(aten.view.default, mm_large, [-1])
    added = b.op(aten.add.Tensor, view, 1.0)
    gathered = b.collective("all_gather", added)
    waited = b.wait(gathered)
    b.done(mm_small, waited)

    with FlopCounterMode(display=False) as counter:  # the reference: FLOPs of a real matmul
        torch.mm(torch.ones(128, 128), torch.ones(128, 128))
    assert node_flops(mm_large) == counter.get_total_flops() > node_flops(mm_small) > 0
    assert COST.node_time(mm_large) > COST.node_time(mm_small) > COST.op_overhead_s
    compute_bound = node_flops(mm_large) / COST.flops_per_s + COST.op_overhead_s
    assert COST.node_time(mm_large) == pytest.approx(compute_bound, rel=1e-12)
    memory_bound = 2 * added.meta["val"].numel() * 4 / COST.bytes_per_s + COST.op_overhead_s  # read + write
    assert COST.node_time(added) == pytest.approx(memory_bound, rel=1e-12)
    assert COST.node_time(view) == COST.node_time(waited) == 0.0
    assert COST.node_time(gathered) == COST.op_overhead_s  # the launch; the transfer is on the comm stream


def test_collectives_cost_alpha_plus_beta_bytes_and_nothing_on_one_rank():
    for kind, (alpha, beta) in COST.collectives.items():
        assert COST.collective_time(kind, 1 << 20) == pytest.approx(alpha + beta * (1 << 20), rel=1e-12)
    one_rank = CostModel.from_dict({**COST.to_dict(), "world_size": 1})
    assert all(one_rank.collective_time(kind, 1 << 20) == 0.0 for kind in COLLECTIVE_KINDS)
    with pytest.raises(zerograph.ConfigError):
        CostModel.from_dict({**COST.to_dict(), "collectives": {"broadcast": [0.0, 1e-9]}})


def test_fit_recovers_a_line_and_keeps_alpha_non_negative():
    sizes = [1 << k for k in range(10, 22, 2)]
    alpha, beta = fit_alpha_beta(sizes, [3e-5 + 2e-10 * s for s in sizes])
    assert alpha == pytest.approx(3e-5, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)
    alpha, beta = fit_alpha_beta(sizes, [-1e-7 + 2e-10 * s for s in sizes])  # a line below the origin
    assert alpha == 0.0 and beta > 0
    # timings that fall with size (noise on a loaded machine): no negative bandwidth, the mean as alpha
    falling = [4e-4 - 1e-11 * s for s in sizes]
    assert fit_alpha_beta(sizes, falling) == (pytest.approx(sum(falling) / len(falling)), 0.0)


def test_calibrate_without_group_measures_compute_and_frees_collectives():
    cost = calibrate(None, max_bytes=1 << 16, repeats=2)
    assert cost.world_size == 1 and cost.flops_per_s > 0 and cost.bytes_per_s > 0 and cost.op_overhead_s > 0
    assert all(cost.collective_time(kind, 1 << 20) == 0.0 for kind in COLLECTIVE_KINDS)
    with pytest.raises(zerograph.ConfigError):
        calibrate(None, max_bytes=100)


def test_cost_model_round_trips_through_json():
    for cost in (COST, CostModel.from_dict({**COST.to_dict(), "host_bytes_per_s": 3e10})):
        restored = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
        assert restored == cost and hash(restored) == hash(cost)


def test_resized_keeps_the_bus_bandwidth_and_refuses_one_rank():
    eight = CostModel.from_dict({**COST.to_dict(), "world_size": 8})
    two = eight.resized(2)
    for kind, (alpha, beta) in eight.collectives.items():
        assert two.collectives[kind] == (alpha, pytest.approx(beta * (1 / 2) / (7 / 8), rel=1e-12))
    assert eight.resized(8) is eight
    with pytest.raises(zerograph.ConfigError, match="one-rank cost model"):
        CostModel.from_dict({**COST.to_dict(), "world_size": 1}).resized(2)


def test_the_nominal_model_is_the_cluster_tables_entry_and_prices_config_by_default():
    entry = load_cluster_table(CLUSTERS_FILE)[NOMINAL_CLUSTER]
    nominal = nominal_cost_model()
    assert nominal == cluster_cost_model(entry) and nominal.host_bytes_per_s == entry["host_link_bytes_per_s"]
    assert zerograph.Config().activations.cost_model is None  # no budget: nothing to price
    assert zerograph.Config(activations=zerograph.ActivationPolicy(budget_bytes=0)).activations.cost_model == nominal
    given = zerograph.Config(activations=zerograph.ActivationPolicy(budget_bytes=0, offload=True, cost_model=COST))
    assert given.activations.cost_model == CostModel.from_dict(
        {**COST.to_dict(), "host_bytes_per_s": nominal.host_bytes_per_s})  # only the missing rate is filled in


def test_chrome_trace_is_json_with_both_tracks():
    graph, _, _ = gather_then(compute_between=True)
    trace = predict([graph], COST).to_chrome_trace(pid=3)
    decoded = json.loads(json.dumps(trace))
    complete = [e for e in decoded["traceEvents"] if e["ph"] == "X"]
    named = {e["tid"]: e["args"]["name"] for e in decoded["traceEvents"] if e["ph"] == "M"}
    assert {named[e["tid"]] for e in complete} == {"compute", "comm", "exposed"}
    assert all(e["pid"] == 3 and e["dur"] >= 0 for e in complete)


def profiler_event(name, start_us, end_us, *, thread=1, parent=None, shapes=(), concrete=()):
    """The fields of torch.profiler's FunctionEvent that schedule_from_profile reads."""
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start_us, end=end_us),
                           cpu_parent=parent, input_shapes=[list(s) for s in shapes], concrete_inputs=list(concrete))


def test_measured_waits_pair_with_their_collective_when_reordered():
    gather = profiler_event("_c10d_functional::all_gather_into_tensor", 0, 10, shapes=[(8,)], concrete=[None, 2, None])
    scatter = profiler_event("_c10d_functional::reduce_scatter_tensor", 10, 20, shapes=[(64,)],
                             concrete=[None, None, 2, None])
    matmul = profiler_event("aten::mm", 20, 120)
    nested = profiler_event("aten::empty", 30, 40, parent=matmul)  # inside mm: not a second interval
    wait_scatter = profiler_event("_c10d_functional::wait_tensor", 120, 150, shapes=[(32,)])
    wait_gather = profiler_event("_c10d_functional::wait_tensor", 150, 160, shapes=[(16,)])
    worker = profiler_event("gloo:all_gather", 5, 60, thread=2)  # the process group's own thread
    schedule = schedule_from_profile([gather, scatter, matmul, nested, worker, wait_scatter, wait_gather])

    comm = {e.kind: (e.start_s * 1e6, e.end_s * 1e6) for e in schedule.track("comm")}
    # in flight from the end of its launch to the end of its wait
    assert comm["reduce_scatter"] == pytest.approx((20, 150)) and comm["all_gather"] == pytest.approx((10, 160))
    assert [w.kind for w in schedule.waits] == ["reduce_scatter", "all_gather"]
    assert schedule.exposed_comm_s * 1e6 == pytest.approx(40)
    assert schedule.compute_s * 1e6 == pytest.approx(120)  # the two launches and the matmul
    assert schedule.overlap_s() * 1e6 == pytest.approx(110)  # the scatter's launch and the matmul
    assert schedule.step_s * 1e6 == pytest.approx(160)


# ---------------------------------------------------------------------------------------------
# world size 2, gloo: calibrate, measure a real step, predict it


def calibrate_measure_predict(rank: int, world_size: int) -> dict:
    """Runs on each rank: plain data only (graphs do not cross processes)."""
    cost = calibrate(torch.distributed.group.WORLD, max_bytes=1 << 20, repeats=3)
    model = zerograph.compile(build("gpt"), stage=3)
    batch = rank_slice(global_batch("gpt", 0, 4), rank, world_size)
    measured = measure(lambda: model(*batch).backward(), warmup=2)  # the first step compiles
    record = graphs_of(model)[0]
    graphs = [record["forward"], record["backward"]]
    in_graphs: dict[str, int] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target in COLLECTIVE_OPS:
                in_graphs[COLLECTIVE_OPS[node.target]] = in_graphs.get(COLLECTIVE_OPS[node.target], 0) + 1
    return {"cost": cost.to_dict(), "measured": measured, "predicted": predict(graphs, cost),
            "in_graphs": in_graphs, "graph_count": len(graphs_of(model))}


@pytest.fixture(scope="module")
def two_rank_run() -> list[dict]:
    return spawn(calibrate_measure_predict, WORLD, timeout_s=180)


@pytest.mark.distributed
def test_calibration_is_rank_agreed_and_sane(two_rank_run):
    costs = [r["cost"] for r in two_rank_run]
    assert costs[0] == costs[1]
    cost = CostModel.from_dict(costs[0])
    assert cost.world_size == WORLD
    assert cost.flops_per_s > 0 and cost.bytes_per_s > 0 and cost.op_overhead_s > 0
    for kind in COLLECTIVE_KINDS:
        alpha, beta = cost.collectives[kind]
        # fit_alpha_beta's contract; beta is 0 where the timings fell with size, which noise does
        # on a loaded machine (this asserted beta > 0 and failed when other jobs shared the cores)
        assert alpha >= 0 and beta >= 0
        assert cost.collective_time(kind, 1 << 20) > 0  # no collective is free


@pytest.mark.distributed
def test_measured_stage3_step_has_both_tracks(two_rank_run):
    for run in two_rank_run:
        measured: Schedule = run["measured"]
        assert run["graph_count"] == 1  # no graph break: one forward and one backward graph
        # every collective the graphs hold ran and was paired with its wait
        assert measured.collective_counts() == run["in_graphs"]
        assert {"all_gather", "reduce_scatter"} <= set(run["in_graphs"])
        assert measured.track("compute") and measured.compute_s > 0
        assert 0 < measured.exposed_comm_s <= measured.comm_s <= measured.step_s
        assert measured.step_s >= measured.compute_s


@pytest.mark.distributed
def test_predicted_stage3_step_has_the_graphs_collectives(two_rank_run):
    for run in two_rank_run:
        predicted: Schedule = run["predicted"]
        assert predicted.collective_counts() == run["in_graphs"]
        assert predicted.step_s >= max(predicted.compute_s, predicted.comm_s)
        assert predicted.exposed_comm_s <= predicted.comm_s
