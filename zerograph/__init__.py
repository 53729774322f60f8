"""zerograph: ZeRO (arXiv 1910.02054) as compiler passes over PyTorch's captured training graphs."""
from .api import compile
from .config import Config
from .errors import (
    CollectiveBufferError,
    CollectiveError,
    ConfigError,
    ModelChangedError,
    PassError,
    PoolCorruptionError,
    ProcessGroupError,
    ScheduleMismatchError,
    ShardingError,
    SyncedForHooksWarning,
    UnitSizeWarning,
    UnshardedParameterError,
    ZeroGraphError,
    ZeroGraphWarning,
)
from .policies import ActivationPolicy, MemoryPolicy, MixedPrecisionPolicy, SchedulePolicy
from .runtime.fake import FakeWorldError, fake_world

__all__ = ["Config", "ActivationPolicy", "MemoryPolicy", "MixedPrecisionPolicy", "SchedulePolicy", "compile",
           "CollectiveError", "CollectiveBufferError", "ConfigError", "ModelChangedError", "PassError", "PoolCorruptionError",
           "ProcessGroupError", "ScheduleMismatchError", "ShardingError", "UnshardedParameterError",
           "ZeroGraphError", "fake_world", "FakeWorldError", "SyncedForHooksWarning", "UnitSizeWarning",
           "ZeroGraphWarning"]
from . import checkpoint  # noqa: E402  (zerograph.checkpoint.save / load / full_state_dict)
from .checkpoint import CheckpointError  # noqa: E402

__all__ += ["checkpoint", "CheckpointError"]
from .report.stats import Stats, stats

__all__ += ["Stats", "stats"]
from .planning.plan import Plan, plan

__all__ += ["Plan", "plan"]
from . import kernels, optim  # noqa: E402  (kernels import triton lazily, on first Triton call)

__all__ += ["kernels", "optim"]
from .graph.costmodel import CostModel, calibrate
from .report.timeline import Event, Schedule, measure, predict

__all__ += ["CostModel", "calibrate", "Event", "Schedule", "measure", "predict"]
from .errors import DumpError
from .io.init import init_weights, reset_parameters  # noqa: E402
from .io.loading import LoadError, load_safetensors  # noqa: E402

__all__ += ["init_weights", "reset_parameters", "LoadError", "load_safetensors"]

__all__ += ["DumpError", "explain", "write_summary"]

# names loaded on first use (PEP 562), so that ``import zerograph`` imports no part of the dump
_LAZY = {"explain": "zerograph.dump.report", "write_summary": "zerograph.dump.report"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
