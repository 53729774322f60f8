"""Hybrid sharding (``zerograph.compile(model, stage, mesh=2-D DeviceMesh)``): FSDP2's HSDP.

In-process (a fake world of 4 as a 2 x 2 mesh): placements, bytes per mesh dim against the
formulas and ``zerograph.plan``, and the refusals. Spawned (gloo, 4 ranks as 2 x 2, once for all):
parity with single-process eager training at stages 1-3, and a checkpoint saved on 2 x 2 and
loaded on a 1-D world of 4; then (2 ranks) on a 1 x 2 mesh.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import zerograph
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG, group_name_of
from zerograph.runtime.state import graphs_of, runtime_of_model

from .distributed import fake_rank, spawn
from .models import build, global_batch, rank_slice
from .workers_hybrid import MESH_DIMS, hybrid_reload, hybrid_training

ATOL = RTOL = 1e-5  # fp32, as tests/test_parity.py
STEPS, LR, BATCH = 3, 1e-3, 8  # 2 samples per rank at world size 4
# the uneven MLP pads every shard; the graph-break MLP reduces its last layer in an eager frame
# (EagerCollectives.reduce_grad); GPT ties wte / lm_head. The last run is the one checkpointed.
RUNS = (("mlp", 1), ("mlp", 2), ("mlp_break", 3), ("gpt", 3))
FORMULA_RUNS = (("mlp", 1), ("mlp", 2), ("gpt", 3))


def _unit_padded(model: torch.nn.Module) -> list[int]:
    """Padded elements of each unit's full buffer (``S * chunk_rows * row numel`` per parameter)."""
    rt = runtime_of_model(model)
    return [sum(rt.layouts[k].padded_numel for k in unit.keys) for unit in rt.units]


