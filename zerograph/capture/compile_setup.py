"""What ``zerograph.compile`` checks and resolves before it shards: the model it is given, the
device its shards live on, and the process groups (plain, hybrid, hpZ's node group).

Each function raises the named error ``compile`` documents; none changes the model.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import Config, check_stage_options
from ..errors import ConfigError, ProcessGroupError, ShardingError
from ..runtime.state import STATE_ATTR
from ..shard.hybrid import hybrid_groups, secondary_group
from ..shard.sharding import sharded_parameter


def check_arguments(model: object, stage: int, config: object, process_group: object, mesh: object) -> Config:
    """The ``Config`` to compile ``model`` with (the default when ``config`` is ``None``), once the
    arguments are ones ``compile`` takes: an ``nn.Module`` not sharded yet, without sparse
    gradients, a ``Config``, a process group or a ``DeviceMesh`` (not both), and options that
    ``stage`` allows (``config.check_stage_options``).

    Raises:
        ShardingError: not a module, sharded already, or with sparse gradients.
        ConfigError: a bad ``config`` or ``mesh``, both a group and a mesh, or options ``stage``
            does not allow.
    """
    if not isinstance(model, nn.Module):
        raise ShardingError(f"zerograph.compile takes an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, Config):
        raise ConfigError(f"config must be a zerograph.Config, got {type(config).__name__}: "
                          f"write config=zerograph.Config(...)")
    config = config or Config()
    _check_not_sharded(model)
    _check_no_sparse_gradients(model)
    if mesh is not None and process_group is not None:
        raise ConfigError("zerograph.compile takes a process_group or a mesh, not both: pass the 2-D DeviceMesh "
                          "alone (its shard dim's group shards, its replicate dim's group replicates)")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ConfigError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    check_stage_options(config, stage, hybrid=mesh is not None and mesh.ndim == 2)
    return config


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a compiled model lives: its shards' device and the process groups its collectives use.

    Attributes:
        device: the shards' (and a meta-built model's buffers') device.
        meta_built: the model was built on the meta device.
        group: the shard group (all-gathers, reduce-scatters).
        mesh: the ``DeviceMesh`` the parameters' ``DTensor`` shards live on.
        replicate_group: hybrid sharding's replicate group, else ``None``.
        world_group: the group over which replicas start alike (the whole world with a 2-D mesh).
        node_group: hpZ's group of M ranks, else ``None``.
    """

    device: torch.device
    meta_built: bool
    group: dist.ProcessGroup
    mesh: DeviceMesh
    replicate_group: dist.ProcessGroup | None
    world_group: dist.ProcessGroup
    node_group: dist.ProcessGroup | None

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)


def place(model: nn.Module, config: Config, process_group: dist.ProcessGroup | None,
          mesh: DeviceMesh | None, device: torch.device | str | int | None) -> Placement:
    """Resolve ``compile``'s ``process_group`` / ``mesh`` / ``device`` into a ``Placement``,
    creating the default process group when none is initialised (torchrun's environment, or one
    rank). A 1-D mesh is its group; a 2-D mesh is hybrid sharding (``hybrid.py``).

    Raises:
        ShardingError: ``target_device``'s refusals.
        ProcessGroupError: ``resolve_group``'s; a mesh that does not span the world.
        ConfigError: ``hybrid_groups``' and ``secondary_group``'s refusals.
    """
    if mesh is not None and mesh.ndim == 1:  # FSDP2's 1-D mesh: plain sharding over its group
        process_group, mesh = mesh.get_group(), None
    device, meta_built = target_device(model, device, process_group)
    group = resolve_group(process_group, device, config)
    hybrid = mesh is not None
    replicate_group = None
    if hybrid:  # ``group`` becomes the shard group
        group, replicate_group = hybrid_groups(mesh, device)
    node_group = secondary_group(group, config.secondary_partition_size, config.timeout_s)
    return Placement(device, meta_built, group, mesh if hybrid else DeviceMesh.from_group(group, device.type),
                     replicate_group, dist.group.WORLD if hybrid else group, node_group)


