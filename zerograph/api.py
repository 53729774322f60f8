"""``zerograph.compile``: shard a model's parameters and capture its step for the passes."""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map_only

from . import loading
from .budget import fit_memory_budget
from .capture import CapturedGraphs, ZeroGraphBackend
from .config import Config, check_stage
from .errors import (
    ConfigError,
    DynamicShapeTrace,
    ProcessGroupError,
    ShardingError,
    TemplateUnavailable,
    UnshardedParameterError,
    ZeroGraphError,
)
from .flat import FlatShard, flatten_unit_, flattenable
from .hybrid import hybrid_groups, secondary_group
from .policies import MixedPrecisionPolicy
from .registry import next_key
from .replicas import sync_replicas
from .runtime import Runtime
from .sharding import (
    ParameterWatch,
    find_units,
    forget_shape_history,
    set_gathering,
    set_grad_mode,
    set_substituted,
    shard_module_,
    sharded_parameter,
    traceable_forward,
)
from .state import STATE_ATTR, ZeroGraphState, state_of
from .templates import FlatPlan, every_unit_inline, install_unit_templates, refresh_unit_modes, unit_parameters
from .units import warn_large_units

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
    precision is ``Config(param_dtype=..., reduce_dtype=...)`` (FSDP2's ``MixedPrecisionPolicy``).

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
    ``Config(unit_classes=...)`` that splits it (``zerograph.units``, where the default units are
    found: the children of the model's stacks of repeated blocks).

    Collective: every rank of the group takes group rank 0's parameters and buffers (``replicas.py``).

    Calling the compiled model raises (each a ``ZeroGraphError``):
        ModelChangedError: a parameter was added or replaced, or a ``requires_grad`` flipped, after
            compile (freeze before compile instead).
        ScheduleMismatchError: on every rank, when ranks are about to run different collectives
            (checked before each graph's first collective; see ``Runtime.check_schedule``).
        CollectiveError: a collective failed or timed out (``Config.timeout_s``): a peer died or stopped.
        ShardingError: a submodule called (or ``torch.compile``d) on its own, outside the model's forward.
    """
    stage = check_stage(stage)
    if not isinstance(model, nn.Module):
        raise ShardingError(f"zerograph.compile takes an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, Config):
        raise ConfigError(f"config must be a zerograph.Config, got {type(config).__name__}: "
                          f"write config=zerograph.Config(...)")
    config = config or Config()
    if stage == 0 and (config.gather_quantization or config.reduce_quantization):
        raise ConfigError("Config.gather_quantization and reduce_quantization apply to the all-gathers and "
                          "reduce-scatters of stages 1-3; stage 0 (DDP) has neither (it all-reduces full "
                          "gradients): leave them None at stage 0")
    _check_not_sharded(model)
    _check_no_sparse_gradients(model)
    if mesh is not None and process_group is not None:
        raise ConfigError("zerograph.compile takes a process_group or a mesh, not both: pass the 2-D DeviceMesh "
                          "alone (its shard dim's group shards, its replicate dim's group replicates)")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ConfigError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim == 1:  # FSDP2's 1-D mesh: plain sharding over its group
        process_group, mesh = mesh.get_group(), None
    device, meta_built = _target_device(model, device, process_group)
    group = _resolve_group(process_group, device, config)
    replicate_group = None
    if mesh is not None:  # hybrid sharding: ``group`` becomes the shard group (hybrid.py)
        group, replicate_group = hybrid_groups(mesh, stage, device)
    world_group = dist.group.WORLD if replicate_group is not None else group
    if config.secondary_partition_size is not None and config.activations.budget_bytes is not None:
        raise ConfigError("Config.secondary_partition_size (hpZ) with activation_budget_bytes is not supported yet: "
                          "a unit recomputed in backward would read the gathered parameters hpZ releases after "
                          "forward; use one or the other")
    node_group = secondary_group(group, config.secondary_partition_size, stage, replicate_group is not None or (
        mesh is not None and mesh.ndim == 2), config.timeout_s)
    sync_replicas(model, world_group, device)  # every rank starts from rank 0's values, as with DDP (replicas.py)
    if mesh is None:
        mesh = DeviceMesh.from_group(group, device.type)
    originals = {name: p for name, p in model.named_parameters()}
    units = find_units(model, config.unit_classes)
    warn_large_units(model, units, stage)  # before sharding: the blocks' classes are still their own
    config = fit_memory_budget(model, stage, dist.get_world_size(group),
                               1 if replicate_group is None else dist.get_world_size(replicate_group), config)
    precision = config.mixed_precision
    layouts, unit_objs = shard_module_(model, mesh, stage, units, next_key,
                                       param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
                                       full_precision_classes=precision.full_precision_classes,
                                       device=device)
    fresh = loading.allocate_meta_buffers_(model, device) if meta_built else []
    runtime = Runtime(group, stage, layouts, unit_objs, timeout_s=config.timeout_s, device=device,
                      replicate_group=replicate_group, world_group=world_group, secondary_group=node_group)
    runtime.shards = {layout.key: model.get_parameter(layout.fqn) for layout in layouts}
    runtime.eager.gather_quantization = config.gather_quantization  # graph breaks' eager gathers quantize too
    runtime.eager.reduce_quantization = config.reduce_quantization  # and their reductions
    for name, param in originals.items():
        param._zerograph_replaced = name  # type: ignore[attr-defined]
    _install_optimizer_guard()

    captured = CapturedGraphs()
    unit_kinds = []
    if config.unit_templates:
        key_of = {id(shard): key for key, shard in runtime.shards.items()}
        unit_kinds = install_unit_templates(units, key_of, config.resolved_lowering(device), captured.templates,
                                            _flat_plan(runtime, config, units, key_of))
        runtime.add_flat_shards([flat for kind in unit_kinds for flat in kind.flat_shards])
    uninitialised = None
    if meta_built:  # every shard and meta buffer is empty until an init or a load writes it (counted
        # from here: moving shards into flat buffers above wrote them, with no values yet)
        in_flat_shards = frozenset(id(shard) for flat in runtime.flat_shards.values() for shard in flat.shards)
        uninitialised = loading.UninitialisedTracker(list(model.named_parameters()) + fresh, shared=in_flat_shards)
    param_names = {id(p): n for n, p in model.named_parameters()}  # first name of each (tied) parameter
    param_names.update({id(flat.param): flat.layout.fqn for flat in runtime.flat_shards.values()})
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
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"forward": _compiled_forward,
                                                  "set_requires_gradient_sync": set_requires_gradient_sync,
                                                  "no_sync": no_sync,
                                                  "load_state_dict": loading.load_state_dict})
    log.info("zerograph: stage %d, world size %d (x %d replicas), %d units, %d parameters (%d elements)", stage,
             runtime.world_size, runtime.replicate_size, len(unit_objs), len(layouts),
             sum(layout.numel for layout in layouts))
    return model




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
        return flatten_unit_(index, name, *layouts(module), runtime.rank, next_key())

    def retire(flat: FlatShard) -> None:
        runtime.flat_shards.pop(flat.layout.key, None)

    return FlatPlan(can, make, retire)


def _compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: ZeroGraphState = getattr(self, STATE_ATTR)
    state.watch.check_unchanged()
    substituted = False
    for flat in state.runtime.flat_shards.values():
        if not flat.check_views():  # a flattened parameter was frozen: Dynamo guards on the flat leaf only
            state.watch.check_trainable()
        substituted = flat.substituted() or substituted  # every unit's, each marks its modules
    if state.uninitialised is not None:  # a meta-built model until every shard got values
        state.uninitialised.check()
        state.uninitialised = None
    refresh_unit_modes(state.unit_kinds)
    state.runtime.start_forward()
    previous = set_gathering(True)
    previous_substituted = set_substituted(substituted)
    mode = state.runtime.grad_mode()
    previous_mode = set_grad_mode(mode)  # read (and guarded on) by the trace
    try:
        args, kwargs = _cast_inputs(state.config.mixed_precision, args, kwargs)
        out = _run_falling_back(state, self, args, kwargs)
        state.runtime.flush_leftovers_after_backward(out, mode)
        return out
    except (BackendCompilerFailed, TorchRuntimeError) as exc:
        # zerograph's own errors raised while Dynamo compiled (a changed requires_grad, a broken
        # pass, a unit template that cannot be traced) reach the user as themselves, not wrapped
        # in Dynamo's compiler or fake-tensor error
        cause = _own_error(exc)
        if cause is not None:
            raise cause from None
        raise
    finally:
        set_gathering(previous)
        set_substituted(previous_substituted)
        set_grad_mode(previous_mode)


def _run_falling_back(state: ZeroGraphState, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The compiled forward; traced again each time a kind of unit cannot be a template
    (``TemplateUnavailable``: its units now run inline), at most once per kind, and once with
    every unit inline when a template met a dynamic shape (``DynamicShapeTrace``: that trace
    only). Every rank meets the same failure in the same trace, so the ranks stay in step."""
    inline_trace = contextlib.nullcontext()
    if not state.captured.graphs:  # this model's first trace: static, whatever other models of its class saw
        forget_shape_history(state.compiled_forward.__wrapped__)
    # a retry runs again the graphs that ran before the failed trace (those before a graph break):
    # their writes to buffers (a counter, running statistics) and their random numbers are undone
    # first, so the retried forward is the one eager runs once
    before = _ForwardSideEffects(model) if state.unit_kinds else None
    # a kind falls back at most three times (in a training-flag mode, off its flat shards, to islands)
    for _ in range(3 * len(state.unit_kinds) + 2):
        try:
            with inline_trace:
                return state.compiled_forward(model, *args, **kwargs)
        except Exception as exc:
            error = _own_error(exc)
            if not isinstance(error, TemplateUnavailable):
                raise
            if before is not None:
                before.undo()
            if isinstance(error, DynamicShapeTrace):  # this trace again, every unit inline (no template is asked)
                inline_trace = every_unit_inline()
    raise AssertionError("unreachable: each retry makes one more kind of unit, or the whole trace, more inline")


class _ForwardSideEffects:
    """What a forward may change besides its outputs, kept before it runs: every buffer's value
    and version, and the random number generators' states (CPU, and the accelerator's)."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [(b, b._version, b.detach().clone()) for b in model.buffers() if not b.is_meta]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def undo(self) -> None:
        """Put back every buffer written since (its version moved) and the generators' states."""
        with torch.no_grad():
            for buffer, version, value in self.buffers:
                if buffer._version != version:
                    buffer.copy_(value)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _own_error(exc: BaseException) -> ZeroGraphError | None:
    """The ``ZeroGraphError`` behind Dynamo's wrapper ``exc`` (its inner exception, or down the
    ``__cause__`` / ``__context__`` chain), or ``None``."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ZeroGraphError):
            return current
        pending += [getattr(current, "inner_exception", None), current.__cause__, current.__context__]
    return None


def _cast_inputs(policy: MixedPrecisionPolicy, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The forward's floating-point tensor arguments cast to ``policy.param_dtype`` when
    ``cast_forward_inputs`` says so (others untouched). Source: FSDP2's root pre-forward cast."""
    dtype = policy.param_dtype
    if dtype is None or not policy.cast_forward_inputs:
        return args, kwargs
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))


def set_requires_gradient_sync(self: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction across ranks on or off for the backwards of the following forwards.

    The setting is read when a forward runs and fixes what its backward does. Off (gradient
    accumulation without communication): backward runs no reduce-scatter or all-reduce; each rank
    adds its full, unreduced gradients, in ``Config.reduce_dtype``, to buffers the runtime holds,
    and the shards' ``.grad`` receive zeros (created if ``None``). Back on, while such buffers are
    held, the backward adds them to its own gradients in the reductions' copy-in and reduces the
    sum once, so a step of micro-batches costs one reduction. Run the last micro-batch of a step
    with sync on, or ``.grad`` never receives the held gradients.

    Memory: while gradients are unsynced every rank holds a full gradient of every trainable
    parameter (Ψ elements in ``reduce_dtype``; ``zerograph.stats`` counts them under ``"grads"``),
    as FSDP2 and DDP's ``no_sync`` do: stages 2-3 save gradient memory again only after the synced
    backward.

    Graphs: a Dynamo guard selects a graph per mode. A run that never turns sync off keeps one;
    one that does adds an accumulating and a flushing one (each times the shape variants of
    dynamic shapes, within Dynamo's recompile limit of 8). Every rank must switch alike;
    otherwise ranks run different collectives, which the schedule check turns into an error
    (``ScheduleMismatchError``, or ``CollectiveError`` after ``Config.timeout_s``), not a hang.

    Source: FSDP2's ``FSDPModule.set_requires_gradient_sync``; DDP's ``no_sync``.
    """
    state_of(self).runtime.requires_gradient_sync = bool(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(self: nn.Module):
    """Context manager: ``set_requires_gradient_sync(False)`` inside, the previous setting after
    (DDP's ``no_sync``). Backwards of forwards run inside it keep their gradients unreduced."""
    runtime = state_of(self).runtime
    previous = runtime.requires_gradient_sync
    runtime.requires_gradient_sync = False
    try:
        yield
    finally:
        runtime.requires_gradient_sync = previous


def _checking_trainable(backend: Callable, watch: ParameterWatch) -> Callable:
    """The backend, preceded by the ``requires_grad`` check: Dynamo recompiles when a parameter's
    ``requires_grad`` flips, so checking at each (re)compile catches every flip for free per step."""

    def zerograph_backend(gm: Any, example_inputs: list[Any]) -> Callable:
        watch.check_trainable()
        return backend(gm, example_inputs)

    return zerograph_backend


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


def _target_device(model: nn.Module, device: torch.device | str | int | None,
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
