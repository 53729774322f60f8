"""The systems the bench compares: ``--systems`` names parsed into ``SystemSpec``s, and each built.

A system is zerograph at a stage with its schedule options (``zerograph-s<0-3>[-noov][-nopool]
[-keeproot][-pf<K>][-bb<BYTES>][-inductor][-islands][-qw][-qg][-tpl|-notpl][-hsdp<S>][-hpz<M>]``), DDP,
FSDP2 or FSDP2 under ``torch.compile``; see the package docstring for what each modifier changes.
``build_system`` wraps a fresh model in one and gives it AdamW; ``train_step`` is the step every system runs.

Source: ``torch.nn.parallel.DistributedDataParallel``; ``torch.distributed.fsdp.fully_shard``;
ZeRO (arXiv 1910.02054) section 7 for the paper's volumes.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..api import compile as compile_model
from ..config import OVERLAP_PASSES, Config
from ..errors import ConfigError
from .workloads import Workload


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One configuration to measure. ``kind``: ``"zerograph"``, ``"ddp"`` or ``"fsdp2"``."""

    name: str
    kind: str
    stage: int | None = None
    overlap: bool = True
    pool: bool = True
    keep_root: bool = False
    prefetch_depth: int = 1
    bucket_bytes: int = 0
    lowering: str = "eager"
    inductor_islands: bool = False
    compiled: bool = False
    quantized_gathers: bool = False
    quantized_reductions: bool = False
    unit_templates: bool | None = None  # None: Config's default
    shard_size: int | None = None
    secondary_partition_size: int | None = None

    @property
    def paper_volume(self) -> int:
        """Multiples of Ψ the ZeRO paper moves per step for this scheme (section 7): 3 for
        ZeRO-3 and FSDP (parameters gathered in forward and again in backward), else 2."""
        return 3 if self.stage == 3 or self.kind == "fsdp2" else 2

    def zerograph_config(self) -> Config:
        return Config(lowering=self.lowering, prefetch_depth=self.prefetch_depth, bucket_bytes=self.bucket_bytes,
                      reshard_root_after_forward=not self.keep_root,
                      gather_quantization="int8" if self.quantized_gathers else None,
                      reduce_quantization="int8" if self.quantized_reductions else None,
                      unit_templates=self.unit_templates, secondary_partition_size=self.secondary_partition_size,
                      inductor_islands=self.inductor_islands,
                      disabled_passes=(() if self.overlap else OVERLAP_PASSES) + (() if self.pool else ("buffer_reuse",)))


_MODIFIER = r"noov|nopool|keeproot|inductor|islands|qw|qg|notpl|tpl|pf\d+|bb\d+|hsdp\d+|hpz\d+"
_ZEROGRAPH_NAME = re.compile(rf"^zerograph-s(?P<stage>[0-3])(?P<mods>(?:-(?:{_MODIFIER}))*)$")


