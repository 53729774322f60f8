"""What the passes put where, read off the compiled graphs of the tiny GPT (2 blocks + root unit)."""
from __future__ import annotations

from .models import build


def units_with_params(result: dict) -> int:
    return sum(1 for _, size in result["units"] if size)


def test_stage3_forward_gathers_each_unit_once_before_its_compute(training_run) -> None:
    result = training_run("gpt", 3)[0]
    (graph,) = result["graphs"]
    gathers = graph["forward"]["gathers"]
    assert sorted(g["unit"] for g in gathers) == list(range(units_with_params(result)))
    for gather in gathers:
        assert gather["first_compute"] is not None and gather["pos"] < gather["first_compute"], gather


def test_stage3_forward_releases_gathered_parameters(training_run) -> None:
    """No gathered parameter (nor a view of one) is saved for backward or alive at the end."""
    forward = training_run("gpt", 3)[0]["graphs"][0]["forward"]
    assert forward["saved_gathered"] == []
    assert forward["gathered_live_at_end"] == 0


def test_stage3_backward_regathers_and_reduces_per_unit(training_run) -> None:
    result = training_run("gpt", 3)[0]
    backward = result["graphs"][0]["backward"]
    n_units = units_with_params(result)
    assert backward["collectives"].count("all_gather") == n_units  # gathered again, not saved
    assert backward["collectives"].count("reduce_scatter") == n_units


def test_stage2_reduces_as_produced_stage1_after_backward(training_run) -> None:
    stage1 = training_run("gpt", 1)[0]["graphs"][0]["backward"]
    stage2 = training_run("gpt", 2)[0]["graphs"][0]["backward"]
    assert min(stage1["collective_pos"]) > stage1["last_compute"]
    assert min(stage2["collective_pos"]) < stage2["last_compute"]


def test_stages_1_2_gather_once(training_run) -> None:
    for stage in (1, 2):
        graph = training_run("gpt", stage)[0]["graphs"][0]
        assert "all_gather" not in graph["backward"]["collectives"]
        assert len(graph["forward"]["saved_gathered"]) > 0  # gathered params are kept for backward


def test_tied_weight_is_one_shard_reduced_once(training_run) -> None:
    result = training_run("gpt", 3)[0]
    names = list(result["params"])
    assert "wte.weight" in names and "lm_head.weight" not in names  # one parameter object
    assert len(result["param_ids"]) == len(set(result["param_ids"])) == len(list(build("gpt").parameters()))
    assert result["stats"].comm_elements["reduce_scatter"] == sum(size for _, size in result["units"])


def test_graph_inputs_map_to_parameters(training_run) -> None:
    result = training_run("gpt", 3)[0]
    (inputs,) = result["input_params"]
    assert set(filter(None, inputs)) >= set(result["params"])
