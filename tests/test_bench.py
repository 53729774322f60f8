"""``zerograph bench`` (the ``zerograph/bench/`` package): a tiny grid at world size 2 on CPU, checked
through the JSON it writes, plus the pure helpers (system names, cluster table, time attribution)
on their own, the validation of every flag before any rank starts, and how a failed rank is reported.

The grid runs once per module (``bench.main`` launches its own two gloo ranks) and is shared by
the tests that read its JSON.
"""
from __future__ import annotations

import json
import math
import os
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from tests import forkserver
from tests.distributed import spawn
from zerograph import bench
from zerograph.bench.profiling import profile_run
from zerograph.config import Config
from zerograph.errors import ConfigError
from zerograph.graph.costmodel import WAIT
from zerograph.graph.ops import GATHER_ACTIVATION
from zerograph.policies import MemoryPolicy

SYSTEMS = ["zerograph-s0", "zerograph-s1", "zerograph-s2", "zerograph-s3", "ddp", "fsdp2"]
VOCAB = 256  # the GPT example's byte vocabulary


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory) -> tuple[dict, str]:
    """The grid's ranks fork from the tests' warm server where this process has it, so they pay
    no imports and no first-compile warm-up; the spawned path is
    ``test_failed_rank_is_reported_in_a_few_lines``'."""
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = os.path.join(out, "bench.json"), os.path.join(out, "bench.png")
    start_method = "forkserver" if forkserver.context() is not None else "spawn"
    status = bench.main(["--model", "tiny", "--nproc", "2", "--start-method", start_method, "--steps", "2", "--warmup", "1",
                         "--profile-steps", "1", "--batch-size", "4", "--systems", ",".join(SYSTEMS),
                         "--simulate", "local,8xH100-nvlink", "--json", json_path, "--png", png_path])
    assert status == 0
    with open(json_path) as f:
        return json.load(f), png_path


@pytest.mark.distributed
def test_every_system_is_timed(tiny_grid):
    result, _ = tiny_grid
    assert list(result["systems"]) == SYSTEMS
    tokens = result["model"]["tokens_per_step"]
    assert tokens == 4 * result["model"]["block_size"]  # global batch x sequence length
    for name, s in result["systems"].items():
        assert len(s["step_s"]) == 2 and len(s["warmup_s"]) == 1, name
        assert all(len(per_rank) == 2 for per_rank in s["step_s_per_rank"])
        # a step counts as its slowest rank
        assert s["step_s"] == [max(r[i] for r in s["step_s_per_rank"]) for i in range(2)]
        assert 0 < s["min_s"] <= s["median_s"] <= s["max_s"]
        assert s["tokens_per_s"] == pytest.approx(tokens / s["median_s"])
        assert 0 <= s["exposed_comm_s"] <= s["comm_in_flight_s"] + 1e-9, name
        assert s["peak_memory_bytes"] > 0  # model and optimizer states at least
        assert all(m["method"] == "VmHWM" for m in s["memory_per_rank"])
        # the allocator's bytes: state held at the step start (from tensors) + the step's own peak
        assert s["state_bytes"] > 0 and s["step_peak_alloc_bytes"] > 0, name
        assert s["state_plus_peak_bytes"] >= s["state_bytes"]
        for rank in s["allocations_per_rank"]:
            assert len(rank["step_peak_bytes"]) == 1 and min(rank["step_peak_bytes"]) > 0
            held = rank["state_bytes_by_kind"]
            assert held["params"] > 0 and held["optimizer_states"] > 0, name
    # ZeRO-3 and FSDP2 hold a shard of the parameters, DDP all of them
    held = {name: s["allocations_per_rank"][0]["state_bytes_by_kind"] for name, s in result["systems"].items()}
    assert held["zerograph-s3"]["params"] < held["ddp"]["params"]
    assert held["fsdp2"]["params"] < held["ddp"]["params"]
    assert "peak alloc +MiB" in bench.format_report(result)
    for name, s in result["systems"].items():  # what made each system's highest point, named by op
        at_peak = s["allocations_per_rank"][0]["at_peak"]
        assert at_peak and all(e["bytes"] > 0 and e["ops"] for e in at_peak), name
    assert "at the highest allocation point" in bench.format_report(result)


