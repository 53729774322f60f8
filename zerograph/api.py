"""``zerograph.compile``: shard a model's parameters and capture its step for the passes.

``compile``'s body is the stages in order, one short call each: check the arguments and place
the model (``capture/compile_setup.py``); plan its units and a schedule that fits the memory
budget, read off the unsharded model (``planning/``); shard it (``shard/``); build the runtime
that holds the shards (``runtime/``); trace each kind of unit as a template (``templates/``),
which needs the runtime's shards; put the forward under ``torch.compile`` (``capture/``), whose
backend needs all of it. The graphs are captured at the first call.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .capture.capture import ZeroGraphBackend
from .capture.compile_setup import Placement, check_arguments, place
from .capture.compiled_model import compiled_class
from .config import Config, check_stage
from .errors import UnshardedParameterError
from .graph.registry import next_key
from .planning.budget import fit_memory_budget
from .runtime.runtime import Runtime
from .runtime.state import STATE_ATTR, CapturedGraphs, ZeroGraphState
from .shard.flat import FlatShard, flatten_unit_, flattenable
from .shard.replicas import sync_replicas
from .shard.sharding import ParameterWatch, ParamLayout, Unit, find_units, shard_module_, traceable_forward
from .shard.uninitialised import UninitialisedTracker, allocate_meta_buffers_
from .shard.units import warn_large_units
from .templates.kinds import FlatPlan, install_unit_templates, unit_parameters

log = logging.getLogger(__name__)

def compile(model: nn.Module, stage: int, *, process_group: dist.ProcessGroup | None = None,
            mesh: DeviceMesh | None = None, config: Config | None = None,
            device: torch.device | str | int | None = None) -> nn.Module:
    """Shard ``model`` for ZeRO stage ``stage`` and capture its forward and backward as graphs.

    The model is changed in place and returned (as ``torch.distributed.fsdp.fully_shard`` does): its
    class and parameter names stay, its parameters become this rank's shards, ``DTensor`` with
    ``Shard(0)`` over a 1-D mesh of ``process_group`` (``Replicate()`` at stage 0), so stock
    ``torch.optim`` optimizers, ``clip_grad_norm_``, ``state_dict`` and
    ``torch.distributed.checkpoint`` work on them. Calling the model runs its forward through
    ``torch.compile`` with zerograph's backend; backward reduces gradients into the shards,
    averaged over ranks (DDP's semantics). For gradient accumulation without communication the
    model gains ``set_requires_gradient_sync(bool)`` (FSDP2's) and ``no_sync()`` (DDP's); mixed
    precision is ``Config(mixed_precision=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...))``
    (FSDP2's ``MixedPrecisionPolicy``).

    A model built on the meta device (``with torch.device("meta"): model = Model(cfg)``) is
    accepted too (FSDP2's meta-device recipe, DeepSpeed's ``zero.Init``): each rank then allocates
    only its own shards, and the buffers, on ``device``, never a full parameter; their memory is
    uninitialised until ``zerograph.init_weights(model)``, ``model.load_state_dict(full_sd)`` or
    ``zerograph.load_safetensors(model, path)`` writes it, and calling the model before that
    raises ``ShardingError`` naming the tensors still empty. The compiled model's
    ``load_state_dict`` takes full, plain tensors (each rank copies its rows) as well as shards.

    Args:
        model: the module; all parameters on one device (CPU with gloo, CUDA with NCCL), or all
            on the meta device.
        stage: 0 (DDP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p), ZeRO paper (arXiv 1910.02054) section 5.
        process_group: ranks that shard the model; default the world group. When no group is
            initialised, one is created from the torchrun environment, or a one-rank group.
        mesh: instead of ``process_group``, a ``DeviceMesh`` as FSDP2's ``fully_shard(mesh=...)``
            takes it. 1-D: the same as ``process_group=mesh.get_group()``. 2-D: hybrid sharding
            (FSDP2's HSDP, DeepSpeed's MiCS), dims ``(replicate, shard)`` in that order (FSDP2's
            convention; unnamed, or named ``("replicate", "shard")`` or torchtitan's
            ``("dp_replicate", "dp_shard")``): parameters, gradients and optimizer states are
            sharded over the shard dim and replicated over the replicate dim (each parameter a
            ``DTensor`` on ``mesh`` with placements ``(Replicate(), Shard(0))``); all-gathers and
            reduce-scatters run within the shard group, and each reduced gradient shard is then
            all-reduced across the replicate group, so gradients are averaged over all N = R x S
            ranks (DDP's semantics). Stages 1-3 only; the mesh must span the whole default group.
        config: ``zerograph.Config``; defaults apply when ``None``.
        device: where a meta-built model's shards and buffers are allocated. ``None``: CUDA's
            current device when the process group is NCCL (or, with no group yet, when CUDA is
            available), else the CPU (gloo). For a model with real parameters it must be ``None``
            or their device (move the model with ``.to()`` before compile instead).

    Raises:
        ConfigError: ``stage`` not in 0-3, a bad ``Config`` field, or ``gather_quantization`` /
            ``reduce_quantization`` at stage 0.
        ShardingError: parameters on several devices, or partly on the meta device (named); a
            ``device`` that cannot hold the shards (meta, CUDA without CUDA, or not the device of
            a model's real parameters); the model was compiled already, or it is a part of a
            compiled model (its parameters are ``DTensor`` shards already); a module with sparse
            gradients (``nn.Embedding(sparse=True)``, at every stage).
        ProcessGroupError: the group does not match the launch (``WORLD_SIZE``), or this rank is not in it;
            a ``mesh`` whose size is not the world size.
        ConfigError (also for ``mesh``): ``mesh`` not a ``DeviceMesh``, given together with
            ``process_group``, of 3 or more dims, with dims named other than ``(replicate, shard)``,
            of another device type than the model's, with a shard dim of one rank and replicas
            (nothing to shard: use stage 0 over ``process_group``); a 2-D mesh at stage 0 (DDP
            replicates everything: pass ``process_group``, or a 1-D mesh, instead).

    Warns ``UnitSizeWarning`` at stage 3 when one unit, the root included, holds more than a quarter
    of the parameters and repeated blocks inside it could be units; the message names the
    ``Config(unit_classes=...)`` that splits it (``zerograph.shard.units``, where the default units are
    found: the children of the model's stacks of repeated blocks).

    Collective: every rank of the group takes group rank 0's parameters and buffers (``replicas.py``).

    Calling the compiled model raises (each a ``ZeroGraphError``):
        ModelChangedError: a parameter was added or replaced, or a ``requires_grad`` flipped, after
            compile (freeze before compile instead).
        ScheduleMismatchError: on every rank, when ranks are about to run different collectives
            (checked before each graph's first collective; see ``ScheduleCheck.check_schedule``).
        CollectiveError: a collective failed or timed out (``Config.timeout_s``): a peer died or stopped.
        ShardingError: a submodule called (or ``torch.compile``d) on its own, outside the model's forward.
    """
    stage = check_stage(stage)
    config = check_arguments(model, stage, config, process_group, mesh)
    placement = place(model, config, process_group, mesh, device)
    sync_replicas(model, placement.world_group, placement.device)  # all start from rank 0's values, as with DDP
    units, config = _plan(model, stage, config, placement)
    layouts, unit_objs, fresh_buffers = _shard(model, stage, config, placement, units)
    runtime = _build_runtime(model, stage, config, placement, layouts, unit_objs)
    captured = CapturedGraphs()
    unit_kinds = _install_templates(runtime, config, units, captured)
    uninitialised = _uninitialised(model, runtime, fresh_buffers) if placement.meta_built else None
    _capture(model, runtime, config, captured, unit_kinds, uninitialised)
    log.info("zerograph: stage %d, world size %d (x %d replicas), %d units, %d parameters (%d elements)", stage,
             runtime.topology.world_size, runtime.topology.replicate_size, len(runtime.units), len(runtime.layouts),
             sum(layout.numel for layout in runtime.layouts.values()))
    return model


def _plan(model: nn.Module, stage: int, config: Config, placement: Placement) -> tuple[list[tuple[str, nn.Module]], Config]:
    """The units (``(name, module)`` in order, warned about when one is too large) and the
    ``config`` whose schedule fits ``Config.memory``'s budget (``planning.budget``), both read off
    the model before sharding: the blocks' classes and full parameters are still its own."""
    units = find_units(model, config.unit_classes)
    warn_large_units(model, units, stage)
    return units, fit_memory_budget(model, stage, placement.shard_size, placement.replicate_size, config)


def _shard(model: nn.Module, stage: int, config: Config, placement: Placement,
           units: list[tuple[str, nn.Module]]) -> tuple[list[ParamLayout], list[Unit], list]:
    """Replace ``model``'s parameters by this rank's shards (``sharding.shard_module_``), refuse an
    optimizer step over the replaced ones, and allocate a meta-built model's buffers on the device;
    returns the parameters' layouts, the units and the ``(name, buffer)`` pairs allocated."""
    precision = config.mixed_precision
    originals = dict(model.named_parameters())
    layouts, unit_objs = shard_module_(model, placement.mesh, stage, units, next_key,
                                       param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
                                       full_precision_classes=precision.full_precision_classes,
                                       device=placement.device)
    _install_optimizer_guard(originals)
    fresh = allocate_meta_buffers_(model, placement.device) if placement.meta_built else []
    return layouts, unit_objs, fresh


def _build_runtime(model: nn.Module, stage: int, config: Config, placement: Placement, layouts: list[ParamLayout],
                   unit_objs: list[Unit]) -> Runtime:
    """The ``Runtime`` the graphs call into, holding the model's shards."""
    runtime = Runtime(placement.group, stage, layouts, unit_objs, timeout_s=config.timeout_s, device=placement.device,
                      replicate_group=placement.replicate_group, world_group=placement.world_group,
                      secondary_group=placement.node_group)
    runtime.shards.update({layout.key: model.get_parameter(layout.fqn) for layout in layouts})
    runtime.eager.gather_quantization = config.gather_quantization  # graph breaks' eager gathers quantize too
    runtime.eager.reduce_quantization = config.reduce_quantization  # and their reductions
    return runtime


def _install_templates(runtime: Runtime, config: Config, units: list[tuple[str, nn.Module]],
                       captured: CapturedGraphs) -> list:
    """With ``Config.unit_templates``: each kind of repeated unit traced once and called per unit
    (``templates.kinds.install_unit_templates``), its shards moved into flat buffers where they can be;
    the kinds (``templates.kinds.UnitKind``), or none."""
    if not config.unit_templates:
        return []
    key_of = {id(shard): key for key, shard in runtime.shards.items()}
    unit_kinds = install_unit_templates(units, key_of, config.resolved_lowering(runtime.device), captured.templates,
                                        _flat_plan(runtime, config, units, key_of))
    runtime.add_flat_shards([flat for kind in unit_kinds for flat in kind.flat_shards])
    for kind in unit_kinds:
        kind.strict = config.strict_templates
    kinds = list(unit_kinds)  # weakly held elsewhere: the report reads them through the state's list
    captured.unit_paths = lambda: [kind.path() for kind in kinds]
    return unit_kinds


def _uninitialised(model: nn.Module, runtime: Runtime, fresh_buffers: list) -> UninitialisedTracker:
    """A meta-built model's tracker of the shards and buffers no init or load has written yet
    (counted from here: moving shards into flat buffers wrote them, with no values yet)."""
    in_flat_shards = frozenset(id(shard) for flat in runtime.flat_shards.values() for shard in flat.shards)
    return UninitialisedTracker(list(model.named_parameters()) + fresh_buffers, shared=in_flat_shards)


def _capture(model: nn.Module, runtime: Runtime, config: Config, captured: CapturedGraphs, unit_kinds: list,
             uninitialised: UninitialisedTracker | None) -> None:
    """Put ``model``'s forward under ``torch.compile`` with zerograph's backend and give the model
    its compiled class (``compiled_model.compiled_class``) and state (``state.ZeroGraphState``)."""
    param_names = {id(p): n for n, p in model.named_parameters()}  # first name of each (tied) parameter
    watch = ParameterWatch(model)
    backend = _checking_trainable(ZeroGraphBackend(runtime, config, param_names, captured), watch)
    # dynamic=None (torch.compile's automatic dynamic shapes): a graph is first compiled for the shapes
    # it sees; when an input's size changes (a rank's sequence length), one recompile makes that dim
    # symbolic, so per-rank, per-step lengths cost at most two graphs instead of one per length (and
    # never reach Dynamo's recompile limit, past which a frame would run eagerly on some ranks only).
    # Parameters stay static (Dynamo's force_parameter_static_shapes), so the collectives do too.
    compiled_forward = torch.compile(traceable_forward(type(model)), backend=backend, dynamic=None)
    setattr(model, STATE_ATTR, ZeroGraphState(runtime, config, captured, compiled_forward, watch,
                                              uninitialised=uninitialised, unit_kinds=unit_kinds))
    model.__class__ = compiled_class(type(model))


def _flat_plan(runtime: Runtime, config: Config, units: list[tuple[str, nn.Module]],
               key_of: dict[int, int]) -> FlatPlan | None:
    """How the templated units' shards move into one flat buffer per unit (``flat.py``), or
    ``None`` where they stay one input per parameter: with hpZ or quantized collectives (not built
    for them yet). At stages 1-2 the unit's gathered flat buffer is what its forward saves for
    backward (the parameters' gathered copies at those stages, in one buffer); at stage 0 the
    buffer holds the whole parameters, read as they are, and its gradient is all-reduced whole."""
    if (config.secondary_partition_size is not None or config.gather_quantization
            or config.reduce_quantization):
        return None
    uses: dict[int, int] = {}
    for _, module in units:
        for param in unit_parameters(module):
            uses[id(param)] = uses.get(id(param), 0) + 1

    def layouts(module: nn.Module) -> tuple[list[nn.Parameter], list]:
        params = unit_parameters(module)
        return params, [runtime.layouts[key_of[id(p)]] for p in params]

    def can(index: int, module: nn.Module) -> str | None:
        params, param_layouts = layouts(module)
        shared = next((layout.fqn for p, layout in zip(params, param_layouts) if uses[id(p)] > 1), None)
        if shared is not None:
            return f"parameter {shared!r} is used by another unit too (tied)"
        return flattenable(params, param_layouts, index)

    def make(index: int, name: str, module: nn.Module) -> FlatShard:
        return flatten_unit_(index, name, *layouts(module), runtime.topology.rank, next_key())

    def retire(flat: FlatShard) -> None:
        runtime.flat_shards.pop(flat.layout.key, None)

    return FlatPlan(can, make, retire)


def _checking_trainable(backend: Callable, watch: ParameterWatch) -> Callable:
    """The backend, preceded by the ``requires_grad`` check: Dynamo recompiles when a parameter's
    ``requires_grad`` flips, so checking at each (re)compile catches every flip for free per step."""

    def zerograph_backend(gm: Any, example_inputs: list[Any]) -> Callable:
        watch.check_trainable()
        return backend(gm, example_inputs)

    return zerograph_backend


_GUARD_INSTALLED = False


def _install_optimizer_guard(originals: dict[str, nn.Parameter]) -> None:
    """Fail an optimizer step over parameters that ``compile`` replaced by shards (``originals``:
    the model's parameters before, by name)."""
    for name, param in originals.items():
        param._zerograph_replaced = name  # type: ignore[attr-defined]
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
