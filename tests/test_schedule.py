"""The scheduling passes: bucketing, prefetch and schedule_overlap, read off real graphs.

Each check compiles the tiny GPT (2 blocks + the root unit) as rank 0 of a fake world of 2 in this
process (``zerograph.fake_world``), trains one step and looks at where the passes put every
collective's start and wait relative to the compute that needs it, and at a profiled second step.
Parity with all passes on is covered by test_parity (the default pipeline); here also with a byte
cap and a deeper prefetch (spawned gloo ranks), whose rank 0's graphs the checks of those
schedules read (a graph of rank 0 of a real world is the fake world's).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx

import zerograph
from zerograph.graph.vocab import TAG
from zerograph.passes._fx import find_collectives, is_alias_of_input
from zerograph.runtime.state import graphs_of, runtime_of_model

from .distributed import run_as_rank, spawn
from .models import build, global_batch, rank_slice, reference_training
from .test_parity import LR, STEPS, check_parity
from .training import train_steps

# six compiles in this process before the first check: outside `make test-fast`
pytestmark = pytest.mark.slow


def _depends_on(nodes: list[fx.Node], source: fx.Node) -> set[fx.Node]:
    reached = {source}
    for node in nodes:
        if any(i in reached for i in node.all_input_nodes):
            reached.add(node)
    return reached


def schedule_facts(gm: fx.GraphModule) -> dict:
    """Plain data about one graph: per collective its kind, units, start/wait positions; per unit
    the first compute op reading its gathered parameters; and which compute is independent of
    each reduction."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    compute = [n for n in nodes if n.op == "call_function" and TAG not in n.meta and not is_alias_of_input(n)]
    collectives, first_compute = [], {}
    for c in find_collectives(gm.graph):
        entry = {"kind": c.kind, "role": c.role, "units": c.units, "start": pos[c.start], "wait": pos[c.wait],
                 "between": sum(1 for n in compute if pos[c.start] < pos[n] < pos[c.wait])}
        if c.role == "gather":
            outs = [n for n in c.finish if n.users]
            users = [u for o in outs for u in o.users if u not in c.finish]
            first_compute[c.units[0]] = min((pos[u] for u in users), default=None)
        else:
            needs = _depends_on(nodes, c.wait)
            entry["last_independent_compute"] = max((pos[n] for n in compute if n not in needs), default=-1)
        collectives.append(entry)
    return {"collectives": collectives, "first_compute": first_compute}


def model_facts(model: torch.nn.Module) -> dict:
    """``schedule_facts`` of the forward and backward of ``model``'s first graph, its units, and
    how many of its parameters are sharded."""
    record = graphs_of(model)[0]
    runtime = runtime_of_model(model)
    return {"forward": schedule_facts(record["forward"]), "backward": schedule_facts(record["backward"]),
            "units": [u.name for u in runtime.units],
            "sharded_params": sum(1 for layout in runtime.layouts.values() if layout.sharded)}


def one_step_facts(stage: int, config_kwargs: dict, rank: int, world_size: int, profiled: bool) -> dict:
    """With ``profiled``, also a profiled second step (``measured``)."""
    torch._dynamo.reset()  # one process compiles many models of one class: stay under Dynamo's recompile limit
    model = zerograph.compile(build("gpt"), stage=stage, config=zerograph.Config(**config_kwargs))
    batch = rank_slice(global_batch("gpt", 0, 4), rank, world_size)
    model(*batch).backward()
    facts = model_facts(model)
    if profiled:
        measured = zerograph.measure(lambda: model(*batch).backward(), warmup=0)
        facts["measured"] = {"overlap_s": measured.overlap_s(), "collectives": measured.collective_counts()}
    return facts


SCHEDULES = {
    "default": {},
    "depth2": {"schedule": zerograph.SchedulePolicy(prefetch_depth=2)},
    "deep_unbounded": {"schedule": zerograph.SchedulePolicy(prefetch_depth=8)},
    "no_overlap": {"disabled_passes": zerograph.config.OVERLAP_PASSES},
    # per parameter: without bucketing, each parameter its own collective (a flat shard is one anyway)
    "no_bucketing": {"disabled_passes": ("bucketing",), "unit_templates": False},
    "cap_all": {"schedule": zerograph.SchedulePolicy(bucket_bytes=1 << 30)},
}
# the in-process runs; the stage-3 runs under PARITY_SCHEDULES are read off the parity spawn's rank 0
RUNS = [(3, "default"), (3, "no_overlap"), (3, "deep_unbounded"), (2, "deep_unbounded"), (1, "deep_unbounded"),
        (2, "default")]
PARITY_SCHEDULES = ("depth2", "cap_all", "no_bucketing", "no_overlap")


# the runs whose profiled second step test_measured_step_has_collectives_in_flight_while_compute_runs reads
PROFILED = {(3, "default"), (3, "no_overlap")}


def all_facts(rank: int, world_size: int) -> dict:
    """Every (stage, schedule) the tests read, compiled one after another in one process group."""
    return {run: one_step_facts(run[0], SCHEDULES[run[1]], rank, world_size, run in PROFILED) for run in RUNS}


@functools.lru_cache(maxsize=None)
def _all_facts() -> dict:
    return run_as_rank(all_facts, 2)


def facts(stage: int, schedule: str) -> dict:
    return _all_facts()[(stage, schedule)]