@pytest.mark.distributed
def test_step1_losses_are_equal_across_systems(tiny_grid):
    result, _ = tiny_grid
    first = [s["losses"][0] for s in result["systems"].values()]
    assert max(first) - min(first) <= 1e-5
    assert result["loss_check"]["step1_max_abs_diff"] == pytest.approx(max(first) - min(first))
    # a freshly initialised byte-level model predicts roughly uniformly: loss near ln(vocab)
    assert abs(first[0] - math.log(VOCAB)) < 0.1
    assert all(len(s["losses"]) == 3 for s in result["systems"].values())  # warm-up + timed steps


@pytest.mark.distributed
def test_bytes_moved_are_the_papers_2psi_and_3psi(tiny_grid):
    """Ratio to Ψ within [ideal, ideal * padded Ψ / Ψ]: sharded collectives move padded shards."""
    result, _ = tiny_grid
    psi, padded = result["model"]["psi"], result["model"]["psi_padded"]
    systems = result["systems"]
    for name in ("zerograph-s0", "zerograph-s1", "zerograph-s2", "zerograph-s3", "ddp"):
        s = systems[name]
        ideal = 3 if name == "zerograph-s3" else 2
        assert s["paper_ratio"] == ideal
        assert ideal - 1e-9 <= s["comm_ratio"] <= ideal * padded / psi + 1e-9, (name, s["comm_ratio"])
    for name in ("zerograph-s0", "ddp"):  # all-reduce only, counted twice
        assert systems[name]["comm_elements"]["all_gather"] == systems[name]["comm_elements"]["reduce_scatter"] == 0
    for name in ("zerograph-s1", "zerograph-s2"):  # one gather, one reduce-scatter of every parameter
        e = systems[name]["comm_elements"]
        assert e["all_gather"] == e["reduce_scatter"] > 0
    e = systems["zerograph-s3"]["comm_elements"]
    assert e["all_gather"] == 2 * e["reduce_scatter"] > 0  # gathered again in backward
    # FSDP2 gathers in forward and backward but keeps the root unit from forward to backward
    fsdp2 = systems["fsdp2"]
    assert fsdp2["paper_ratio"] == 3
    assert 2 < fsdp2["comm_ratio"] <= 3 * padded / psi + 1e-9
    assert fsdp2["comm_elements"]["all_reduce"] == 0


@pytest.mark.distributed
def test_json_describes_the_machine(tiny_grid):
    result, _ = tiny_grid
    machine = result["machine"]
    assert machine["torch"] == torch.__version__
    assert machine["cpu_count"] == os.cpu_count()
    assert machine["world_size"] == 2 and machine["backend"] == "gloo" and machine["device"] == "cpu"
    assert machine["platform"] and machine["device_name"] and machine["python"]
    assert set(result["definitions"]) == {"step_time", "exposed_comm", "peak_memory", "allocated",
                                          "comm_volume"}
    assert result["command"].startswith("zerograph bench ") and "--systems" in result["command"]


@pytest.mark.distributed
def test_png_is_written(tiny_grid):
    from matplotlib.image import imread

    _, png_path = tiny_grid
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    height, width, _channels = imread(png_path).shape
    assert height > 100 and width > 100