def expected_bytes_per_dim(stage: int, unit_padded: list[int], shards: int, replicas: int,
                           itemsize: int) -> dict[str, dict[str, int]]:
    """The bytes one rank sends per step per mesh dim, written out from the definitions (ring
    algorithms: (n-1)/n of the full buffer per all-gather / reduce-scatter, twice per all-reduce):
    shard dim, all-gather Ψ (2Ψ at stage 3: forward and backward) and reduce-scatter Ψ, Ψ padded;
    replicate dim, an all-reduce of this rank's reduced shard, Ψ/S."""
    gather_rounds = 2 if stage == 3 else 1
    return {
        "shard": {"all_gather": sum(gather_rounds * u * itemsize * (shards - 1) // shards for u in unit_padded),
                  "reduce_scatter": sum(u * itemsize * (shards - 1) // shards for u in unit_padded),
                  "all_reduce": 0},
        "replicate": {"all_gather": 0, "reduce_scatter": 0,
                      "all_reduce": sum(2 * (u // shards) * itemsize * (replicas - 1) // replicas
                                        for u in unit_padded)},
    }


def check_two_level_overlap(graph: fx.Graph) -> None:
    """Backward of a 2 x 2 mesh: per bucket a reduce-scatter (shard group) whose result is
    all-reduced (replicate group); both levels stay in flight during compute: reduce-scatter j
    has backward compute between its start and its wait (the next bucket's), and all-reduce j is
    waited only after reduce-scatter j + 1 is issued (``schedule_overlap``)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    scatters = [n for n in nodes if COLLECTIVE_KINDS.get(n.target) == "reduce_scatter"]
    assert len(scatters) >= 2
    for j, rs in enumerate(scatters):
        (wait,) = rs.users
        (ar,) = wait.users  # the all-reduce reads the reduce-scatter's result directly
        assert COLLECTIVE_KINDS.get(ar.target) == "all_reduce" and group_name_of(ar) != group_name_of(rs)
        (ar_wait,) = ar.users
        between = [n for n in nodes[pos[rs] + 1:pos[wait]] if n.op == "call_function" and TAG not in n.meta]
        if j + 1 < len(scatters):
            assert between, f"reduce-scatter {j} is waited right after it is issued: nothing overlaps it"
            assert pos[ar_wait] > pos[scatters[j + 1]], f"all-reduce {j} is waited before the next bucket's reduction"


# stage 3's 2Ψ of gathers needs every unit re-gathered in backward: the MLP's first layer is not
# (its weight's gradient needs only its input), the GPT's tied embedding / head is
@pytest.mark.parametrize("name, stage", FORMULA_RUNS)
def test_bytes_per_mesh_dim_match_the_formulas_and_the_plan(name: str, stage: int) -> None:
    with fake_rank(4, rank=3):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
        model = zerograph.compile(build(name), stage, mesh=mesh)
        for fqn, p in model.named_parameters():
            assert p.device_mesh == mesh and tuple(p.placements) == (Replicate(), Shard(0)), fqn
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(2):
            model(*rank_slice(global_batch(name, step, BATCH), 3, 4)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        stats = zerograph.stats(model, opt)
        padded = _unit_padded(model)
        expected = expected_bytes_per_dim(stage, padded, 2, 2, 4)
        assert stats.comm_bytes_per_dim == expected
        assert stats.replicas == 2 and stats.world_size == 2
        for kind in expected["shard"]:  # the totals are the sums over the dims
            assert stats.comm_bytes[kind] == expected["shard"][kind] + expected["replicate"][kind]
        # elements: the replicate all-reduce moves this rank's shard twice (ZeRO's section-7 count)
        assert stats.comm_elements_per_dim["replicate"]["all_reduce"] == 2 * sum(u // 2 for u in padded)
        planned = zerograph.plan(build(name), stage, 2, replicas=2, param_dtype=torch.float32)
        assert {d: dict(c) for d, c in planned.comm_bytes_per_dim.items()} == expected
        assert "comm over replicate dim" in str(planned)
        if stage == 3:
            check_two_level_overlap(graphs_of(model)[0]["backward"].graph)
        summary = zerograph.explain(model, opt)  # the dump's summary.md
        assert "rank 1 of 2 (shard dim; x 2 replicas)" in summary
        for dim in ("shard", "replicate"):
            sent = stats.comm_bytes_per_dim[dim]
            assert all(f"{k} {stats.comm_elements_per_dim[dim][k]:,} elements / {sent[k]:,} bytes" in summary
                       for k in sent if sent[k]), dim
        # shards are over S = 2: rank 3 is shard rank 1 (coordinate (1, 1)) and holds its rows of each
        rt = runtime_of_model(model)
        assert rt.topology.rank == 1 and list(mesh.get_coordinate()) == [1, 1]
        assert [tuple(p.to_local().shape) for p in model.parameters()] == [
            rt.layouts[k].local_shape(1) for k in sorted(rt.layouts)]


def test_plan_refuses_replicas_at_stage_0() -> None:
    with pytest.raises(zerograph.ConfigError, match="stage 1-3"):
        zerograph.plan(build("mlp"), 0, 2, replicas=2)


@pytest.mark.parametrize("case", ["with_process_group", "smaller_than_world", "three_dims", "misnamed",
                                  "swapped", "stage0", "not_a_mesh", "shard_dim_of_one"])
def test_bad_mesh_raises_a_clear_error(case: str) -> None:
    world = 8 if case == "three_dims" else 4
    with fake_rank(world, rank=0) as group:
        kwargs: dict = {}
        stage = 3
        if case == "with_process_group":
            mesh, kwargs["process_group"] = init_device_mesh("cpu", (2, 2)), group
            error, match = zerograph.ConfigError, "process_group or a mesh, not both"
        elif case == "smaller_than_world":
            mesh = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=MESH_DIMS)
            error, match = zerograph.ProcessGroupError, "mesh has 2 ranks .* default process group has 4"
        elif case == "three_dims":
            mesh = init_device_mesh("cpu", (2, 2, 2))
            error, match = zerograph.ConfigError, "3-D mesh"
        elif case == "misnamed":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            error, match = zerograph.ConfigError, r"names them \('dp', 'tp'\)"
        elif case == "swapped":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
            error, match = zerograph.ConfigError, "in that order"
        elif case == "stage0":
            mesh, stage = init_device_mesh("cpu", (2, 2)), 0
            error, match = zerograph.ConfigError, "stage 0"
        elif case == "not_a_mesh":
            mesh = (2, 2)
            error, match = zerograph.ConfigError, "must be a torch.distributed.device_mesh.DeviceMesh"
        else:
            mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=MESH_DIMS)
            error, match = zerograph.ConfigError, "shard dim has 1 rank"
        model = build("mlp")
        with pytest.raises(error, match=match):
            zerograph.compile(model, stage, mesh=mesh, **kwargs)
        # refused before anything changed: the model's parameters are still plain tensors
        assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_a_one_dimensional_mesh_shards_over_its_group() -> None:
    with fake_rank(4, rank=1):
        mesh = init_device_mesh("cpu", (4,))
        model = zerograph.compile(build("mlp"), 3, mesh=mesh)
        rt = runtime_of_model(model)
        assert rt.topology.world_size == 4 and rt.topology.replicate_group is None
        assert tuple(next(model.parameters()).placements) == (Shard(0),)


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory) -> tuple[list[dict], str]:
    ckpt = str(tmp_path_factory.mktemp("hybrid") / "ckpt")
    return spawn(hybrid_training, 4, RUNS, STEPS, BATCH, LR, ckpt, timeout_s=600), ckpt


def _reference(name: str) -> dict:
    """Single-process eager AdamW on the global batch, with the last step's gradients."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(*global_batch(name, step, BATCH))
        loss.backward()
        if step == STEPS - 1:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.distributed
def test_hybrid_2x2_matches_single_process_training(hybrid_run) -> None:
    results, _ = hybrid_run
    assert [list(r["coordinate"]) for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    for name, stage in RUNS:
        reference = _reference(name)
        for rank, result in enumerate(results):
            run = result[name, stage]
            assert run["losses"] == pytest.approx(reference["losses"], rel=RTOL, abs=ATOL), (name, stage, rank)
            for kind in ("grads", "params"):
                assert run[kind].keys() == reference[kind].keys()
                for key, ref in reference[kind].items():
                    torch.testing.assert_close(run[kind][key], ref, rtol=RTOL, atol=ATOL,
                                               msg=f"{name} stage {stage} rank {rank} {kind} {key}")
            for key, (placements, shape) in run["placements"].items():
                assert placements == (Replicate(), Shard(0)) and shape == (2, 2), key
            ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in
                                                             reference["grads"].values()])).item()
            assert run["grad_norm"] == pytest.approx(ref_norm, rel=RTOL), (name, stage, rank)
            if rank == 0:  # FSDP2's full_state_dict: full plain tensors on rank 0 only
                assert {k: v.shape for k, v in run["full_state_dict"].items()} == {
                    k: v.shape for k, v in build(name).state_dict().items()}
                for key, value in run["full_state_dict"].items():
                    if key in run["params"]:
                        assert torch.equal(value, run["params"][key]), key
            else:
                assert run["full_state_dict"] == {}
            stats = run["stats"]
            assert set(stats.comm_bytes_per_dim) == {"shard", "replicate"}
            # every gradient shard crossed the replicas once, in graphs and in the eager frame alike
            assert stats.comm_bytes_per_dim["replicate"] == expected_bytes_per_dim(stage, run["padded"], 2, 2, 4)[
                "replicate"], (name, stage)
        # replicas hold the same shards: rank r and rank r + 2 share the shard coordinate r
        for rank in (0, 1):
            for key, local in results[rank][name, stage]["local"].items():
                assert torch.equal(local, results[rank + 2][name, stage]["local"][key]), (name, stage, key)


@pytest.mark.distributed
def test_meta_built_model_on_2x2_initialises_and_loads_as_the_ordinary_build(hybrid_run) -> None:
    results, _ = hybrid_run
    ordinary = {n: p.detach() for n, p in build("mlp").named_parameters()}
    for result in results:
        for kind in ("init", "loaded"):
            got = result["meta_init"][kind]
            assert got.keys() == ordinary.keys()
            for key, value in ordinary.items():
                assert torch.equal(got[key], value), (kind, key)
    for rank in (0, 1):  # the replicas drew the same rows
        for key, local in results[rank]["meta_init"]["local"].items():
            assert torch.equal(local, results[rank + 2]["meta_init"]["local"][key]), key


def _check_loaded(loaded: dict, saved: dict) -> None:
    assert loaded["params"].keys() == saved["params"].keys()
    for key, value in saved["params"].items():
        assert torch.equal(loaded["params"][key], value), key
    assert loaded["optimizer"].keys() == saved["optimizer"].keys() and saved["optimizer"]
    for key, value in saved["optimizer"].items():
        assert torch.equal(loaded["optimizer"][key], value), key


@pytest.mark.distributed
def test_checkpoint_saved_on_2x2_loads_on_a_1d_world_of_4(hybrid_run) -> None:
    results, _ = hybrid_run
    for result in results:
        reload = result["reload_1d"]
        assert reload["mesh"] == (4,)
        _check_loaded(reload, result["saved"])
        assert reload["loss_after"] == reload["loss"]


@pytest.mark.distributed
def test_checkpoint_saved_on_2x2_loads_on_1x2(hybrid_run) -> None:
    results, ckpt = hybrid_run
    saved = results[0]["saved"]
    loaded = spawn(hybrid_reload, 2, saved["name"], saved["stage"], ckpt, timeout_s=300)
    for result in loaded:
        assert result["mesh"] == (1, 2)
        _check_loaded(result, saved)
        assert "replicate" not in result["stats"].comm_bytes_per_dim  # a replicate dim of 1 rank moves nothing
        assert result["stats"].replicas == 1


def test_world_group_spans_the_mesh() -> None:
    with fake_rank(4, rank=2):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
        topology = runtime_of_model(zerograph.compile(build("mlp"), 2, mesh=mesh)).topology
        assert dist.get_world_size(topology.world_group) == 4 and topology.world_size == 2 and topology.replicate_size == 2
        assert topology.dp_size == 4


def test_gradient_accumulation_without_sync_reduces_once_over_both_dims() -> None:
    """``no_sync`` micro-batches run no collective; the synced one reduces the sum once, over the
    shard group and then across the replicas (the flushing graph's reduction is the same two-level
    one), so the step's bytes per dim are one step's."""
    with fake_rank(4, rank=0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
        model = zerograph.compile(build("mlp"), 2, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        batch = rank_slice(global_batch("mlp", 0, BATCH), 0, 4)
        with model.no_sync():
            model(*batch).backward()
        model(*batch).backward()
        stats = zerograph.stats(model, opt)
        assert stats.comm_bytes_per_dim == expected_bytes_per_dim(2, _unit_padded(model), 2, 2, 4)


def test_dump_folders_are_named_by_the_rank_among_all_mesh_ranks(tmp_path) -> None:
    """Under a 2 x 2 mesh, ranks 1 and 3 share shard-group rank 1: the dump must still give each
    its own ``rank<r>/`` folder (the rank among all four) and a manifest of world size 4, or two
    replicas would write one folder and ``zerograph inspect`` would find it clobbered."""
    with fake_rank(4, rank=3):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
        model = zerograph.compile(build("mlp"), 3, mesh=mesh, config=zerograph.Config(dump_dir=str(tmp_path)))
        assert runtime_of_model(model).topology.rank == 1 and runtime_of_model(model).topology.mesh_rank == 3
        model(*rank_slice(global_batch("mlp", 0, BATCH), 3, 4)).backward()
        zerograph.explain(model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["rank3"]
    manifest = json.loads((tmp_path / "rank3" / "manifest.json").read_text())
    assert (manifest["rank"], manifest["world_size"]) == (3, 4)
    assert "rank 1 of 2 (shard dim; x 2 replicas)" in (tmp_path / "rank3" / "summary.md").read_text()
