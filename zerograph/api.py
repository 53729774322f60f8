"""``zerograph.compile``: shard a model's parameters and capture its step for the passes."""
from __future__ import annotations

import datetime
import logging
import os
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import runtime as runtime_mod
from .capture import CapturedGraphs, make_backend
from .config import Config, check_stage
from .errors import ProcessGroupError, ShardingError, UnshardedParameterError
from .runtime import Runtime
from .sharding import find_units, set_gathering, shard_module_

log = logging.getLogger(__name__)

STATE_ATTR = "_zerograph"


class ZeroGraphState:
    """Everything ``compile`` attached to a model (reachable as ``model._zerograph``)."""

    def __init__(self, runtime: Runtime, config: Config, captured: CapturedGraphs, compiled_forward: Any):
        self.runtime = runtime
        self.config = config
        self.captured = captured
        self.compiled_forward = compiled_forward


def compile(model: nn.Module, stage: int, *, process_group: dist.ProcessGroup | None = None,
            config: Config | None = None) -> nn.Module:
    """Shard ``model`` for ZeRO stage ``stage`` and capture its forward and backward as graphs.

    The model is changed in place and returned (as ``torch.distributed.fsdp.fully_shard`` does): its
    class and parameter names stay, its parameters become this rank's shards, ``DTensor`` with
    ``Shard(0)`` over a 1-D mesh of ``process_group`` (``Replicate()`` at stage 0), so stock
    ``torch.optim`` optimizers, ``clip_grad_norm_``, ``state_dict`` and
    ``torch.distributed.checkpoint`` work on them. Calling the model runs its forward through
    ``torch.compile`` with zerograph's backend; backward reduces gradients into the shards,
    averaged over ranks (DDP's semantics).

    Args:
        model: the module; all parameters on one device (CPU with gloo, CUDA with NCCL).
        stage: 0 (DDP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p), ZeRO paper (arXiv 1910.02054) section 5.
        process_group: ranks that shard the model; default the world group. When no group is
            initialised, one is created from the torchrun environment, or a one-rank group.
        config: ``zerograph.Config``; defaults apply when ``None``.

    Raises:
        ConfigError: ``stage`` not in 0-3, or a bad ``Config`` field.
        ShardingError: parameters on several devices, or a 0-d parameter; the model was compiled already.
        ProcessGroupError: the group does not match the launch (``WORLD_SIZE``), or this rank is not in it.
    """
    stage = check_stage(stage)
    config = config or Config()
    if hasattr(model, STATE_ATTR):
        raise ShardingError("this model was already compiled by zerograph; compile a fresh instance")
    device = _single_device(model)
    group = _resolve_group(process_group, device, config)
    mesh = DeviceMesh.from_group(group, device.type)
    originals = {name: p for name, p in model.named_parameters()}
    units = find_units(model, config.unit_classes)
    layouts, unit_objs = shard_module_(model, mesh, stage, units, runtime_mod.next_key)
    runtime = Runtime(group, stage, layouts, unit_objs)
    for name, param in originals.items():
        param._zerograph_replaced = name  # type: ignore[attr-defined]
    _install_optimizer_guard()

    captured = CapturedGraphs()
    param_names = {id(p): n for n, p in model.named_parameters()}  # first name of each (tied) parameter
    backend = make_backend(runtime, config, param_names, captured)
    compiled_forward = torch.compile(type(model).forward, backend=backend, dynamic=False)
    setattr(model, STATE_ATTR, ZeroGraphState(runtime, config, captured, compiled_forward))
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"forward": _compiled_forward})
    log.info("zerograph: stage %d, world size %d, %d units, %d parameters (%d elements)", stage,
             runtime.world_size, len(unit_objs), len(layouts), sum(layout.numel for layout in layouts))
    return model


def _compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: ZeroGraphState = getattr(self, STATE_ATTR)
    state.runtime.start_forward()
    previous = set_gathering(True)
    try:
        return state.compiled_forward(self, *args, **kwargs)
    finally:
        set_gathering(previous)


def _single_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ShardingError(f"all parameters must live on one device before compile; found {sorted(map(str, devices))}")
    if not devices:
        raise ShardingError("the model has no parameters to shard")
    device = devices.pop()
    if device.type == "meta":
        raise ShardingError("parameters are on the meta device; materialise them (e.g. to_empty + init) first")
    return device


def _resolve_group(group: dist.ProcessGroup | None, device: torch.device, config: Config) -> dist.ProcessGroup:
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


_GUARD_INSTALLED = False


def _install_optimizer_guard() -> None:
    """Fail an optimizer step over parameters that ``compile`` replaced by shards."""
    global _GUARD_INSTALLED
    if _GUARD_INSTALLED:
        return
    checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        if checked.get(optimizer) == n:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = getattr(p, "_zerograph_replaced", None)
                if name is not None:
                    raise UnshardedParameterError(
                        f"the optimizer holds the original parameter {name!r}, which zerograph.compile "
                        "replaced by its shard; build the optimizer from model.parameters() after compile")
        checked[optimizer] = n

    register_optimizer_step_pre_hook(guard)
    _GUARD_INSTALLED = True


def state_of(model: nn.Module) -> ZeroGraphState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ShardingError("this model was not compiled by zerograph.compile")
    return state