@pytest.mark.distributed
def test_simulation_projects_every_zerograph_system(tiny_grid):
    result, _ = tiny_grid
    clusters = result["simulate"]["clusters"]
    assert clusters["local"]["world_size"] == 2 and clusters["local"]["scale"] == 1.0
    assert clusters["8xH100-nvlink"]["world_size"] == 8 and clusters["8xH100-nvlink"]["assumptions"]
    for name in SYSTEMS[:4]:
        sim = result["systems"][name]["simulate"]
        assert sim["matched_node_fraction"] > 0.9  # eager lowering: graph ops map to profile events
        for cluster in ("local", "8xH100-nvlink"):
            p = sim[cluster]
            assert p["step_s"] >= p["graphs_step_s"] >= p["exposed_comm_s"] >= 0
            assert p["exposed_comm_s"] <= p["comm_s"]
        # a faster device: the projected step is shorter than the one measured here
        assert sim["8xH100-nvlink"]["step_s"] < sim["local"]["step_s"]
        check = result["simulate"]["self_check"][name]
        assert check["measured_median_s"] == result["systems"][name]["median_s"]
        assert check["measured_profiled_step_s"] == sim["profiled_step_s"]
        assert check["predicted_s"] == sim["local"]["step_s"]
        assert math.isfinite(check["relative_error"]) and math.isfinite(check["relative_error_vs_median"])
    # ZeRO-3 model states shrink with the world size (zerograph.plan)
    s3 = result["systems"]["zerograph-s3"]["simulate"]
    assert (s3["8xH100-nvlink"]["model_state_bytes_per_rank"]["formula"]
            < s3["local"]["model_state_bytes_per_rank"]["formula"])
    assert "self-check zerograph-s3" in bench.format_simulation(result)


# ---------------------------------------------------------------------------------------------
# helpers, no processes


def test_priming_runs_one_model_per_kind_and_leaves_no_bytes_held():
    """``prime_systems`` builds and steps one tiny model per kind of system (so the first measured
    system does not pay alone for the process's one-time costs) and keeps none of it: once the
    bench releases its caches, no buffer pool, runtime or parameter of a primed model is alive."""
    import gc

    from zerograph.bench import runner
    from zerograph.runtime import buffer_pool
    from zerograph.runtime.runtime import Runtime

    from .distributed import fake_rank

    defaults = Config()
    specs = bench.parse_systems("zerograph-s3,zerograph-s1-pool,zerograph-s3-noov",
                                defaults.schedule.prefetch_depth, defaults.schedule.bucket_bytes)
    first_pool = next(buffer_pool._POOL_IDS)
    def runtimes() -> list:  # type(), not isinstance(): a dead weakref.proxy in gc's list raises on isinstance
        return [o for o in gc.get_objects() if type(o) is Runtime]

    runtimes_before = {id(o) for o in runtimes()}
    with fake_rank(2, 0):
        primed = runner.prime_systems(specs, torch.device("cpu"), 1e-3)
        runner._release_memory(torch.device("cpu"))
    assert [s.name for s in primed] == ["zerograph-s3"]  # one per (kind, compiled, lowering)
    new_pools = [ref for pool_id, ref in buffer_pool._POOLS.items() if pool_id > first_pool]
    assert new_pools, "the primed zerograph-s3 model made no buffer pool: it did not compile"
    assert [ref() for ref in new_pools if ref() is not None] == []
    assert [o for o in runtimes() if id(o) not in runtimes_before] == []


