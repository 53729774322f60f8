"""User-facing knobs of ``zerograph.compile``."""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

import torch
import torch._functorch.config
import torch.distributed
from torch import nn

from .errors import ConfigError

STAGES = (0, 1, 2, 3)
LOWERINGS = ("eager", "inductor")
# the passes that only reorder (no effect on what is computed or moved); disable both for the
# "scheduling off" baseline: every collective's wait right after its start
OVERLAP_PASSES = ("prefetch", "schedule_overlap")


@dataclasses.dataclass(frozen=True)
class Config:
    """How a model is sharded, scheduled and lowered.

    Attributes:
        unit_classes: module classes whose instances become sharding units (the outermost match
            wins). ``None`` picks the children of the model's largest ``nn.ModuleList`` /
            ``nn.Sequential`` (one unit per block, as FSDP2 users wrap ``fully_shard`` per block).
            Parameters outside every unit form the root unit.
        lowering: ``"eager"`` runs the transformed FX graphs op by op (fast to compile);
            ``"inductor"`` compiles them with Inductor (C++ on CPU, Triton on GPU).
        timeout_s: seconds a collective may wait for its peers before the process group raises
            (seconds; passed to ``init_process_group`` when zerograph creates the group).
        dump_dir: directory to write every graph before and after every pass; ``None`` reads
            the ``ZEROGRAPH_DUMP`` environment variable, and an empty value turns dumping off.
        disabled_passes: exact pass names to skip (for debugging a pipeline, or
            ``OVERLAP_PASSES`` for the no-overlap baseline). Disabling ``bucketing`` leaves one
            collective per parameter.
        bucket_bytes: fuse the collectives of adjacent units into one while the fused buffer
            stays within this many bytes (full, unsharded bytes). 0 keeps one collective per unit
            (FSDP2's grouping); a unit larger than the cap is never split.
        prefetch_depth: how many units ahead an all-gather starts (0 = issue it just before
            its unit's first use), in forward and, in reverse unit order, in backward.
        max_inflight_bytes: bound on gathered bytes (full, unsharded) of all-gathers started
            but not yet consumed; prefetch starts a gather later rather than exceed it.
            ``None`` bounds by ``prefetch_depth`` alone. The same bound applies to reduce-scatters
            whose waits the scheduler sinks.
        unshard_budget_bytes: stage 3: full bytes of gathered parameters that may stay alive
            from forward to backward instead of being gathered again (``selective_unshard``
            keeps the smallest units first). 0 re-gathers every unit (ZeRO-3 proper).
        reshard_root_after_forward: stage 3: ``True`` (ZeRO-3 as the paper counts it, 3Ψ per step)
            frees the root unit's gathered parameters at the end of forward and gathers them again
            at the start of backward, like every other unit. ``False`` keeps them from forward to
            backward, as FSDP2 does for the root module (its ``reshard_after_forward`` is ignored
            for the root): backward starts with the LM head and final norm, which need them at
            once, so the re-gather only adds a transient all-gather buffer and a send buffer at the
            start of backward and the root's bytes to the step's communication. The root is kept only
            when its collective moves it alone: a ``bucket_bytes`` that fuses it with blocks makes
            ``False`` do nothing (``selective_unshard`` logs a warning).
        activation_budget_bytes: bytes of activations each compiled graph may save from forward
            for backward, per rank; ``activation_partition`` recomputes whole units (transformer
            blocks) in backward, those that free the most bytes per second of recompute first,
            until its estimate fits. ``None``: no budget, every activation the partitioner
            chooses is kept. 0 recomputes every unit (the root unit's activations stay kept).
            With ``activation_offload`` or ``activation_group`` set, offloading and partitioning
            compete with recompute, unit by unit, on bytes freed per second (see
            ``passes/activation_partition.py``).
        activation_offload: let ``activation_partition`` offload a unit's saved activations to
            host memory (copied asynchronously after their last forward use on CUDA, fetched back
            ahead of their backward use), through PyTorch's partitioner-level activation
            offloading (``torch._functorch.config.enable_activation_offloading``; torch 2.11 and 2.13 have it).
            Source: ZeRO (arXiv 1910.02054) section 6.1, CPU offload of activations.
        activation_group: a process group over which the model's activations are replicated (a
            tensor-parallel group, or ranks fed the same batch): ``activation_partition`` may keep
            only this rank's 1/M of a unit's saved activations (M = the group's size) and
            all-gather them back in backward. The activations must be bitwise equal across the
            group, dropout included (the same RNG state on every rank of it): the all-gather
            stitches pieces of different ranks together. ``None``: no partitioning. Source: ZeRO section
            6.1, partitioned activation checkpointing (P_a).
        activation_cost_model: the ``zerograph.costmodel.CostModel`` that prices recompute (roofline
            seconds) and P_a (its all-gather) for ``activation_partition``; offload is priced at
            the host link rate ``HOST_LINK_BYTES_PER_S``; P_a uses its all-gather only if the
            model's ``world_size`` is the activation group's size (else the nominal bus rate). Give every rank the same model (e.g. one
            rank's ``calibrate`` result, broadcast, or a cluster from ``clusters.json``): ranks
            that decide differently would run different collectives. ``None``: nominal rates of
            an H100-class device (``passes/activation_partition.py``).
        param_dtype: mixed precision: dtype of the full parameters that forward and backward
            compute with and that the all-gathers move (e.g. ``torch.bfloat16``: half the bytes of
            fp32). The parameters themselves (the ``DTensor`` shards the optimizer updates) keep
            their own dtype: they are the fp32 master weights. Each shard is cast in the
            all-gather's copy-in, before it is sent. ``None``: each parameter's own dtype (no cast).
            Only floating-point parameters are cast, and not those of ``full_precision_classes``.
            Buffers are never cast, and neither are the forward's inputs: the caller or the model
            casts them (FSDP2 casts inputs by default, ``cast_forward_inputs``; zerograph leaves a
            model's own dtype handling alone). Source: FSDP2's ``MixedPrecisionPolicy.param_dtype``.
        reduce_dtype: dtype gradients are reduced (reduce-scattered or all-reduced) and averaged
            in; each full gradient is cast in the reduction's copy-in, and the reduced shard is
            cast to the parameter's own dtype before it lands in ``.grad``. ``None``: the compute
            dtype (``param_dtype``, or the parameter's own). Source: FSDP2's
            ``MixedPrecisionPolicy.reduce_dtype``.
        full_precision_classes: modules whose parameters ``param_dtype`` leaves in their own dtype.
            By default batch norms (``nn.modules.batchnorm._BatchNorm``: ``BatchNorm1d/2d/3d``,
            ``SyncBatchNorm``): their running statistics are fp32 buffers, and batch norm on a 16-bit
            input wants fp32 weight and statistics alike (on CPU a bf16 weight beside fp32 running
            statistics raises). As FSDP1's ``MixedPrecision`` (``_module_classes_to_ignore``) and
            apex's ``keep_batchnorm_fp32``; FSDP2 would need a separate ``fully_shard`` of each
            batch norm with an fp32 policy. ``()`` casts every floating-point parameter.
    """

    unit_classes: tuple[type[nn.Module], ...] | None = None
    lowering: Literal["eager", "inductor"] = "eager"
    timeout_s: float = 300.0
    dump_dir: str | None = None
    disabled_passes: tuple[str, ...] = ()
    bucket_bytes: int = 0
    prefetch_depth: int = 1
    max_inflight_bytes: int | None = None
    unshard_budget_bytes: int = 0
    reshard_root_after_forward: bool = True
    activation_budget_bytes: int | None = None
    activation_offload: bool = False
    activation_group: torch.distributed.ProcessGroup | None = None
    activation_cost_model: "zerograph.costmodel.CostModel | None" = None  # noqa: F821 (imported lazily)
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # nn.modules.batchnorm._BatchNorm is private, but it is the one base of every batch norm
    full_precision_classes: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)

    def __post_init__(self) -> None:
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"Config.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"Config.timeout_s must be positive seconds, got {self.timeout_s}")
        for field, unit in (("bucket_bytes", "bytes"), ("prefetch_depth", "units"), ("unshard_budget_bytes", "bytes")):
            _check_count(field, getattr(self, field), unit, minimum=0)
        if self.max_inflight_bytes is not None:
            _check_count("max_inflight_bytes", self.max_inflight_bytes, "bytes or None", minimum=1)
        if self.activation_budget_bytes is not None:
            _check_count("activation_budget_bytes", self.activation_budget_bytes, "bytes or None", minimum=0)
        if not isinstance(self.reshard_root_after_forward, bool):
            raise ConfigError(f"Config.reshard_root_after_forward must be a bool, got {self.reshard_root_after_forward!r}")
        if not isinstance(self.activation_offload, bool):
            raise ConfigError(f"Config.activation_offload must be a bool, got {self.activation_offload!r}")
        if self.activation_offload and not hasattr(torch._functorch.config, "enable_activation_offloading"):
            raise ConfigError(f"Config.activation_offload needs PyTorch's partitioner-level activation offloading "
                              f"(torch._functorch.config.enable_activation_offloading), which torch {torch.__version__} lacks")
        from .costmodel import CostModel  # here, not at import: the cost model imports the passes

        if self.activation_cost_model is not None and not isinstance(self.activation_cost_model, CostModel):
            raise ConfigError(f"Config.activation_cost_model must be a zerograph.costmodel.CostModel or None, "
                              f"got {self.activation_cost_model!r}")
        if self.activation_group is not None and not isinstance(self.activation_group, torch.distributed.ProcessGroup):
            raise ConfigError(f"Config.activation_group must be a torch.distributed.ProcessGroup or None, "
                              f"got {self.activation_group!r}")
        unused = [f for f in ("activation_offload", "activation_group", "activation_cost_model")
                  if getattr(self, f) is not None and getattr(self, f) is not False]
        if unused and self.activation_budget_bytes is None:
            raise ConfigError(f"Config.{unused[0]} has no effect without Config.activation_budget_bytes (bytes of "
                              f"saved activations per rank and graph); set a budget, or leave {unused[0]} unset")
        _check_pass_names(self.disabled_passes)
        if self.unit_classes is not None:
            bad = [c for c in self.unit_classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
            if bad:
                raise ConfigError(f"Config.unit_classes must be nn.Module subclasses, got {bad}")
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ConfigError(f"Config.{field} must be a floating-point torch.dtype (e.g. torch.bfloat16) "
                                  f"or None, got {dtype!r}")
        bad = [c for c in self.full_precision_classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ConfigError(f"Config.full_precision_classes must be nn.Module subclasses, got {bad}")

    def resolved_dump_dir(self) -> str | None:
        return self.dump_dir if self.dump_dir is not None else (os.environ.get("ZEROGRAPH_DUMP") or None)


def _check_count(field: str, value: object, unit: str, minimum: int) -> None:
    """An int field (bool, float and str are refused: a typo should not become a schedule)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"Config.{field} must be an int ({unit}), got {value!r}")
    if value < minimum:
        raise ConfigError(f"Config.{field} must be >= {minimum} ({unit}), got {value}")


def _check_pass_names(names: object) -> None:
    from .passes.manager import pass_names  # here, not at import: the passes import the runtime

    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"Config.disabled_passes must be a tuple of pass names, got {names!r}")
    unknown = sorted(set(names) - pass_names())
    if unknown:
        raise ConfigError(f"Config.disabled_passes names unknown passes {unknown}; passes: {sorted(pass_names())}")


def check_stage(stage: object) -> int:
    """Return ``stage`` as an int, or raise ``ConfigError`` naming the valid stages."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(
            f"stage must be one of {STAGES} (0 = DDP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p), got {stage!r}"
        )
    return stage

