"""User-facing knobs of ``zerograph.compile``."""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

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

    def __post_init__(self) -> None:
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"Config.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"Config.timeout_s must be positive seconds, got {self.timeout_s}")
        if self.bucket_bytes < 0:
            raise ConfigError(f"Config.bucket_bytes must be >= 0 bytes, got {self.bucket_bytes}")
        if self.prefetch_depth < 0:
            raise ConfigError(f"Config.prefetch_depth must be >= 0 units, got {self.prefetch_depth}")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes <= 0:
            raise ConfigError(f"Config.max_inflight_bytes must be positive bytes or None, got {self.max_inflight_bytes}")
        if self.unshard_budget_bytes < 0:
            raise ConfigError(f"Config.unshard_budget_bytes must be >= 0 bytes, got {self.unshard_budget_bytes}")
        if self.unit_classes is not None:
            bad = [c for c in self.unit_classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
            if bad:
                raise ConfigError(f"Config.unit_classes must be nn.Module subclasses, got {bad}")

    def resolved_dump_dir(self) -> str | None:
        return self.dump_dir if self.dump_dir is not None else (os.environ.get("ZEROGRAPH_DUMP") or None)


def check_stage(stage: object) -> int:
    """Return ``stage`` as an int, or raise ``ConfigError`` naming the valid stages."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(
            f"stage must be one of {STAGES} (0 = DDP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p), got {stage!r}"
        )
    return stage

