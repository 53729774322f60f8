"""Sharded training matches single-process eager training on the same global batch (fp32, 1e-5)."""
from __future__ import annotations

import pytest
import torch

from .models import reference_training

STEPS, LR = 3, 1e-3  # as in conftest.training_run
ATOL = RTOL = 1e-5


def check_parity(result: dict, reference: dict) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=RTOL, abs=ATOL)
    assert result["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        torch.testing.assert_close(result["params"][name], ref, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_matches_single_process(training_run, name: str, stage: int) -> None:
    results = training_run(name, stage)
    reference = reference_training(name, STEPS, 4, LR)
    for result in results:
        check_parity(result, reference)
    for param, value in results[0]["params"].items():  # every rank ends with the same parameters
        assert torch.equal(value, results[1]["params"][param])


def test_zero_dim_parameter_stays_replicated(training_run) -> None:
    results = training_run("mlp_scalar", 3)
    reference = reference_training("mlp_scalar", STEPS, 4, LR)
    for result in results:
        check_parity(result, reference)


def test_stage3_world_size_3_uneven(training_run) -> None:
    results = training_run("mlp", 3, world_size=3, batch_size=6)
    reference = reference_training("mlp", STEPS, 6, LR)
    for result in results:
        check_parity(result, reference)


def test_training_moves_the_parameters(training_run) -> None:
    """Guards the parity tests against passing vacuously: three steps change every parameter."""
    from .models import build

    initial = dict(build("gpt").named_parameters())
    for name, value in training_run("gpt", 3)[0]["params"].items():
        assert not torch.equal(value, initial[name].detach()), name


@pytest.mark.parametrize("stage", [0, 3])
def test_graph_break_eager_frame_sees_full_parameters(training_run, stage: int) -> None:
    """The last Linear runs in an eager frame: its marker's real implementation gathers and its
    backward reduces, so results still match (forward and backward)."""
    results = training_run("mlp_break", stage)
    reference = reference_training("mlp_break", STEPS, 4, LR)
    for result in results:
        check_parity(result, reference)
    assert len(results[0]["graphs"]) >= 1
    eager_volume = results[0]["stats"].comm_elements
    assert sum(eager_volume.values()) > 0


@pytest.mark.distributed
def test_inductor_lowering_matches_single_process() -> None:
    """The same passes lowered by Inductor (C++ kernels on CPU) train the same numbers. The MLP's
    units are templated, so Inductor lowers each kind's body once; the compute between the units'
    calls and collectives runs as FX Python (the default), or with ``inductor_islands`` is
    lowered by Inductor too, island by island (``zerograph/capture/islands.py``), never the whole graph.
    Both in one spawn, one after the other."""
    import zerograph

    from .distributed import spawn
    from .workers import train_configs

    configs = (zerograph.Config(lowering="inductor"), zerograph.Config(lowering="inductor", inductor_islands=True))
    runs = spawn(train_configs, 2, "mlp", 3, STEPS, 4, LR, configs, timeout_s=600)
    reference = reference_training("mlp", STEPS, 4, LR)
    for default, with_islands in runs:
        for result in (default, with_islands):
            check_parity(result, reference)
            assert result["templates"] > 0
            assert result["stats"].comm_elements["all_gather"] > 0  # the collectives ran inside the graphs
        assert default["islands"] == {}
        # every graph Inductor lowered (the templates' bodies, the islands) went through its FX graph
        # cache, so a restart reuses it (a template traced without a ShapeEnv once bypassed it)
        assert with_islands["fx_graph_cache"].get("fxgraph_cache_bypass", 0) == 0, with_islands["fx_graph_cache"]
        assert sum(with_islands["fx_graph_cache"].values()) > 0
        assert {kind for _, kind in with_islands["islands"]} == {"forward", "backward"}
        assert all(distinct >= 1 for _, distinct in with_islands["islands"].values()), with_islands["islands"]