def test_system_names_parse():
    spec = bench.parse_system("zerograph-s3-noov-pf2-bb65536-inductor", prefetch_depth=1, bucket_bytes=0)
    config = spec.config
    assert (spec.kind, spec.stage, config.schedule.prefetch_depth, config.schedule.bucket_bytes, config.lowering) == (
        "zerograph", 3, 2, 65536, "inductor")
    assert config.disabled_passes == ("prefetch", "schedule_overlap") and not config.memory.pool_comm_buffers
    assert bench.parse_system("zerograph-s3-pool", 1, 0).config.memory.pool_comm_buffers
    with pytest.raises(ConfigError, match="lowering='inductor' plans its own buffers"):
        bench.parse_system("zerograph-s3-pool-inductor", 1, 0)
    with pytest.raises(ConfigError, match="-nopool is gone"):
        bench.parse_system("zerograph-s3-nopool", 1, 0)
    default = bench.parse_system("zerograph-s1", prefetch_depth=3, bucket_bytes=1024).config
    assert (default.schedule.prefetch_depth, default.schedule.bucket_bytes, default.disabled_passes, default.lowering) == (
        3, 1024, (), "eager") and not default.memory.pool_comm_buffers
    assert default.unit_templates == Config().unit_templates  # what no modifier sets is Config's default
    assert bench.parse_system("fsdp2-compile", 1, 0).compiled
    quantized = bench.parse_system("zerograph-s3-qw-qg", 1, 0).config
    assert (quantized.gather_quantization, quantized.reduce_quantization) == ("int8", "int8")
    assert bench.parse_system("zerograph-s3-qg", 1, 0).config.gather_quantization is None
    assert bench.parse_system("zerograph-s3-inductor-islands", 1, 0).config.inductor_islands
    assert not config.inductor_islands
    assert bench.parse_system("zerograph-s3-keeproot-notpl", 1, 0).config == Config(
        lowering="eager", memory=MemoryPolicy(reshard_root_after_forward=False), unit_templates=False)
    assert json.loads(json.dumps(spec.describe()))["config"]["disabled_passes"] == list(config.disabled_passes)
    assert [bench.parse_system(n, 1, 0).paper_volume for n in ("zerograph-s2", "zerograph-s3", "ddp", "fsdp2")] == [2, 3, 2, 3]
    for bad, match in (("zerograph-s4", "unknown system"), ("zerograph-s3-fast", "unknown system"),
                       ("deepspeed", "unknown system"), ("zerograph-s3-islands", "lowering='eager' runs no Inductor"),
                       ("zerograph-s3-tpl-notpl", "both set Config.unit_templates")):
        with pytest.raises(ConfigError, match=match):
            bench.parse_system(bad, 1, 0)
    with pytest.raises(ConfigError):
        bench.parse_systems("ddp,ddp", 1, 0)


def test_bad_arguments_exit_2(capsys):
    assert bench.main(["--systems", "nope"]) == 2
    assert bench.main(["--steps", "0"]) == 2
    assert bench.main(["--simulate", "no-such-cluster"]) == 2
    assert "no-such-cluster" in capsys.readouterr().err


def test_cluster_table_gives_alpha_beta_from_bus_bandwidth():
    table = bench.load_cluster_table(bench.CLUSTERS_FILE)
    assert {"8xH100-nvlink", "2x8xH100-ib"} <= set(table)
    entry = table["8xH100-nvlink"]
    cost = bench.cluster_cost_model(entry)
    n = entry["nodes"] * entry["devices_per_node"]
    assert cost.world_size == n
    busbw, latency = entry["bus_bandwidth_bytes_per_s"], entry["latency_s"]
    size = 64 * 2**20
    assert cost.collective_time("all_gather", size) == pytest.approx(latency + (n - 1) / n * size / busbw)
    assert cost.collective_time("all_reduce", size) == pytest.approx(latency + 2 * (n - 1) / n * size / busbw)
    assert bench.cluster_cost_model(table["2x8xH100-ib"]).world_size == 16
    with pytest.raises(ConfigError):
        bench.cluster_cost_model({"nodes": 1})


