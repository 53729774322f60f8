"""Units, shard layouts and the module surgery that makes a model's parameters sharded.

Every parameter is sharded on dim 0 the way ``torch.chunk`` splits it (what ``DTensor``'s
``Shard(0)`` means): rank ``r`` holds rows ``[r*c, min((r+1)*c, rows))`` with ``c = ceil(rows / N)``,
so the last ranks may hold fewer rows, or none. Collectives work on the padded chunk of ``c`` rows,
so a unit's shards concatenate into one flat buffer of the same size on every rank (FSDP2's layout).

The module keeps its class and parameter names; each module that owns parameters gets a subclass
whose parameter attributes are properties returning ``zerograph::unshard(shard)``. Dynamo traces
through the property, so the captured graph holds one marker per parameter access, and a frame that
runs eagerly (a graph break) runs the marker's real implementation and still sees full parameters.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable

import torch
from torch import nn
from torch._dynamo import trace_rules
from torch._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from ..errors import ShardingError
from ..graph.ops import unshard
from ..graph.vocab import GENERATED_CLASS, GRAD_SYNC
from .parameter_watch import ParameterWatch  # noqa: F401  (re-exported: api imports it from here)
from .trace_state import TRACE
from .units import find_units  # noqa: F401  (re-exported: api, plan and the bench import it from here)

_UNSHARD = unshard._opoverload  # the op itself: Dynamo inlines a CustomOpDef's __call__, one frame per call
ROOT_UNIT = "<root>"
ROOT_INDEX = 0  # Unit.index of the root unit (parameters outside every other unit)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one parameter's elements live. Plain data: the passes read it, never a tensor.

    Attributes:
        key: id carried by the graph markers; equal on every rank (assigned in module order).
        fqn: first fully-qualified name of the parameter in the model.
        unit: index of the unit that owns the parameter (``units[unit]``).
        shape: full (unsharded) shape.
        dtype: parameter dtype.
        world_size: N.
        sharded: False at stage 0 and for 0-d parameters (every rank holds the full tensor).
        rank_rows: rows held by each rank, ``len == world_size`` (unpadded).
        chunk_rows: padded rows per rank, ``c = ceil(rows / N)`` (``rows`` when not sharded).
        param_dtype: dtype of the full parameter forward and backward compute with, and of the
            all-gather that makes it (mixed precision casts the shard in the copy-in); ``None``
            given means ``dtype``. Source: FSDP2's ``MixedPrecisionPolicy.param_dtype``.
        reduce_dtype: dtype its gradient is reduced in; the reduced shard is cast back to
            ``dtype`` for ``.grad``. ``None`` given means ``param_dtype`` (FSDP2's default).
    """

    key: int
    fqn: str
    unit: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    world_size: int
    sharded: bool
    rank_rows: tuple[int, ...]
    chunk_rows: int
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        # resolve the defaults once, so that no reader ever sees None
        if self.param_dtype is None:
            object.__setattr__(self, "param_dtype", self.dtype)
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def shard_numel(self) -> int:
        """Elements of one padded shard (what each rank sends into an all-gather)."""
        return self.chunk_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the padded full tensor, ``world_size * shard_numel`` when sharded."""
        return self.shard_numel * (self.world_size if self.sharded else 1)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return (self.rank_rows[rank], *self.shape[1:]) if self.sharded else self.shape


@dataclasses.dataclass(frozen=True)
class Unit:
    """A group of parameters gathered, released and reduced together (FSDP2's ``fully_shard`` unit)."""

    index: int
    name: str
    keys: tuple[int, ...]


def make_layout(key: int, fqn: str, unit: int, param: torch.Tensor, world_size: int, sharded: bool,
                param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> ParamLayout:
    """Layout of one parameter. A 0-d parameter (a learned scale) has no dim 0 to shard: it stays
    replicated on every rank at every stage and its gradient is all-reduced. ``param_dtype`` and
    ``reduce_dtype`` apply to floating-point parameters only (an integer parameter is never cast)."""
    if not param.is_floating_point():
        param_dtype = reduce_dtype = None
    sharded = sharded and param.dim() > 0
    rows = param.shape[0] if param.dim() else 1
    if sharded:
        chunk = -(-rows // world_size)
        rank_rows = tuple(max(0, min(chunk, rows - r * chunk)) for r in range(world_size))
    else:
        chunk, rank_rows = rows, (rows,) * world_size
    return ParamLayout(key, fqn, unit, tuple(param.shape), param.dtype, world_size, sharded, rank_rows, chunk,
                       param_dtype, reduce_dtype)


def _unit_of_modules(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[int, int]:
    """``id(module) -> unit index`` for every module inside a unit; root-unit modules are absent."""
    owner: dict[int, int] = {}
    for index, (_, unit_mod) in enumerate(units, start=1):
        for mod in unit_mod.modules():
            owner.setdefault(id(mod), index)
    return owner


class _ShardedParamAccess:
    """Mixin installed under each parameter-owning module's class (see module docstring)."""


def original_class(mod: nn.Module) -> type[nn.Module]:
    """The class ``mod`` had before ``shard_module_`` gave it a subclass with parameter properties."""
    # the first class of its MRO that zerograph did not make for it (sharding's subclass with
    # parameter properties; a template trace's recording subclass, attribute_reads)
    return next(c for c in type(mod).__mro__ if not c.__dict__.get(GENERATED_CLASS) and c is not _ShardedParamAccess)


def full_parameter(shard: torch.Tensor, key: int) -> torch.Tensor:
    """The full parameter of marker key ``key`` from its shard (a ``DTensor``, or a plain local
    tensor: a unit's flat shard), inside a zerograph forward: ``zerograph::unshard`` of the local
    shard, in the gradient mode of this forward."""
    # without autograd there is no backward to configure: one graph serves every mode
    mode = TRACE.grad_mode if torch.is_grad_enabled() else GRAD_SYNC
    return _UNSHARD(shard.to_local() if isinstance(shard, DTensor) else shard, key, mode)


FLAT_READS_ATTR = "_zerograph_flat_reads"  # parameter name -> what reads it from its unit's flat shard (flat.py)
# the names of a module's parameters whose slots hold another tensor than their shard in this forward
# (flat.FlatShard.substituted sets it before each forward; read only when TRACE.substituted)
SUBSTITUTED_ATTR = "_zerograph_substituted"


def _param_property(name: str, key: int) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        shard = self._parameters[name]
        if not TRACE.gathering or TRACE.tracing_unit:
            return shard if TRACE.init_read is None else TRACE.init_read(self, name)
        flat_read = getattr(self, FLAT_READS_ATTR, {}).get(name)
        # its unit's shards live in one flat buffer: read it through that, unless another tensor
        # stands in the slot for this forward (functional_call), which is then read itself
        if flat_read is not None and (not TRACE.substituted or name not in getattr(self, SUBSTITUTED_ATTR)):
            return flat_read()
        return full_parameter(shard, key)

    return property(get, doc=f"parameter {name!r}: the full tensor inside forward, this rank's DTensor shard outside")


# A parameter read that Dynamo meets as a frame of its own (called from eager code after a graph
# break inside a module, e.g. nn.GRU's refresh of its _flat_weights) is one op: it runs as it is,
# the op's eager all-gather. Traced as a frame, the marker key, a closure int that differs from
# parameter to parameter, became a symbolic int on the frame's recompile (automatic dynamic
# shapes), which no marker can carry. The frames it calls (DTensor.to_local, the op's autograd
# function, a flat shard's cut) run eagerly too: traced, each was a graph of a few ops of its own,
# compiled (and recompiled per grad mode and shard rank) for nothing. Traced inline from another
# frame, as usual, the read is unchanged: a code's exec strategy applies to frames only.
_EAGER_WITH_CALLEES = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
set_code_exec_strategy(full_parameter.__code__, _EAGER_WITH_CALLEES)
set_code_exec_strategy(_param_property("_", 0).fget.__code__, _EAGER_WITH_CALLEES)


def _forward_inside_model_only(cls: type[nn.Module], fqn: str) -> Callable[..., object]:
    """``cls.forward``, refusing to run outside the compiled model's forward.

    Outside it the module's parameters are this rank's shards, so a direct call, or a separate
    ``torch.compile`` of the submodule, would fail deep inside DTensor ("got mixed torch.Tensor and
    DTensor") or run a collective only this rank joins. Dynamo traces through the check: it reads
    the same flag the parameter properties already read, so no guard is added.
    """
    base = cls.forward

    @functools.wraps(base)
    def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
        if not TRACE.gathering:
            raise ShardingError(
                f"submodule {fqn!r} ({cls.__name__}) was called on its own, outside the forward of the model "
                "zerograph.compile sharded; there its parameters are this rank's DTensor shards. Call the "
                "compiled model itself: zerograph captures its whole forward, so do not torch.compile or "
                "call its submodules separately (to choose how parameters are grouped, pass "
                "Config(unit_classes=...) to zerograph.compile; to run a part alone, zerograph.compile that "
                "part as its own model instead)")
        return base(self, *args, **kwargs)

    return own_code(forward, f"forward of {fqn}")


def sharded_parameter(model: nn.Module) -> str | None:
    """Name of the first parameter of ``model`` that is sharded already (by zerograph or as any
    ``DTensor``, e.g. by FSDP2's ``fully_shard``), or ``None``."""
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return name
    return None


def shard_module_(
    model: nn.Module,
    mesh: DeviceMesh,
    stage: int,
    units: list[tuple[str, nn.Module]],
    new_key: Callable[[], int],
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    full_precision_classes: tuple[type[nn.Module], ...] = (),
    device: torch.device | None = None,
) -> tuple[list[ParamLayout], list[Unit]]:
    """Replace every parameter of ``model`` by this rank's ``DTensor`` shard, in place.

    Tied parameters (one ``nn.Parameter`` object reachable under several names or modules) are
    sharded once and stay one object, so an optimizer sees them once and the gradients of every
    use sum into it. ``requires_grad`` and the dtype are kept: with mixed precision the shards are
    the master weights, and ``param_dtype`` / ``reduce_dtype`` (``Config``'s) are recorded in the
    layouts for the passes, except for parameters of ``full_precision_classes`` modules. Buffers
    are left untouched. A parameter on the meta device gets an uninitialised shard of this rank's
    rows only, allocated on ``device`` (meta-device construction: no full tensor is ever made).

    ``mesh`` is 1-D (the ranks that shard) or 2-D, ``(replicate, shard)`` as FSDP2's HSDP: the
    shards are cut over its last dim and replicated over the first (placements
    ``(Replicate(), Shard(0))``), so ``world_size`` in the layouts is the shard dim's size.

    Returns the layouts in key order and the units (index 0 is the root unit).
    """
    shard_dim = mesh.ndim - 1
    world_size, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    sharded = stage >= 1
    owner = _unit_of_modules(model, units)
    new_param_of: dict[int, tuple[nn.Parameter, int]] = {}
    layouts: list[ParamLayout] = []
    for mod_name, mod in model.named_modules():
        names = [n for n, p in mod._parameters.items() if p is not None]
        if not names:
            continue
        props = {}
        for name in names:
            param = mod._parameters[name]
            if id(param) not in new_param_of:
                fqn = f"{mod_name}.{name}" if mod_name else name
                cast = not isinstance(mod, full_precision_classes)
                layout = make_layout(new_key(), fqn, owner.get(id(mod), 0), param, world_size, sharded,
                                     param_dtype if cast else None, reduce_dtype if cast else None)
                layouts.append(layout)
                new_param_of[id(param)] = (_make_shard(param, layout, mesh, rank, device), layout.key)
            new_param, key = new_param_of[id(param)]
            mod._parameters[name] = new_param
            props[name] = _param_property(name, key)
        cls = type(mod)
        if mod is not model and cls.forward is not nn.Module.forward:
            props["forward"] = _forward_inside_model_only(cls, mod_name)
        mod.__class__ = type(f"Sharded{cls.__name__}", (cls, _ShardedParamAccess), {**props, GENERATED_CLASS: True})
    unit_keys: list[list[int]] = [[] for _ in range(len(units) + 1)]
    for layout in layouts:
        unit_keys[layout.unit].append(layout.key)
    unit_objs = [Unit(0, ROOT_UNIT, tuple(unit_keys[0]))]
    unit_objs += [Unit(i, name, tuple(unit_keys[i])) for i, (name, _) in enumerate(units, start=1)]
    return layouts, unit_objs


def _make_shard(param: nn.Parameter, layout: ParamLayout, mesh: DeviceMesh, rank: int,
                device: torch.device | None = None) -> nn.Parameter:
    data = param.detach()
    # replicated over every mesh dim but the last (HSDP's replicate dim), sharded over the last
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0) if layout.sharded else Replicate()]
    if data.is_meta:  # meta-device construction: allocate this rank's rows only, values come later
        local = torch.empty(layout.local_shape(rank), dtype=data.dtype, device=device)
    elif layout.sharded:
        start = rank * layout.chunk_rows
        local = data[start : start + layout.rank_rows[rank]].clone()
    else:
        local = data.clone()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=data.shape, stride=data.stride())
    shard = nn.Parameter(dt, requires_grad=param.requires_grad)
    carry_hooks(param, shard)
    return shard


def carry_hooks(param: torch.Tensor, shard: torch.Tensor) -> None:
    """Give ``shard`` the tensor hooks registered on ``param`` before ``compile`` replaced it:
    ``register_hook`` (run on the shard's reduced gradient, a ``DTensor``, before it is
    accumulated into ``.grad``) and ``register_post_accumulate_grad_hook`` (run after). The hook
    tables are shared, not copied, so a handle returned before ``compile`` still removes its hook.
    FSDP2's ``fully_shard`` drops them; eager keeps them, and so does this."""
    if param._backward_hooks:
        shard._backward_hooks = param._backward_hooks
    if param._post_accumulate_grad_hooks:
        shard._post_accumulate_grad_hooks = param._post_accumulate_grad_hooks


def traceable_forward(cls: type) -> Callable:
    """``cls.forward`` as a function with a code object of its own (``own_code``), for one model.

    A ``forward`` in a file Dynamo skips (``nn.Sequential``'s, in torch/nn) cannot be its own top
    frame: ``torch.compile`` wraps it in ``external_utils.wrap_inline``'s ``inner``, one code
    object for every such model in a process, so their graphs would share one cache entry of at
    most 8 graphs, and the ninth model would run eagerly. Such a ``forward`` is called from a
    wrapper of zerograph's own instead, which ``own_code`` then copies per model. The copies share
    one shape history, which ``forget_shape_history`` starts afresh at each model's first trace."""
    forward = cls.forward
    if not trace_rules.check(forward):
        return own_code(forward)

    def forward_of_skipped_file(self: nn.Module, *args: object, **kwargs: object) -> object:
        return forward(self, *args, **kwargs)

    return own_code(forward_of_skipped_file)


def own_code(fn: Callable, name: str | None = None) -> Callable:
    """``fn`` with a code object of its own, named ``name`` where given. Dynamo caches compiled
    graphs per code object, at most ``torch._dynamo.config.recompile_limit`` (8) of them, and past
    that runs the frame eagerly, silently. With the class's own ``forward``, the ninth model of one
    class compiled in a process would run eagerly (no graph, no passes, on that rank only, if ranks
    compiled different numbers of models): a copy per model gives each its own cache. A module's
    forward met as a frame of its own (called from eager code, after a graph break in its parent's
    loop) is named after the module (``sharding``, ``templates``): on a code shared by every module,
    their graphs filled one cache, and the point where it overflowed differed by rank where shards
    are uneven (a module of fewer rows than ranks), so collectives went out of step (gloo aborts).
    The name also gives each its own automatic-dynamic shape history (kept per name: ``forget_shape_history``)."""
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace() if name is None else fn.__code__.replace(co_name=name, co_qualname=name)
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


def forget_shape_history(fn: Callable) -> None:
    """Start ``fn``'s automatic-dynamic shape history afresh, before a model's first trace.

    Dynamo keeps that history per ``CodeId`` (the code's file, first line and name:
    ``torch._dynamo.pgo``), not per code object, so ``own_code``'s copies still share it: a
    second model of the same class with other input shapes (a smaller model built first, the
    bench's priming model) was traced with symbolic sizes at its very first call, which makes
    every unit template fall back to inline units and the Inductor lowering take the whole graph.
    A model's first trace is static again; a later change of an input's size on that model makes
    the size symbolic as before (``api`` compiles with ``dynamic=None``). The frames Dynamo
    resumes in after a graph break (``torch_dynamo_resume_in_<name>_at_<line>``, in the same
    file) keep histories of their own, shared the same way: they are started afresh too."""
    from torch._dynamo import pgo
    from torch._dynamo.resume_execution import TORCH_DYNAMO_RESUME_IN_PREFIX

    code = getattr(fn, "__code__", None)
    if code is None:
        return
    own = pgo.CodeId.make(code, fn.__closure__)

    def shared(code_id: pgo.CodeId) -> bool:  # fn's own history, or a frame resumed in fn after a break
        return code_id == own or (code_id.file_hash == own.file_hash and code_id.name.startswith(
            TORCH_DYNAMO_RESUME_IN_PREFIX) and f"_{code.co_name}_at_" in code_id.name)

    states = pgo.get_code_state()
    for code_id in [c for c in states if shared(c)]:
        del states[code_id]
