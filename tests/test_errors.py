"""Bad input gets a clear zerograph error, never a hang or a traceback from deep inside torch."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerograph

from .distributed import spawn
from .models import build
from .workers import one_rank_quits, world_size_mismatch


@pytest.mark.parametrize("cls, kwargs, message", [
    (zerograph.SchedulePolicy, {"prefetch_depth": "2"}, "SchedulePolicy.prefetch_depth must be an int"),
    (zerograph.SchedulePolicy, {"prefetch_depth": 1.5}, "SchedulePolicy.prefetch_depth must be an int"),
    (zerograph.SchedulePolicy, {"bucket_bytes": None}, "SchedulePolicy.bucket_bytes must be an int"),
    (zerograph.SchedulePolicy, {"bucket_bytes": -1}, "SchedulePolicy.bucket_bytes must be >= 0"),
    (zerograph.SchedulePolicy, {"max_inflight_bytes": 0}, "SchedulePolicy.max_inflight_bytes must be >= 1"),
    (zerograph.Config, {"disabled_passes": ("prefech",)}, r"unknown passes \['prefech'\]; passes: \[.*'prefetch'"),
    (zerograph.Config, {"disabled_passes": "prefetch"}, "must be a tuple of pass names"),
])
def test_config_fields_of_the_wrong_type_or_name(cls: type, kwargs: dict, message: str) -> None:
    with pytest.raises(zerograph.ConfigError, match=message):
        cls(**kwargs)


def test_compile_takes_a_module_and_a_config_object() -> None:
    with pytest.raises(zerograph.ConfigError, match="config must be a zerograph.Config"):
        zerograph.compile(build("mlp"), stage=3, config={"prefetch_depth": 1})
    with pytest.raises(zerograph.ShardingError, match="takes an nn.Module"):
        zerograph.compile(lambda x: x, stage=3)


@pytest.mark.parametrize("stage", [-1, 4, "3", 2.0, True])
def test_stage_outside_0_to_3(stage) -> None:
    with pytest.raises(zerograph.ConfigError, match="stage must be one of"):
        zerograph.compile(build("mlp"), stage=stage)


def test_parameters_on_several_devices() -> None:
    model = build("mlp")
    model.layers[2].to("meta")
    with pytest.raises(zerograph.ShardingError, match="one device"):
        zerograph.compile(model, stage=3)


def test_bad_config() -> None:
    with pytest.raises(zerograph.ConfigError, match="lowering"):
        zerograph.Config(lowering="tvm")
    with pytest.raises(zerograph.ConfigError, match="unit_classes"):
        zerograph.Config(unit_classes=(int,))


def test_optimizer_over_original_parameters() -> None:
    model = build("mlp")
    stale = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before compile
    model = zerograph.compile(model, stage=3)
    model(torch.randn(4, 7), torch.randn(4, 3)).backward()
    with pytest.raises(zerograph.UnshardedParameterError, match="model.parameters"):
        stale.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.step()  # the shards are fine


def test_compile_twice() -> None:
    model = zerograph.compile(build("mlp"), stage=1)
    with pytest.raises(zerograph.ShardingError, match="already compiled"):
        zerograph.compile(model, stage=1)


@pytest.mark.distributed
def test_world_size_not_matching_the_launch() -> None:
    messages = spawn(world_size_mismatch, 2)
    assert all("WORLD_SIZE=3" in m for m in messages), messages


@pytest.mark.distributed
def test_a_rank_that_leaves_makes_the_others_fail() -> None:
    """Gloo reports the closed peer at once; the process-group timeout (15 s here) bounds the rest."""
    message, left = spawn(one_rank_quits, 2, pg_timeout_s=15, timeout_s=120, teardown_barrier=False)
    assert left == "left"
    assert message != "no error" and "Error" in message, message


def test_module_without_parameters() -> None:
    with pytest.raises(zerograph.ShardingError, match="no parameters"):
        zerograph.compile(nn.ReLU(), stage=3)


def test_a_forward_graph_that_reduces_gradients_is_refused() -> None:
    """A gradient reduction the partitioner placed in the forward graph (a gradient independent of
    the tangents, which ranks could place differently) is a PassError, not a divergent schedule;
    the same graph with the reduction moved out of forward passes."""
    from torch import fx

    from zerograph.errors import PassError
    from zerograph.graph.ops import REDUCE_GRAD
    from zerograph.passes.manager import check_no_gradient_reduction_in_forward

    def forward_graph(reduce: bool) -> fx.GraphModule:
        graph = fx.Graph()
        x = graph.placeholder("x")
        y = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
        outputs = (y, graph.call_function(REDUCE_GRAD, (y, 0))) if reduce else (y,)
        graph.output(outputs)
        return fx.GraphModule(torch.nn.Module(), graph)

    with pytest.raises(PassError, match="forward graph reduces gradients"):
        check_no_gradient_reduction_in_forward(forward_graph(reduce=True))
    check_no_gradient_reduction_in_forward(forward_graph(reduce=False))


def test_deepcopy_of_a_compiled_model_is_refused_by_name() -> None:
    """Found by trying it as a new user (an EMA copy): it failed inside pickle ("cannot pickle
    'ProcessGroup' object"); now a TypeError says what cannot be copied and what to do instead."""
    import copy

    model = zerograph.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), stage=3)
    with pytest.raises(TypeError, match="cannot be deep-copied.*Copy the model before zerograph.compile"):
        copy.deepcopy(model)
