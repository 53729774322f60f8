"""The grouped knobs of ``zerograph.Config``, one frozen dataclass per concern (as FSDP2 groups
its options into ``MixedPrecisionPolicy`` / ``OffloadPolicy``).

They sit in the bottom layer, plain data apart from ``ActivationPolicy.group``, so that the pass
context can carry the schedule and memory policies as they are, instead of copying their fields
one by one. Each policy checks its own fields when built and raises ``ConfigError``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch._functorch.config
import torch.distributed
from torch import nn

from .errors import ConfigError


def check_count(owner: str, field: str, value: object, unit: str, minimum: int) -> None:
    """An int field (bool, float and str are refused: a typo should not become a schedule)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{field} must be an int ({unit}), got {value!r}")
    if value < minimum:
        raise ConfigError(f"{owner}.{field} must be >= {minimum} ({unit}), got {value}")


def check_module_classes(owner: str, field: str, value: object) -> tuple[type[nn.Module], ...]:
    """A tuple of ``nn.Module`` subclasses; a single class is refused with the fix spelled out."""
    if isinstance(value, type):
        raise ConfigError(f"{owner}.{field} must be a tuple of nn.Module subclasses, got the class "
                          f"{value.__name__} itself: write {field}=({value.__name__},)")
    try:
        classes = tuple(value)
    except TypeError:
        raise ConfigError(f"{owner}.{field} must be a tuple of nn.Module subclasses, got {value!r}") from None
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise ConfigError(f"{owner}.{field} must be nn.Module subclasses, got {bad}")
    return classes


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision: what dtype parameters are gathered and computed in, and gradients reduced in
    (``Config.mixed_precision``; docs/mixed-precision.md).

    Source: FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``,
    ``cast_forward_inputs``).
    """

    param_dtype: torch.dtype | None = None
    """Floating-point dtype of the full parameters that forward and backward compute with and that
    the all-gathers move (e.g. ``torch.bfloat16``: half the bytes of fp32). The parameters
    themselves (the ``DTensor`` shards the optimizer updates) keep their own dtype: they are the
    fp32 master weights. Each shard is cast in the all-gather's copy-in. ``None`` (default): each
    parameter's own dtype. Only floating-point parameters are cast, and not those of
    ``full_precision_classes``. Frozen parameters are cast like trainable ones (they are gathered
    in ``param_dtype`` too). Buffers are never cast (FSDP2's choice): a forward that combines an
    fp32 buffer with ``param_dtype`` activations computes in fp32 from there, as type promotion
    says; cast the buffer in the model (``self.buf.to(x.dtype)``), or list its module in
    ``full_precision_classes``."""

    reduce_dtype: torch.dtype | None = None
    """Floating-point dtype gradients are reduced (reduce-scattered or all-reduced) and averaged
    in; the reduced shard is cast to the parameter's own dtype before it lands in ``.grad``.
    ``None`` (default): the compute dtype (``param_dtype``, or the parameter's own)."""

    # nn.modules.batchnorm._BatchNorm is private, but it is the one base of every batch norm
    full_precision_classes: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
    """Module classes whose parameters ``param_dtype`` leaves in their own dtype (a tuple; a single
    class is refused). Default: batch norms (``nn.modules.batchnorm._BatchNorm``): their running
    statistics are fp32 buffers, and batch norm on a 16-bit input wants fp32 weight and statistics
    alike. As FSDP1's ``MixedPrecision`` (``_module_classes_to_ignore``) and apex's
    ``keep_batchnorm_fp32``. ``()`` casts every floating-point parameter."""

    cast_forward_inputs: bool = True
    """With ``param_dtype`` set, cast every floating-point tensor among the compiled model's
    forward arguments (positional and keyword, inside lists, tuples and dicts:
    ``torch.utils._pytree``) to ``param_dtype`` before the forward runs, so an fp32 batch meets
    bf16 weights in bf16. Integer and bool tensors (token ids, masks) are left alone. ``False``
    hands the inputs over as they are. Default ``True``, FSDP2's."""

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ConfigError(f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype "
                                  f"(e.g. torch.bfloat16) or None, got {dtype!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise ConfigError(f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")
        object.__setattr__(self, "full_precision_classes", check_module_classes(
            "MixedPrecisionPolicy", "full_precision_classes", self.full_precision_classes))


@dataclasses.dataclass(frozen=True)
class SchedulePolicy:
    """When collectives run: bucketing and prefetch (``Config.schedule``; docs/memory.md).

    Source: ZeRO (arXiv 1910.02054) section 7 (prefetching); FSDP2's forward/backward prefetch.
    """

    bucket_bytes: int = 0
    """Fuse the collectives of adjacent units into one while the fused buffer stays within this
    many bytes (full, unsharded bytes; an int >= 0). 0 (default) keeps one collective per unit
    (FSDP2's grouping); a unit larger than the cap is never split."""

    prefetch_depth: int = 1
    """How many units ahead an all-gather starts, in forward and, in reverse unit order, in
    backward (units; an int >= 0). 0 issues it just before its unit's first use. Default 1."""

    max_inflight_bytes: int | None = None
    """Bound on the gathered bytes (full, unsharded; an int >= 1) of all-gathers started but not
    yet consumed: prefetch starts a gather later rather than exceed it. The same bound applies
    to reduce-scatters whose waits the scheduler sinks. ``None`` (default) bounds by
    ``prefetch_depth`` alone."""

    def __post_init__(self) -> None:
        check_count("SchedulePolicy", "bucket_bytes", self.bucket_bytes, "bytes", minimum=0)
        check_count("SchedulePolicy", "prefetch_depth", self.prefetch_depth, "units", minimum=0)
        if self.max_inflight_bytes is not None:
            check_count("SchedulePolicy", "max_inflight_bytes", self.max_inflight_bytes, "bytes or None", minimum=1)


@dataclasses.dataclass(frozen=True)
class MemoryPolicy:
    """Which gathered parameters stay alive from forward to backward (stage 3), the step's memory
    budget and the comm buffer pool (``Config.memory``; docs/memory.md).

    Source: DeepCompile's selective unsharding (arXiv 2504.09983); FSDP2's ``reshard_after_forward``;
    ZeRO-R (arXiv 1910.02054) sections 6.2-6.3 for the pool.
    """

    unshard_budget_bytes: int = 0
    """Full bytes of gathered parameters that may stay alive from forward to backward instead of
    being gathered again (``selective_unshard`` keeps the smallest units first; an int >= 0).
    0 (default) re-gathers every unit (ZeRO-3 proper)."""

    reshard_root_after_forward: bool = True
    """``True`` (default; ZeRO-3 as the paper counts it, 3Ψ per step) frees the root unit's
    gathered parameters at the end of forward and gathers them again at the start of backward,
    like every other unit. ``False`` keeps them from forward to backward, as FSDP2 does for the
    root module: backward starts with the LM head and final norm, which need them at once. The
    root is kept only when its collective moves it alone: a ``SchedulePolicy.bucket_bytes`` that
    fuses it with blocks makes ``False`` do nothing (``selective_unshard`` logs a warning)."""

    budget_bytes: int | None = None
    """Bytes per rank the step's predicted peak must fit in (an int >= 1; ``zerograph.plan``'s
    ``step_peak_bytes``: model states, gathered units in flight, gradients being reduced; saved
    activations are not known at ``compile``). ``compile`` keeps the largest ``prefetch_depth``
    up to the schedule's whose plan fits, and raises ``ConfigError`` with the plan's parts when
    even ``prefetch_depth=0`` does not. ``None`` (default): no budget."""

    pool_comm_buffers: bool = False
    """``True``: under the eager lowering, every comm buffer that dies inside its graph comes from
    a pool of slots allocated in the first step and held across steps (``buffer_reuse``; ZeRO-R's
    constant-size buffers and defragmentation, C_B and M_D): no comm buffer is allocated after the
    first step, but the slots stay allocated where the step peaks with no collective in flight
    (the start of backward, the optimizer step). ``False`` (default): the allocator serves comm
    buffers and each is freed after its last use, as FSDP2's are; the lower peak. Inductor plans
    its own buffers: ``True`` with ``Config.lowering="inductor"`` raises ``ConfigError``."""

    def __post_init__(self) -> None:
        check_count("MemoryPolicy", "unshard_budget_bytes", self.unshard_budget_bytes, "bytes", minimum=0)
        if self.budget_bytes is not None:
            check_count("MemoryPolicy", "budget_bytes", self.budget_bytes, "bytes", minimum=1)
        for name in ("reshard_root_after_forward", "pool_comm_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"MemoryPolicy.{name} must be a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """What happens to saved activations beyond a budget (``Config.activations``;
    ``passes/activation_partition.py``; docs/memory.md). ``offload``, ``group`` and ``cost_model``
    need ``budget_bytes``: without one they raise ``ConfigError``.

    Source: ZeRO (arXiv 1910.02054) section 6.1: activation offloading and partitioned activation
    checkpointing (P_a).
    """

    budget_bytes: int | None = None
    """Bytes of activations each compiled graph may save from forward for backward, per rank (an
    int >= 0): ``activation_partition`` recomputes whole units (transformer blocks) in backward,
    those that free the most bytes per second first, until its estimate fits. 0 recomputes every
    unit (the root unit's activations stay kept). With ``offload`` or ``group`` set, offloading
    and partitioning compete with recompute, unit by unit, on bytes freed per second. ``None``
    (default): no budget, nothing changes."""

    offload: bool = False
    """Let ``activation_partition`` offload a unit's saved activations to host memory, through
    PyTorch's partitioner-level activation offloading
    (``torch._functorch.config.enable_activation_offloading``; a torch without it raises
    ``ConfigError``). Default ``False``."""

    group: torch.distributed.ProcessGroup | None = None
    """A process group over which the model's activations are replicated (a tensor-parallel group,
    or ranks fed the same batch): a unit's saved activations may be kept as this rank's 1/M (M =
    the group's size) and all-gathered back in backward (P_a). The activations must be bitwise
    equal across the group, dropout included. ``None`` (default): no partitioning."""

    cost_model: Any = None  # zerograph.graph.costmodel.CostModel (checked by Config, which sits above it)
    """The ``zerograph.graph.costmodel.CostModel`` that prices recompute (roofline seconds), offload
    (its ``host_bytes_per_s``) and P_a (its all-gather, ``resized`` to the group). Give every rank
    the same model: ranks that decide differently would run different collectives. ``None``
    (default): ``Config`` fills in the rates of clusters.json's nominal cluster
    (``costmodel.NOMINAL_CLUSTER``); a model without ``host_bytes_per_s`` takes that cluster's host
    link rate when ``offload`` is on."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None:
            check_count("ActivationPolicy", "budget_bytes", self.budget_bytes, "bytes or None", minimum=0)
        if not isinstance(self.offload, bool):
            raise ConfigError(f"ActivationPolicy.offload must be a bool, got {self.offload!r}")
        if self.offload and not hasattr(torch._functorch.config, "enable_activation_offloading"):
            raise ConfigError(f"ActivationPolicy.offload needs PyTorch's partitioner-level activation offloading "
                              f"(torch._functorch.config.enable_activation_offloading), which torch "
                              f"{torch.__version__} lacks")
        if self.group is not None and not isinstance(self.group, torch.distributed.ProcessGroup):
            raise ConfigError(f"ActivationPolicy.group must be a torch.distributed.ProcessGroup or None, "
                              f"got {self.group!r}")
        unused = [f for f in ("offload", "group", "cost_model") if getattr(self, f) not in (None, False)]
        if unused and self.budget_bytes is None:
            raise ConfigError(f"ActivationPolicy.{unused[0]} has no effect without ActivationPolicy.budget_bytes "
                              f"(bytes of saved activations per rank and graph); set a budget, or leave "
                              f"ActivationPolicy.{unused[0]} unset")

    def group_for_passes(self) -> tuple[str, int] | None:
        """``(registered name, size)`` of ``group``: what the passes see (never the group itself)."""
        return None if self.group is None else (self.group.group_name, self.group.size())