def train_under_schedules(rank: int, world_size: int, schedules: tuple[str, ...]) -> dict:
    """Stage 3 under each schedule in turn: ``STEPS`` AdamW steps of the tiny GPT (losses, full
    parameters) and ``model_facts`` of its graphs."""
    results = {}
    for name in schedules:
        torch._dynamo.reset()
        model = zerograph.compile(build("gpt"), stage=3, config=zerograph.Config(**SCHEDULES[name]))
        _, losses = train_steps(model, lambda step, model=model: model(
            *rank_slice(global_batch("gpt", step, 4), rank, world_size)), STEPS, LR)
        results[name] = {"losses": losses, "params": {n: p.full_tensor() for n, p in model.named_parameters()},
                         **model_facts(model)}
    return results


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """Two gloo ranks, ``train_under_schedules`` over ``PARITY_SCHEDULES`` (one spawn for the
    parity test and the structure tests that read a schedule's graphs off rank 0)."""
    return spawn(train_under_schedules, 2, PARITY_SCHEDULES)


def gathers_in_use_order(graph: dict) -> list[dict]:
    return sorted((c for c in graph["collectives"] if c["role"] == "gather"), key=lambda c: c["wait"])


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_prefetch_starts_gather_before_compute_of_unit_depth_places_earlier(kind: str) -> None:
    _check_prefetch(facts(3, "default")[kind], 1)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_prefetch_depth_2_starts_gathers_two_units_earlier(spawned, kind: str) -> None:
    _check_prefetch(spawned[0]["depth2"][kind], 2)


def _check_prefetch(graph: dict, depth: int) -> None:
    gathers = gathers_in_use_order(graph)
    assert len(gathers) == 3  # root unit + 2 blocks, each gathered again in backward
    for i in range(depth, len(gathers)):
        earlier_unit = gathers[i - depth]["units"][0]
        assert gathers[i]["start"] < graph["first_compute"][earlier_unit], (i, gathers, graph["first_compute"])
    for i, gather in enumerate(gathers):  # and never later than the compute that needs it
        assert gather["wait"] < graph["first_compute"][gather["units"][0]]


def test_without_overlap_passes_each_wait_follows_its_start() -> None:
    for kind in ("forward", "backward"):
        for c in facts(3, "no_overlap")[kind]["collectives"]:
            assert c["between"] == 0, c
        # with them on, compute runs while gathers are in flight
        gathers = gathers_in_use_order(facts(3, "default")[kind])
        assert all(g["between"] > 0 for g in gathers[1:]), gathers


def test_measured_step_has_collectives_in_flight_while_compute_runs() -> None:
    """Profiled (torch.profiler) stage-3 step: with the overlap passes, compute ops run inside the
    in-flight interval of some collective [issue, end of its wait]; without them none does. In a
    fake world a collective completes at once, so this reads the order of the profiled ops (what
    the passes decide), not how long a transfer took, and holds however loaded the machine is."""
    on, off = facts(3, "default")["measured"], facts(3, "no_overlap")["measured"]
    assert on["collectives"] == off["collectives"] == {"all_gather": 6, "reduce_scatter": 3}
    assert on["overlap_s"] > 0
    assert off["overlap_s"] == pytest.approx(0, abs=1e-6)  # the profiler's µs clock, summed in floats


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reduction_waits_sink_past_all_independent_backward_compute(stage: int) -> None:
    """With the in-flight bound not binding (depth 8 > units), every reduction's wait comes after
    all backward compute that does not need its result."""
    reductions = [c for c in facts(stage, "deep_unbounded")["backward"]["collectives"] if c["role"] == "reduce"]
    assert reductions
    for c in reductions:
        assert c["wait"] > c["last_independent_compute"], c


@pytest.mark.parametrize("stage", [2, 3])
def test_reduction_waits_respect_the_inflight_bound(stage: int) -> None:
    """Default depth 1: one reduction in flight, waited before the next one is issued, after
    running beside the next bucket's backward compute."""
    reductions = sorted((c for c in facts(stage, "default")["backward"]["collectives"] if c["role"] == "reduce"),
                        key=lambda c: c["start"])
    assert len(reductions) == 3
    for current, following in zip(reductions, reductions[1:]):
        assert current["wait"] < following["start"]
        assert current["between"] > 0, current  # overlapped with compute


def test_bucketing_one_collective_per_unit() -> None:
    per_unit = facts(3, "default")
    n_units = len(per_unit["units"])
    for kind in ("forward", "backward"):
        gathers = [c for c in per_unit[kind]["collectives"] if c["role"] == "gather"]
        assert sorted(c["units"][0] for c in gathers) == list(range(n_units))
    reduces = [c for c in per_unit["backward"]["collectives"] if c["role"] == "reduce"]
    assert sorted(c["units"][0] for c in reduces) == list(range(n_units))


@pytest.mark.distributed
def test_bucketing_off_one_collective_per_parameter_and_a_cap_above_the_model_one_bucket(spawned) -> None:
    per_param = spawned[0]["no_bucketing"]
    gathers = [c for c in per_param["forward"]["collectives"] if c["role"] == "gather"]
    assert len(gathers) == per_param["sharded_params"]
    capped = spawned[0]["cap_all"]  # a cap above the model's size: one bucket of every unit
    n_units = len(capped["units"])
    assert n_units == 3  # the root unit and the two blocks
    for kind in ("forward", "backward"):
        gathers = [c for c in capped[kind]["collectives"] if c["role"] == "gather"]
        assert len(gathers) == 1 and sorted(gathers[0]["units"]) == list(range(n_units))


@pytest.mark.distributed
def test_parity_under_other_schedules(spawned) -> None:
    """Loss and parameters match single-process eager to 1e-5 under each schedule (the default
    one is test_parity's)."""
    reference = reference_training("gpt", STEPS, 4, LR)
    for by_schedule in spawned:
        for name in PARITY_SCHEDULES:
            check_parity(by_schedule[name], reference)
