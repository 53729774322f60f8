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
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from .errors import ShardingError

ROOT_UNIT = "<root>"


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


def make_layout(key: int, fqn: str, unit: int, param: torch.Tensor, world_size: int, sharded: bool) -> ParamLayout:
    """Layout of one parameter. A 0-d parameter (a learned scale) has no dim 0 to shard: it stays
    replicated on every rank at every stage and its gradient is all-reduced."""
    sharded = sharded and param.dim() > 0
    rows = param.shape[0] if param.dim() else 1
    if sharded:
        chunk = -(-rows // world_size)
        rank_rows = tuple(max(0, min(chunk, rows - r * chunk)) for r in range(world_size))
    else:
        chunk, rank_rows = rows, (rows,) * world_size
    return ParamLayout(key, fqn, unit, tuple(param.shape), param.dtype, world_size, sharded, rank_rows, chunk)


def find_units(model: nn.Module, unit_classes: tuple[type[nn.Module], ...] | None) -> list[tuple[str, nn.Module]]:
    """Modules that become units, in module order (the root unit is implicit).

    With ``unit_classes`` the outermost instances of those classes; otherwise the children of the
    ``nn.ModuleList`` / ``nn.Sequential`` holding the most parameters (a transformer's blocks).
    """
    if unit_classes:
        found: list[tuple[str, nn.Module]] = []
        for name, mod in model.named_modules():
            if isinstance(mod, unit_classes) and mod is not model:
                if not any(name.startswith(f"{outer}.") for outer, _ in found):
                    found.append((name, mod))
        return found
    best, best_size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 1:
            size = sum(p.numel() for p in mod.parameters())
            if size > best_size:
                best, best_size = (name, mod), size
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [(f"{prefix}{child_name}", child) for child_name, child in best[1].named_children()]


def _unit_of_modules(model: nn.Module, units: list[tuple[str, nn.Module]]) -> dict[int, int]:
    """``id(module) -> unit index`` for every module inside a unit; root-unit modules are absent."""
    owner: dict[int, int] = {}
    for index, (_, unit_mod) in enumerate(units, start=1):
        for mod in unit_mod.modules():
            owner.setdefault(id(mod), index)
    return owner


class _ShardedParamAccess:
    """Mixin installed under each parameter-owning module's class (see module docstring)."""


# True while a zerograph forward runs or is traced. Outside it a parameter attribute is the
# DTensor shard itself (FSDP2's behaviour), so reads run no collective that only some ranks would
# join, and writes (``nn.init``, ``weight.data``, ``requires_grad``) reach the real parameter.
_gathering = False


def set_gathering(active: bool) -> bool:
    """Turn full-parameter access on or off; returns the previous setting."""
    global _gathering
    previous, _gathering = _gathering, active
    return previous


def _param_property(name: str, key: int) -> property:
    from .ops import unshard  # local import: ops imports runtime state

    def get(self: nn.Module) -> torch.Tensor:
        shard = self._parameters[name]
        if not _gathering:
            return shard
        return unshard(shard.to_local(), key)

    return property(get, doc=f"parameter {name!r}: the full tensor inside forward, this rank's DTensor shard outside")


def shard_module_(
    model: nn.Module,
    mesh: DeviceMesh,
    stage: int,
    units: list[tuple[str, nn.Module]],
    new_key: Callable[[], int],
) -> tuple[list[ParamLayout], list[Unit]]:
    """Replace every parameter of ``model`` by this rank's ``DTensor`` shard, in place.

    Tied parameters (one ``nn.Parameter`` object reachable under several names or modules) are
    sharded once and stay one object, so an optimizer sees them once and the gradients of every
    use sum into it. ``requires_grad`` is kept.

    Returns the layouts in key order and the units (index 0 is the root unit).
    """
    world_size, rank = mesh.size(), mesh.get_local_rank()
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
                layout = make_layout(new_key(), fqn, owner.get(id(mod), 0), param, world_size, sharded)
                layouts.append(layout)
                new_param_of[id(param)] = (_make_shard(param, layout, mesh, rank), layout.key)
            new_param, key = new_param_of[id(param)]
            mod._parameters[name] = new_param
            props[name] = _param_property(name, key)
        cls = type(mod)
        mod.__class__ = type(f"Sharded{cls.__name__}", (cls, _ShardedParamAccess), props)
    unit_keys: list[list[int]] = [[] for _ in range(len(units) + 1)]
    for layout in layouts:
        unit_keys[layout.unit].append(layout.key)
    unit_objs = [Unit(0, ROOT_UNIT, tuple(unit_keys[0]))]
    unit_objs += [Unit(i, name, tuple(unit_keys[i])) for i, (name, _) in enumerate(units, start=1)]
    return layouts, unit_objs


def _make_shard(param: nn.Parameter, layout: ParamLayout, mesh: DeviceMesh, rank: int) -> nn.Parameter:
    data = param.detach()
    if layout.sharded:
        start = rank * layout.chunk_rows
        local = data[start : start + layout.rank_rows[rank]].clone()
        placements = [Shard(0)]
    else:
        local = data.clone()
        placements = [Replicate()]
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=data.shape, stride=data.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)

