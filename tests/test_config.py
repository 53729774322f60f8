"""Config's policies, its flat keywords, and the pass contracts it checks (all in-process)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import zerograph
from zerograph import ActivationPolicy, Config, ConfigError, MemoryPolicy, MixedPrecisionPolicy, SchedulePolicy
from zerograph.passes.contract import contract_of, pipeline_problem
from zerograph.passes.manager import GRAPH_KINDS, pass_names, pipeline


def test_flat_keywords_fill_the_policies() -> None:
    flat = Config(bucket_bytes=64, prefetch_depth=2, unshard_budget_bytes=8, param_dtype=torch.bfloat16,
                  activation_budget_bytes=0, activation_offload=True)
    nested = Config(schedule=SchedulePolicy(bucket_bytes=64, prefetch_depth=2),
                    memory=MemoryPolicy(unshard_budget_bytes=8),
                    mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                    activations=ActivationPolicy(budget_bytes=0, offload=True))
    assert flat == nested
    assert flat.prefetch_depth == flat.schedule.prefetch_depth == 2  # a flat read is the policy's field
    assert dataclasses.replace(flat, lowering="inductor").schedule == flat.schedule


def test_a_policy_and_its_flat_keyword_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="both schedule= and prefetch_depth="):
        Config(schedule=SchedulePolicy(), prefetch_depth=2)
    with pytest.raises(ConfigError, match="unknown keyword 'prefetch'"):
        Config(prefetch=2)
    with pytest.raises(ConfigError, match="Config.schedule must be a zerograph.SchedulePolicy"):
        Config(schedule={"prefetch_depth": 2})


def test_policy_errors_name_the_field_as_written() -> None:
    with pytest.raises(ConfigError, match="SchedulePolicy.prefetch_depth must be an int"):
        SchedulePolicy(prefetch_depth="2")
    with pytest.raises(ConfigError, match="Config.prefetch_depth must be an int"):
        Config(prefetch_depth="2")
    with pytest.raises(ConfigError, match=r"write unit_classes=\(Linear,\)"):
        Config(unit_classes=nn.Linear)  # a class, not a tuple: said how to fix it, not a TypeError
    with pytest.raises(ConfigError, match=r"write full_precision_classes=\(LayerNorm,\)"):
        MixedPrecisionPolicy(full_precision_classes=nn.LayerNorm)


# the passes without which a pipeline cannot hand capture what it needs (their contracts)
REQUIRED_PASSES = ("insert_allgather", "insert_reduce_scatter", "expand_unit_calls", "expand_inference_unit_calls",
                   "saved_opaque_objects_last")


@pytest.mark.parametrize("name", REQUIRED_PASSES)
def test_disabling_a_required_pass_is_refused_at_config_time(name: str) -> None:
    with pytest.raises(ConfigError, match=f"'{name}' would provide"):
        Config(disabled_passes=(name,))


@pytest.mark.parametrize("name", sorted(pass_names() - set(REQUIRED_PASSES)))
def test_every_other_pass_may_be_disabled(name: str) -> None:
    assert Config(disabled_passes=(name,)).disabled_passes == (name,)


def test_every_pass_declares_a_contract_and_every_pipeline_satisfies_it() -> None:
    for kind in GRAPH_KINDS:
        for pass_fn in pipeline(kind):
            assert hasattr(pass_fn, "contract"), f"{pass_fn.__name__} declares no contract"
        assert pipeline_problem(kind, pipeline(kind)) is None
    assert "gathers" in contract_of(next(p for p in pipeline("joint") if p.__name__ == "insert_allgather")).provides


def test_pipeline_problem_names_the_pass_and_the_capability() -> None:
    problem = pipeline_problem("backward", pipeline("backward"), disabled=("insert_reduce_scatter",))
    assert "backward pipeline must end with ['reductions']" in problem


def test_the_package_exports_the_policies() -> None:
    assert zerograph.SchedulePolicy is SchedulePolicy and zerograph.Config is Config


def test_auto_lowering_is_inductor_on_cuda_and_eager_elsewhere() -> None:
    assert Config().lowering == "auto"
    assert Config().resolved_lowering(torch.device("cuda", 0)) == "inductor"
    assert Config().resolved_lowering(torch.device("cpu")) == "eager"
    assert Config(lowering="eager").resolved_lowering(torch.device("cuda")) == "eager"
    assert Config(lowering="inductor").resolved_lowering(torch.device("cpu")) == "inductor"


def test_inductor_islands_are_off_by_default_and_must_be_a_bool() -> None:
    assert Config().inductor_islands is False
    assert Config(lowering="inductor", inductor_islands=True).inductor_islands is True
    with pytest.raises(ConfigError, match="Config.inductor_islands must be True or False"):
        Config(inductor_islands=1)
    with pytest.raises(ConfigError, match="lowering='eager' runs no Inductor"):
        Config(lowering="eager", inductor_islands=True)