def _check_not_sharded(model: nn.Module) -> None:
    """Refuse a model, or a part of one, whose parameters are already shards."""
    if hasattr(model, STATE_ATTR):
        raise ShardingError("this model was already compiled by zerograph; call it as it is, or compile a "
                            "fresh instance (e.g. built again, or copy.deepcopy'd before the first compile)")
    name = sharded_parameter(model)
    if name is not None:
        raise ShardingError(
            f"parameter {name!r} is already sharded (a DTensor): this module is, or contains, a part of a "
            "model that zerograph.compile (or FSDP) sharded already. Compile the whole model once and call "
            "it; choose how its parameters are grouped with Config(unit_classes=...)")


def _check_no_sparse_gradients(model: nn.Module) -> None:
    """Refuse modules that produce sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True``), at every stage. Stages 1-3 reduce-scatter flat, padded gradient buckets,
    which a sparse gradient is not; and at every stage, 0 included, the parameters are ``DTensor``s,
    which hold no sparse tensor (a sparse ``.grad`` fails inside DTensor: ``aten::view`` has no
    sparse kernel), so DDP's sparse all-reduce has nowhere to land."""
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse:
            raise ShardingError(
                f"module {name or '<root>'!r} ({type(mod).__name__}) has sparse=True: its weight's gradient would "
                "be a sparse tensor, which zerograph's sharded parameters (DTensors, at every stage) cannot hold "
                "nor its bucketed reductions move. Build it with sparse=False (a dense gradient; use an optimizer "
                "other than SparseAdam), or train this model with DistributedDataParallel")


def target_device(model: nn.Module, device: torch.device | str | int | None,
                   group: dist.ProcessGroup | None) -> tuple[torch.device, bool]:
    """The device the shards live on, and whether the model was built on the meta device."""
    params = list(model.named_parameters())
    if not params:
        raise ShardingError("the model has no parameters to shard")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ShardingError(f"device={device!r} is not a device zerograph can place shards on") from exc
    meta = [n for n, p in params if p.is_meta]
    real = [(n, p.device) for n, p in params if not p.is_meta]
    if meta and real:
        raise ShardingError(
            f"all parameters must live on one device before compile, but they are partly on the meta device "
            f"({_names(meta)}) and partly not "
            f"({_names([f'{n} on {d}' for n, d in real])}); build all of it on the meta device, or none")
    if not meta:
        meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ShardingError(f"buffers {_names(meta_buffers)} are on the meta device but the parameters are "
                                "not; build the whole model on the meta device, or give the buffers values")
        devices = {d for _, d in real}
        if len(devices) > 1:
            raise ShardingError(f"all parameters must live on one device before compile; found {sorted(map(str, devices))}")
        own = devices.pop()
        if device is not None and (device.type != own.type or device.index not in (None, own.index)):
            raise ShardingError(f"device={str(device)!r} given, but the parameters are on {own}; device= places a "
                                "meta-built model's shards: move a built model with .to() before compile")
        return own, False
    if device is None:
        nccl = (dist.get_backend(group) == "nccl") if dist.is_initialized() else torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    usable = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())
    if not usable:
        raise ShardingError(f"the model is on the meta device ({_names(meta)}) and device={str(device)!r} cannot "
                            "hold its shards: pass compile(..., device='cpu') (gloo) or a CUDA device (NCCL)")
    return device, True


def _names(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def resolve_group(group: dist.ProcessGroup | None, device: torch.device, config: Config) -> dist.ProcessGroup:
    launched = os.environ.get("WORLD_SIZE")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=config.timeout_s)
        if launched and int(launched) > 1:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    if launched and int(launched) != dist.get_world_size():
        raise ProcessGroupError(
            f"the default process group has {dist.get_world_size()} ranks but the launch set WORLD_SIZE={launched}")
    group = group or dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ProcessGroupError(f"rank {dist.get_rank()} is not a member of the given process group")
    return group
