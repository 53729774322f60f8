"""User-facing knobs of ``zerograph.compile``."""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

from torch import nn

from .errors import ConfigError

STAGES = (0, 1, 2, 3)
LOWERINGS = ("eager", "inductor")


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
        disabled_passes: exact pass names to skip (for debugging a pipeline).
    """

    unit_classes: tuple[type[nn.Module], ...] | None = None
    lowering: Literal["eager", "inductor"] = "eager"
    timeout_s: float = 300.0
    dump_dir: str | None = None
    disabled_passes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"Config.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"Config.timeout_s must be positive seconds, got {self.timeout_s}")
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