def parse_system(name: str, prefetch_depth: int, bucket_bytes: int) -> SystemSpec:
    """``SystemSpec`` of one ``--systems`` entry; raises ``ConfigError`` for an unknown name."""
    if name == "ddp":
        return SystemSpec(name, "ddp")
    if name in ("fsdp2", "fsdp2-compile"):
        return SystemSpec(name, "fsdp2", compiled=name == "fsdp2-compile")
    match = _ZEROGRAPH_NAME.match(name)
    if not match:
        raise ConfigError(f"unknown system {name!r}: expected zerograph-s<0-3>[-noov][-nopool][-keeproot][-pf<K>][-bb<BYTES>]"
                          "[-inductor][-islands][-qw][-qg][-tpl|-notpl][-hsdp<S>][-hpz<M>], ddp, fsdp2 or fsdp2-compile")
    mods = match["mods"].split("-")[1:]
    kinds = [re.sub(r"\d+$", "", mod) for mod in mods]
    repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
    if repeated:
        raise ConfigError(f"system {name!r} repeats the modifier(s) {', '.join('-' + k for k in repeated)}")
    shard_size = secondary_partition_size = None
    for mod in mods:
        if mod.startswith("pf"):
            prefetch_depth = int(mod[2:])
        elif mod.startswith("bb"):
            bucket_bytes = int(mod[2:])
        elif mod.startswith("hsdp"):
            shard_size = int(mod[4:])
        elif mod.startswith("hpz"):
            secondary_partition_size = int(mod[3:])
    stage = int(match["stage"])
    if shard_size is not None and secondary_partition_size is not None:
        raise ConfigError(f"system {name!r}: -hsdp and -hpz do not combine (hpZ needs a 1-D mesh, as zerograph.compile)")
    if shard_size is not None and stage == 0:
        raise ConfigError(f"system {name!r}: -hsdp needs stage 1-3 (stage 0 replicates everything; nothing to shard)")
    if stage == 0 and ("qw" in mods or "qg" in mods):
        raise ConfigError(f"system {name!r}: -qw / -qg need stage 1-3 (stage 0 all-reduces gradients and gathers nothing)")
    if "tpl" in mods and "notpl" in mods:
        raise ConfigError(f"system {name!r}: -tpl and -notpl contradict each other (templates on / off)")
    templates = True if "tpl" in mods else False if "notpl" in mods else None  # None: Config's default
    if "islands" in mods and "inductor" not in mods:
        raise ConfigError(f"system {name!r}: -islands needs -inductor (islands are what Inductor lowers between units)")
    if secondary_partition_size is not None and stage != 3:
        raise ConfigError(f"system {name!r}: -hpz needs stage 3 (only stage 3 re-gathers parameters in backward)")
    return SystemSpec(name, "zerograph", stage=stage, overlap="noov" not in mods, pool="nopool" not in mods,
                      keep_root="keeproot" in mods, quantized_gathers="qw" in mods, quantized_reductions="qg" in mods,
                      prefetch_depth=prefetch_depth, bucket_bytes=bucket_bytes,
                      lowering="inductor" if "inductor" in mods else "eager", inductor_islands="islands" in mods,
                      unit_templates=templates,
                      shard_size=shard_size, secondary_partition_size=secondary_partition_size)


def check_world_size(spec: SystemSpec, world_size: int) -> None:
    """Refuse, before any rank starts, a ``-hsdp<S>`` or ``-hpz<M>`` that the world cannot hold:
    S (or M) must be at least 2, divide the world size and be smaller than it. Raises ``ConfigError``."""
    for flag, size in (("hsdp", spec.shard_size), ("hpz", spec.secondary_partition_size)):
        if size is not None and (size < 2 or world_size % size or size >= world_size):
            raise ConfigError(f"system {spec.name!r}: -{flag}{size} needs a group size of at least 2 that divides "
                              f"the world size {world_size} and is smaller than it")


def parse_systems(text: str, prefetch_depth: int, bucket_bytes: int) -> list[SystemSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--systems needs distinct names, got {text!r}")
    return [parse_system(n, prefetch_depth, bucket_bytes) for n in names]


def build_system(spec: SystemSpec, workload: Workload, device: torch.device, lr: float
                 ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model wrapped by ``spec``'s system, and AdamW over its parameters."""
    model = workload.build().to(device)
    if spec.kind == "zerograph":
        mesh = None
        if spec.shard_size is not None:  # hybrid sharding: shard inside groups of S ranks, replicate across them
            from torch.distributed.device_mesh import init_device_mesh

            world_size = dist.get_world_size()
            mesh = init_device_mesh(device.type, (world_size // spec.shard_size, spec.shard_size),
                                    mesh_dim_names=("replicate", "shard"))
        model = compile_model(model, spec.stage, mesh=mesh, config=spec.zerograph_config())
    elif spec.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in workload.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if spec.compiled:
            model = torch.compile(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """One training step; returns this rank's loss (detached scalar)."""
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
