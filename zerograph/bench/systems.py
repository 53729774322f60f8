"""The systems the bench compares: ``--systems`` names parsed into ``SystemSpec``s, and each built.

A zerograph system is a ``Config``: ``zerograph-s<0-3>`` then modifiers, each of which sets one
``Config`` field or policy field (``MODIFIERS``; ``-pf2`` is ``schedule.prefetch_depth=2``) on the bench's base
(``--prefetch-depth``, ``--bucket-bytes``, and ``lowering="eager"``), and ``Config`` itself checks
the result. ``-hsdp<S>`` is the one modifier that is not a ``Config`` keyword: it is
``zerograph.compile``'s mesh. The other systems are DDP, FSDP2 and FSDP2 under ``torch.compile``.
``build_system`` wraps a fresh model in one and gives it AdamW; ``train_step`` is the step every
system runs.

Source: ``torch.nn.parallel.DistributedDataParallel``; ``torch.distributed.fsdp.fully_shard``;
ZeRO (arXiv 1910.02054) section 7 for the paper's volumes.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api import compile as compile_model
from ..config import OVERLAP_PASSES, POLICIES, Config, check_stage_options
from ..errors import ConfigError
from .workloads import Workload

# modifier of a zerograph system's name -> (the Config field it sets, "policy.field" for a policy's,
# its value); ``int``: the number written after the modifier (``-bb65536``). ``disabled_passes`` accumulates.
MODIFIERS: dict[str, tuple[str, Any]] = {
    "noov": ("disabled_passes", OVERLAP_PASSES),      # every wait right after its start
    "pool": ("memory.pool_comm_buffers", True),  # comm buffers from a pool held across steps (buffer_reuse)
    "keeproot": ("memory.reshard_root_after_forward", False),
    "pf": ("schedule.prefetch_depth", int),
    "bb": ("schedule.bucket_bytes", int),
    "inductor": ("lowering", "inductor"),
    "islands": ("inductor_islands", True),
    "qw": ("gather_quantization", "int8"),
    "qg": ("reduce_quantization", "int8"),
    "tpl": ("unit_templates", True),
    "notpl": ("unit_templates", False),
    "hpz": ("secondary_partition_size", int),
}
MESH_MODIFIER = "hsdp"  # -hsdp<S>: a (world / S, S) mesh of dims ("replicate", "shard"), compile's mesh=
# the bench runs the FX graphs eagerly unless a name says -inductor (Config's "auto" would pick by device)
BASE_SETTINGS = {"lowering": "eager"}

_NUMBERED = [m for m, (_, value) in MODIFIERS.items() if value is int] + [MESH_MODIFIER]
_MODIFIER = "|".join(sorted([rf"{m}\d+" for m in _NUMBERED] + [m for m in MODIFIERS if m not in _NUMBERED],
                            key=len, reverse=True))
_ZEROGRAPH_NAME = re.compile(rf"^zerograph-s(?P<stage>[0-3])(?P<mods>(?:-(?:{_MODIFIER}))*)$")
GRAMMAR = "zerograph-s<0-3>" + "".join(f"[-{m}{'<N>' if m in _NUMBERED else ''}]" for m in [*MODIFIERS, MESH_MODIFIER])


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One configuration to measure.

    Attributes:
        name: as written in ``--systems``.
        kind: ``"zerograph"``, ``"ddp"`` or ``"fsdp2"``.
        stage: zerograph's ZeRO stage; ``None`` for the others.
        settings: the ``Config`` fields of a zerograph system, as ``(field, value)`` pairs
            (``"policy.field"`` for a policy's; the bench's base, then the name's modifiers);
            ``config`` builds them (``config_of``).
        shard_size: ``-hsdp<S>``: S, the ranks of the shard dim of a 2-D mesh; ``None``: 1-D.
        compiled: ``fsdp2-compile``: FSDP2 under ``torch.compile``.
    """

    name: str
    kind: str
    stage: int | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    shard_size: int | None = None
    compiled: bool = False

    @property
    def config(self) -> Config:
        """The zerograph system's ``Config`` (raises ``ConfigError`` for another kind)."""
        if self.kind != "zerograph":
            raise ConfigError(f"system {self.name!r} is {self.kind}, not zerograph: it has no Config")
        return config_of(dict(self.settings))

    @property
    def paper_volume(self) -> int:
        """Multiples of Ψ the ZeRO paper moves per step for this scheme (section 7): 3 for
        ZeRO-3 and FSDP (parameters gathered in forward and again in backward), else 2."""
        return 3 if self.stage == 3 or self.kind == "fsdp2" else 2

    def describe(self) -> dict[str, Any]:
        """Plain data for the JSON: what the name set (Config fields, tuples as lists)."""
        return {"name": self.name, "kind": self.kind, "stage": self.stage, "shard_size": self.shard_size,
                "compiled": self.compiled,
                "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.settings}}


def parse_system(name: str, prefetch_depth: int, bucket_bytes: int) -> SystemSpec:
    """``SystemSpec`` of one ``--systems`` entry; ``prefetch_depth`` and ``bucket_bytes`` are the
    base a name's ``-pf`` / ``-bb`` override. Raises ``ConfigError`` for an unknown name or a
    ``Config`` that ``Config`` or ``zerograph.compile`` would refuse."""
    if name == "ddp":
        return SystemSpec(name, "ddp")
    if name in ("fsdp2", "fsdp2-compile"):
        return SystemSpec(name, "fsdp2", compiled=name == "fsdp2-compile")
    match = _ZEROGRAPH_NAME.match(name)
    if not match:
        removed = (" (-nopool is gone: comm buffers come from the allocator by default; -pool asks for the pool)"
                   if "-nopool" in name else "")
        raise ConfigError(f"unknown system {name!r}: expected {GRAMMAR}, ddp, fsdp2 or fsdp2-compile{removed}")
    stage = int(match["stage"])
    mods = [re.fullmatch(r"([a-z]+)(\d*)", mod).groups() for mod in match["mods"].split("-")[1:]]
    repeated = sorted({m for m, _ in mods if [k for k, _ in mods].count(m) > 1})
    if repeated:
        raise ConfigError(f"system {name!r} repeats the modifier(s) {', '.join('-' + k for k in repeated)}")
    settings: dict[str, Any] = {**BASE_SETTINGS, "schedule.prefetch_depth": prefetch_depth,
                                "schedule.bucket_bytes": bucket_bytes}
    set_by: dict[str, str] = {}
    shard_size = None
    for mod, number in mods:
        if mod == MESH_MODIFIER:
            shard_size = int(number)
            continue
        keyword, value = MODIFIERS[mod]
        if keyword in set_by and keyword != "disabled_passes":
            raise ConfigError(f"system {name!r}: -{set_by[keyword]} and -{mod} both set Config.{keyword}")
        set_by[keyword] = mod
        value = int(number) if value is int else value
        settings[keyword] = settings.get(keyword, ()) + value if keyword == "disabled_passes" else value
    try:
        check_stage_options(config_of(settings), stage, hybrid=shard_size is not None)
    except ConfigError as exc:
        raise ConfigError(f"system {name!r}: {exc}") from None
    return SystemSpec(name, "zerograph", stage, tuple(settings.items()), shard_size)


def config_of(settings: dict[str, Any]) -> Config:
    """The ``Config`` of ``settings``: ``Config`` fields by name, and a policy's fields as
    ``"policy.field"`` (``"schedule.prefetch_depth"``), gathered into that policy.

    Raises:
        ConfigError: a value ``Config`` or a policy refuses.
    """
    fields: dict[str, Any] = {}
    policies: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        policy, _, field = name.rpartition(".")
        if policy:
            policies.setdefault(policy, {})[field] = value
        else:
            fields[name] = value
    return Config(**fields, **{policy: POLICIES[policy](**values) for policy, values in policies.items()})


def check_world_size(spec: SystemSpec, world_size: int) -> None:
    """Refuse, before any rank starts, a ``-hsdp<S>`` or ``-hpz<M>`` that the world cannot hold:
    S (or M) must be at least 2, divide the world size and be smaller than it. Raises ``ConfigError``."""
    hpz = spec.config.secondary_partition_size if spec.kind == "zerograph" else None
    for flag, size in ((MESH_MODIFIER, spec.shard_size), ("hpz", hpz)):
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
        model = compile_model(model, spec.stage, mesh=mesh, config=spec.config)
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


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor],
               loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """One training step; returns this rank's loss (detached scalar). ``loss_fn(model, *batch)``
    computes the loss outside the model (``Workload.loss``); ``None``: ``model(*batch)`` returns it."""
    loss = model(*batch) if loss_fn is None else loss_fn(model, *batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