def test_mesh_dims_are_priced_on_the_links_they_map_onto():
    table = bench.load_cluster_table(bench.CLUSTERS_FILE)
    entry = table["48x8xH100-ib"]
    links = bench.cluster_links(entry)
    size = 64 * 2**20
    for link, n, prefix in ((links.node, 8, "node"), (links.cross_node, 48, "cross_node")):
        busbw, latency = entry[f"{prefix}_bus_bandwidth_bytes_per_s"], entry[f"{prefix}_latency_s"]
        assert link.world_size == n
        assert link.collective_time("all_gather", size) == pytest.approx(latency + (n - 1) / n * size / busbw)
        assert link.collective_time("all_reduce", size) == pytest.approx(latency + 2 * (n - 1) / n * size / busbw)
    assert links.world == bench.cluster_cost_model(entry)

    # hybrid sharding measured as 2 x 2: shard dim -> one node; replicate dim -> the cross-node ring,
    # all-reducing a shard 2/8 the size of the one measured (the node shards over 8, not 2)
    hybrid = bench.group_cost_models(links, {"s": ("shard", 2), "r": ("replicate", 2)}, shard_size=2)
    assert hybrid["s"] == links.node
    assert hybrid["r"].collective_time("all_reduce", size) == pytest.approx(
        links.cross_node.collective_time("all_reduce", size * 2 // 8))
    # hpZ: the secondary group is one node; a 1-D shard dim stays on the world ring (no entry)
    assert bench.group_cost_models(links, {"w": ("shard", 4), "n": ("secondary", 2)}, shard_size=4) == {"n": links.node}
    assert bench.group_cost_models(links, {"w": ("shard", 4)}, shard_size=4) == {}

    # an entry without node / cross-node figures prices both rings as the world's
    plain = {k: v for k, v in entry.items() if not k.startswith(("node_", "cross_node_"))}
    fallback = bench.cluster_links(plain)
    assert fallback.node.collectives["all_gather"][0] == entry["latency_s"]
    assert fallback.node.collective_time("all_gather", size) == pytest.approx(
        entry["latency_s"] + 7 / 8 * size / entry["bus_bandwidth_bytes_per_s"])


def test_every_group_a_graph_communicates_over_is_mapped_to_its_dim():
    """hpZ's node group appears only in ``gather_activation`` (no functional collective): it must
    still reach ``group_cost_models``, or its re-gathers are priced on the world ring."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    gathered = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 4, "world"))
    regathered = graph.call_function(GATHER_ACTIVATION, (x, [8], "node", 2))
    graph.output((gathered, regathered))
    sizes = {"world": ("shard", 4), "node": ("secondary", 2)}
    assert bench.mesh_dims_of([fx.GraphModule({}, graph)], sizes.__getitem__) == sizes


def test_a_bad_cluster_table_is_refused_naming_the_field(tmp_path):
    entry = bench.load_cluster_table(bench.CLUSTERS_FILE)["2x8xH100-ib"]
    for field, value, match in (("node_bus_bandwidth_bytes_per_s", True, "must be a finite number"),
                                ("node_bus_bandwidth_bytes_per_s", "4.5e11", "must be a finite number"),
                                ("cross_node_bus_bandwidth_bytes_per_s", 0, "must be > 0"),
                                ("nodes", 1.5, "whole number"), ("latency_s", float("inf"), "finite")):
        with pytest.raises(ConfigError, match=f"{field}.*{match}"):
            bench.cluster_links({**entry, field: value})
    with pytest.raises(ConfigError, match="has no 'flops_per_s'"):
        bench.cluster_links({k: v for k, v in entry.items() if k != "flops_per_s"})
    listed = tmp_path / "clusters.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        bench.load_cluster_table(listed)


def test_hybrid_and_hpz_systems_parse_and_refuse_a_world_that_cannot_hold_them():
    hsdp, hpz = bench.parse_system("zerograph-s3-hsdp2", 1, 0), bench.parse_system("zerograph-s3-qw-hpz2", 1, 0)
    assert (hsdp.shard_size, hsdp.config.secondary_partition_size) == (2, None)
    assert (hpz.shard_size, hpz.config.secondary_partition_size, hpz.config.gather_quantization) == (None, 2, "int8")
    bench.check_world_size(hsdp, 4)
    for spec, world_size in ((hsdp, 2), (hpz, 3), (bench.parse_system("zerograph-s3-hsdp1", 1, 0), 4)):
        with pytest.raises(ConfigError, match="divides the world size"):
            bench.check_world_size(spec, world_size)
    with pytest.raises(ConfigError, match="do not combine"):
        bench.parse_system("zerograph-s3-hsdp2-hpz2", 1, 0)
    with pytest.raises(ConfigError, match="stage 1-3"):
        bench.parse_system("zerograph-s0-hsdp2", 1, 0)
    with pytest.raises(ConfigError, match="needs stage 3"):
        bench.parse_system("zerograph-s2-hpz2", 1, 0)
    with pytest.raises(ConfigError, match="repeats the modifier"):
        bench.parse_system("zerograph-s3-hsdp4-hsdp2", 1, 0)
    with pytest.raises(ConfigError, match="need stage 1-3"):
        bench.parse_system("zerograph-s0-qw", 1, 0)
    assert bench.main(["--nproc", "2", "--systems", "zerograph-s3-hsdp2"]) == 2


def test_padded_params_count_shard0_chunks():
    layer = nn.Linear(3, 5)  # weight (5, 3), bias (5,)
    assert bench.unique_params(layer) == 20
    # 5 rows in 2 chunks of 3 rows: weight 2 * 3 * 3 = 18, bias 2 * 3 = 6
    assert bench.padded_params(layer, 2) == 24
    assert bench.padded_params(layer, 1) == 20


def _event(start_us: float, end_us: float, name: str = "op") -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start_us, end=end_us))


def test_region_time_goes_to_nodes_and_waits_are_left_out():
    """Each node gets its event plus the gap after it; a wait's blocked time goes to no node."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    w = graph.call_function(WAIT, (a,))
    b = graph.call_function(torch.ops.aten.neg.default, (w,))
    graph.output(b)
    region = _event(0, 100)
    pairs = [(_event(5, 20), a), (_event(30, 80), w), (_event(85, 95), b)]
    seconds = bench.attribute_seconds(region, pairs)
    assert set(seconds) == {a, b}
    # a: 5 us before it (nothing earlier) + its 15 us + 10 us gap before the wait
    assert seconds[a] == pytest.approx(30e-6)
    # b: 5 us gap after the wait + its 10 us + 5 us tail of the region
    assert seconds[b] == pytest.approx(20e-6)
    # everything but the wait's 50 us is accounted for
    assert sum(seconds.values()) == pytest.approx(100e-6 - 50e-6)


def test_unmatched_graph_time_is_spread_by_roofline():
    """Fused code: the region's time less its waits is shared in proportion to the cost model."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zerograph.graph.costmodel import CostModel

    gm = make_fx(lambda x, w: torch.mm(x, w).relu())(torch.randn(64, 32), torch.randn(32, 16))
    cost = CostModel(world_size=1, flops_per_s=1e9, bytes_per_s=1e9, op_overhead_s=1e-6, collectives={})
    region = _event(0, 1000)
    ops = [_event(100, 300, WAIT._schema.name), _event(300, 400, "graph_0_cpp_fused_relu")]
    seconds = bench.roofline_seconds(region, ops, gm.graph, cost)
    assert sum(seconds.values()) == pytest.approx(800e-6)  # 1000 us less the 200 us wait
    mm, relu = (n for n in gm.graph.nodes if n.op == "call_function")
    assert seconds[mm] / seconds[relu] == pytest.approx(cost.node_time(mm) / cost.node_time(relu))


def test_match_nodes_skips_events_no_node_claims():
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    b = graph.call_function(torch.ops.aten.neg.default, (a,))
    graph.output(b)
    ops = [_event(0, 1, "c10d::_allgather_base_"), _event(1, 2, "aten::relu"), _event(2, 3, "aten::neg")]
    assert [(e.name, n) for e, n in bench.match_nodes(graph, ops)] == [("aten::relu", a), ("aten::neg", b)]


def test_format_table_aligns_columns():
    text = bench.format_table(["system", "ms"], [["ddp", "1.5"], ["zerograph-s3", "12.25"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1  # every line the same width
    assert lines[1].split() == ["-" * len("zerograph-s3"), "-" * len("12.25")]
    assert lines[2].startswith("ddp ") and lines[2].endswith("  1.5")


def test_peak_allocations_names_what_was_alive_at_the_highest_point():
    """Allocate A (1 MiB) and B (2 MiB) inside ``first``, free A, allocate C (0.5 MiB) inside
    ``second``: the highest point is A + B (3 MiB, not B + C), so C is not named."""
    with torch.profiler.profile(profile_memory=True) as prof:
        with torch.profiler.record_function("first"):
            a = torch.empty(2**20, dtype=torch.uint8)
            b = torch.empty(2 * 2**20, dtype=torch.uint8)
        del a
        with torch.profiler.record_function("second"):
            c = torch.empty(2**19, dtype=torch.uint8)
    del b, c
    entries = bench.peak_allocations(prof.profiler.kineto_results.experimental_event_tree(), torch.device("cpu"))
    assert [e["bytes"] for e in entries] == [3 * 2**20]  # A and B, both from aten::empty inside "first"
    assert entries[0]["ops"].startswith("aten::empty") and "first" in entries[0]["ops"]


# ---------------------------------------------------------------------------------------------
# flags validated before any rank starts, so a typo costs no launch: one line naming the flag, exit 2


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the bench would start a rank: validation must refuse first."""
    from zerograph.bench import cli

    def launched(*args, **kwargs):
        raise AssertionError("the bench launched ranks despite a bad flag")

    monkeypatch.setattr(cli, "launch", launched)
    monkeypatch.setattr(cli, "rank_main", launched)


def _refused(capsys, argv: list[str], flag: str) -> str:
    """``bench.main(argv)`` returns 2 and prints exactly one line, which names ``flag``."""
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("zerograph bench: ") and flag in err, err
    return err


TINY = ["--model", "tiny", "--systems", "ddp", "--steps", "1"]


def test_batch_size_and_seq_len_must_be_positive(capsys, no_launch):
    _refused(capsys, [*TINY, "--batch-size", "0"], "--batch-size")  # was: exit 0 with loss nan
    _refused(capsys, [*TINY, "--seq-len", "0"], "--seq-len")       # was: ZeroDivisionError in a rank
    _refused(capsys, [*TINY, "--lr", "nan"], "--lr")
    _refused(capsys, [*TINY, "--lr", "-1"], "--lr")


def test_batch_must_split_evenly_over_the_ranks(capsys, no_launch):
    err = _refused(capsys, [*TINY, "--batch-size", "3", "--nproc", "2"], "--batch-size")
    assert "divisible" in err and "--nproc" in err


def test_factory_that_cannot_be_imported_is_refused(capsys, no_launch, tmp_path, monkeypatch):
    err = _refused(capsys, [*TINY, "--model", "zerograph_no_such_module:factory"], "--model")
    assert "zerograph_no_such_module" in err and "ModuleNotFoundError" in err
    err = _refused(capsys, [*TINY, "--model", "json:no_such_factory"], "--model")
    assert "no_such_factory" in err
    (tmp_path / "zerograph_broken_factory.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _refused(capsys, [*TINY, "--model", "zerograph_broken_factory:factory"], "--model")
    assert "broken at import" in err
    _refused(capsys, [*TINY, "--model", ":factory"], "--model")


def test_output_paths_are_checked_before_the_run(capsys, no_launch, tmp_path):
    missing_dir = str(tmp_path / "no" / "such" / "dir" / "bench.json")
    err = _refused(capsys, [*TINY, "--json", missing_dir], "--json")
    assert "does not exist" in err
    _refused(capsys, [*TINY, "--json", str(tmp_path)], "--json")  # a directory
    _refused(capsys, [*TINY, "--png", str(tmp_path / "no" / "chart.png")], "--png")
    _refused(capsys, [*TINY, "--png", str(tmp_path / "chart.docx")], "--png")  # not a format matplotlib writes
    same = str(tmp_path / "out")
    _refused(capsys, [*TINY, "--json", same, "--png", same], "--json")


def test_validation_accepts_good_flags_and_leaves_no_file(tmp_path):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    args = bench.build_parser().parse_args([*TINY, "--batch-size", "4", "--json", str(json_path),
                                            "--png", str(png_path), "--simulate", "local,8xH100-nvlink"])
    bench.validate_args(args)
    assert not json_path.exists() and not png_path.exists()  # tried, then removed again
    json_path.write_text("previous")
    bench.validate_args(args)
    assert json_path.read_text() == "previous"  # an existing file is left as it was until the report


def test_nccl_needs_a_gpu_per_rank(capsys, no_launch, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _refused(capsys, [*TINY, "--nproc", "2", "--batch-size", "4"], "--nproc")
    assert "--backend gloo" in err


# ---------------------------------------------------------------------------------------------
# the profiler stops only after the collectives its steps started have finished


# how long gloo's worker thread is held after a work's future completes, before it runs the
# profiler's end callback: longer than stopping a profile of a few events takes
HOLD_S = 1.0


def _future_waited_step_finishes_inside_profile(rank: int, world_size: int) -> bool:
    """Rank 0 profiles a step that waits on an all-reduce's future (as DDP's reducer does) while a
    callback on that future holds gloo's worker thread; returns whether the work had finished, its
    profiler end callback included, when ``profile_run`` returned."""
    store = dist.distributed_c10d._get_default_store()
    works: list[dist.Work] = []

    def step() -> None:
        if rank == 1:  # joins the all-reduce only once rank 0's future has its callback
            store.wait(["callback attached"])
        work = dist.all_reduce(torch.ones(8), async_op=True)
        future = work.get_future()
        if rank == 0:
            assert not future.done()
            # the future is pending, so this runs on gloo's worker thread, between completing the
            # future and finishing the work
            future.add_done_callback(lambda _: time.sleep(HOLD_S))
            store.set("callback attached", "1")
        future.wait()
        works.append(work)

    profile_run(step, 1, torch.device("cpu"))
    return works[0].is_completed()


@pytest.mark.distributed
def test_profile_ends_after_the_collectives_its_steps_waited_on_by_future():
    """gloo completes a work's future before its worker thread runs the profiler's end callback;
    a profile that stopped in between freed the event that callback then writes (a heap
    corruption glibc reported later, at an unrelated free). ``profile_run`` drains first."""
    assert spawn(_future_waited_step_finishes_inside_profile, 2) == [True, True]


# ---------------------------------------------------------------------------------------------
# a failed rank: its own exception first, in a few lines


def _failure_with_error_file(tmp_path, monkeypatch, rank: int, exc: BaseException) -> object:
    """A ``ProcessFailure`` as elastic's launcher builds it from the error file a rank's ``record``
    wrapper writes (``ErrorHandler.record_exception``), with the exception's real traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors.error_handler import (
        ErrorHandler,
    )

    error_file = str(tmp_path / f"error{rank}.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
    try:
        raise exc
    except type(exc) as raised:
        ErrorHandler().record_exception(raised)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=error_file)


def test_rank_failure_names_the_real_error_first(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    failed = _failure_with_error_file(tmp_path, monkeypatch, 1, ValueError("batch_fn got rank 1\nsecond line"))
    stopped = ProcessFailure(local_rank=0, pid=1000, exitcode=-15, error_file=str(tmp_path / "none.json"))
    text = bench.describe_rank_failure(ChildFailedError("rank_main", {0: stopped, 1: failed}))
    lines = text.splitlines()
    assert lines[0] == "zerograph bench: rank 1 failed: ValueError: batch_fn got rank 1"
    assert lines[1] == "  second line"
    assert lines[2].startswith("  raised at ") and "test_bench.py:" in lines[2]
    assert "rank 0: Signal 15" in lines[3]
    assert lines[4] == f"  full traceback: {failed.error_file}"
    assert len(lines) == 5


@pytest.mark.slow  # launches ranks through torchrun: about 12 CPU s of process starts and imports
def test_failed_rank_is_reported_in_a_few_lines(tmp_path, monkeypatch, capsys):
    """End to end: a factory whose batches fail makes both ranks raise; the bench exits 1 and its
    stderr starts with the ranks' own exception, not the launcher's tracebacks."""
    (tmp_path / "zerograph_failing_factory.py").write_text(
        "import torch\n"
        "def factory():\n"
        "    def batch(step, rank, world_size):\n"
        "        raise ValueError(f'no batch for rank {rank}')\n"
        "    return torch.nn.Linear(2, 1), batch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status = bench.main(["--model", "zerograph_failing_factory:factory", "--nproc", "2", "--systems", "ddp",
                         "--steps", "1", "--warmup", "0", "--profile-steps", "0"])
    assert status == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("zerograph bench: rank ") and "ValueError: no batch for rank" in lines[0], err
    assert "zerograph_failing_factory.py:4 in batch" in err
    assert len(lines) <= 5, err
