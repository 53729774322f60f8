"""What ``zerograph.compile`` attaches to a model, and the documented ways to read it.

Tests, the benchmark and the reporting modules (``stats``, ``dump``, ``checkpoint``) read a
compiled model through these accessors instead of reaching into its private attribute, so the
attribute's layout can change without touching them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from ..errors import ShardingError

if TYPE_CHECKING:  # types only
    import torch.fx as fx

    from ..policies import MixedPrecisionPolicy, SchedulePolicy
    from ..shard.parameter_watch import ParameterWatch
    from ..shard.sharding import Unit
    from ..shard.uninitialised import UninitialisedTracker
    from .runtime import Runtime

STATE_ATTR = "_zerograph"  # the attribute of a compiled model that holds its ZeroGraphState


class CompiledWith(Protocol):
    """What a compiled model's readers ask of the ``zerograph.config.Config`` it was compiled with.
    ``Config`` sits above the runtime (it builds what the runtime runs), so the state names it by
    this protocol instead of importing it."""

    schedule: SchedulePolicy
    mixed_precision: MixedPrecisionPolicy | None

    def resolved_dump_dir(self) -> str | None: ...


class CapturedGraphs:
    """What one compile produced, kept for tests and inspection (plain FX graph modules); filled
    by ``capture.capture.ZeroGraphBackend`` as each graph compiles."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, fx.GraphModule]] = []
        self.input_params: list[list[str | None]] = []
        # graph id -> bytes of activations its forward handed to backward on its last call (measured)
        self.saved_activation_bytes: dict[int, int] = {}
        self.offloaded_activation_bytes: dict[int, int] = {}  # handed over in host memory instead (offload)
        self.secondary_partition_bytes: dict[int, int] = {}  # hpZ's pieces of gathered parameters
        # (graph id, kind) -> (islands, distinct islands compiled) under the Inductor lowering (islands.py)
        self.islands: dict[tuple[int, str], tuple[int, int]] = {}
        self.templates: list = []  # unit_trace.UnitTemplate, one per unit kind and input signature traced
        # the path each templated unit kind takes (templates.UnitKind.path), read at report time
        self.unit_paths: Callable[[], list[dict]] = list


class ZeroGraphState:
    """Everything ``compile`` attached to one model.

    Attributes:
        runtime: the ``Runtime`` (process group, layouts, units, step accounting, buffer pool).
        config: the ``Config`` the model was compiled with.
        captured: the ``CapturedGraphs`` of every ``torch.compile`` graph of the model so far.
        compiled_forward: the ``torch.compile``d forward the model's ``forward`` calls.
        watch: the ``ParameterWatch`` that refuses parameters changed after compile.
        uninitialised: for a meta-built model, the ``uninitialised.UninitialisedTracker`` of shards and
            buffers no init or load has written yet; ``None`` once all were (or never meta-built).
        unit_kinds: the ``templates.kinds.UnitKind`` of each kind of unit under ``Config(unit_templates=True)``
            (kept here: the op registry holds them weakly); empty otherwise.
    """

    def __init__(self, runtime: Runtime, config: CompiledWith, captured: CapturedGraphs, compiled_forward: Any,
                 watch: ParameterWatch, uninitialised: UninitialisedTracker | None = None,
                 unit_kinds: list | None = None):
        self.runtime = runtime
        self.config = config
        self.captured = captured
        self.compiled_forward = compiled_forward
        self.watch = watch
        self.uninitialised = uninitialised
        self.unit_kinds = unit_kinds or []
        # the input shapes traced static so far (compiled_model.shape_policy): each a template per kind
        self.static_shapes: set[tuple] = set()


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` was returned by ``zerograph.compile``."""
    return isinstance(getattr(model, STATE_ATTR, None), ZeroGraphState)


def state_of(model: nn.Module) -> ZeroGraphState:
    """The state ``zerograph.compile`` attached to ``model``.

    Raises:
        ShardingError: ``model`` was not compiled by ``zerograph.compile``.
    """
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ShardingError("this model was not compiled by zerograph.compile")
    return state


def runtime_of_model(model: nn.Module) -> Runtime:
    """The compiled model's ``Runtime`` (its process group, stage, layouts, units and buffer pool)."""
    return state_of(model).runtime


def config_of(model: nn.Module) -> CompiledWith:
    """The ``Config`` the model was compiled with."""
    return state_of(model).config


def units_of(model: nn.Module) -> list[Unit]:
    """The model's sharding units in order; ``units[0]`` is the root unit."""
    return list(state_of(model).runtime.units)


def graphs_of(model: nn.Module) -> list[dict[str, fx.GraphModule]]:
    """Every graph captured so far, one dict per Dynamo graph in compile order, keyed by kind
    (``"dynamo"``, ``"joint"``, ``"forward"``, ``"backward"``, ``"inference"``): the graphs after
    zerograph's passes, before lowering."""
    return state_of(model).captured.graphs
