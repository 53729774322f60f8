"""What the passes put where, read off the compiled graphs of the tiny GPT (2 blocks + root unit),
as rank 0 of a fake world of 2 in this process (the ``one_rank`` fixture)."""
from __future__ import annotations

import zerograph

from .distributed import run_as_rank
from .models import build
from .workers import train


def units_with_params(result: dict) -> int:
    return sum(1 for _, size in result["units"] if size)


def test_stage3_forward_gathers_each_unit_once_before_its_compute(one_rank) -> None:
    result = one_rank("gpt", 3)
    (graph,) = result["graphs"]
    gathers = graph["forward"]["gathers"]
    assert sorted(g["unit"] for g in gathers) == list(range(units_with_params(result)))
    for gather in gathers:
        assert gather["first_compute"] is not None and gather["pos"] < gather["first_compute"], gather


def test_stage3_forward_releases_gathered_parameters(one_rank) -> None:
    """No gathered parameter (nor a view of one) is saved for backward or alive at the end."""
    forward = one_rank("gpt", 3)["graphs"][0]["forward"]
    assert forward["saved_gathered"] == []
    assert forward["gathered_live_at_end"] == 0


def test_stage3_backward_regathers_and_reduces_per_unit(one_rank) -> None:
    result = one_rank("gpt", 3)
    backward = result["graphs"][0]["backward"]
    n_units = units_with_params(result)
    assert backward["collectives"].count("all_gather") == n_units  # gathered again, not saved
    assert backward["collectives"].count("reduce_scatter") == n_units


def test_stage2_reduces_as_produced_stage1_after_backward(one_rank) -> None:
    stage1 = one_rank("gpt", 1)["graphs"][0]["backward"]
    stage2 = one_rank("gpt", 2)["graphs"][0]["backward"]
    assert min(stage1["collective_pos"]) > stage1["last_compute"]
    assert min(stage2["collective_pos"]) < stage2["last_compute"]


def test_stages_1_2_gather_once(one_rank) -> None:
    for stage in (1, 2):
        graph = one_rank("gpt", stage)["graphs"][0]
        assert "all_gather" not in graph["backward"]["collectives"]
        assert len(graph["forward"]["saved_gathered"]) > 0  # gathered params are kept for backward


def test_tied_weight_is_one_shard_reduced_once(one_rank) -> None:
    result = one_rank("gpt", 3)
    names = list(result["params"])
    assert "wte.weight" in names and "lm_head.weight" not in names  # one parameter object
    assert len(result["param_ids"]) == len(set(result["param_ids"])) == len(list(build("gpt").parameters()))
    assert result["stats"].comm_elements["reduce_scatter"] == sum(size for _, size in result["units"])


def test_graph_inputs_map_to_parameters(one_rank) -> None:
    """The per-parameter build (``unit_templates=False``): every parameter is a graph input. The
    default build: the root unit's parameters are, and each block is one input, its flat shard."""
    per_parameter = run_as_rank(train, 2, "gpt", 3, 1, 4, 1e-3, zerograph.Config(unit_templates=False))
    (inputs,) = per_parameter["input_params"]
    assert set(filter(None, inputs)) >= set(per_parameter["params"])
    result = one_rank("gpt", 3)
    (inputs,) = result["input_params"]
    blocks = [name for name, _ in result["units"][1:]]  # unit 0 is the root
    root_params = {p for p in result["params"] if not any(p.startswith(f"{block}.") for block in blocks)}
    assert set(filter(None, inputs)) == root_params | {f"{block}.<flat shard>" for block in blocks}
