"""Islands around a routing loop: a module that is no unit, looping on the data over the units below it.

A mixture of experts whose experts are the units (``Config(unit_classes=(Expert,))``, or a
stack of experts discovered as units) and whose routing loop (``for e in ids.tolist(): rows =
nonzero(choice == e); ...experts[e](x[rows])``) sits in the module above them: Dynamo cannot trace
the loop, so it runs it eagerly and compiles each expert it calls as a frame of its own, each with
its gathers. Ranks route to different experts, so they would run different collectives.

Such a module (the *parent*, the root included) runs as an island instead, as a unit with
data-dependent control flow does (``unit_islands``): every rank gathers, on entry and in one
order, every parameter below the parent (the units it may call and its own), runs the parent's
forward eagerly on them, and in backward reduces each of them in that order, zeros for those no
local token reached, ``None`` where no rank reached one (``unit_islands.GatheredOnEntry``).

Detection (``check_unit_caller``): a unit's forward traced by Dynamo as its own frame, called
from a frame Dynamo left to eager Python, while this forward met a data-dependent graph break
(``.tolist()``, ``.item()``, ``nonzero``: Dynamo's counters). The parent is the innermost module
on the Python stack above that eager frame that holds the unit and is no unit; every rank meets the
same eager frame in the same trace, before any collective of the loop, so every rank makes the same
module an island and traces the forward again. Source: FSDP2's unshard in a module's pre-forward
hook and reshard in its post-forward hook, here for every unit below the module at once.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import types
from typing import Any

import torch
from torch import nn
from torch._dynamo.convert_frame import output_codes
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from ..errors import TemplateUnavailable
from ..graph.vocab import GRAD_SYNC
from ..runtime.state import STATE_ATTR, state_of
from ..shard.trace_state import TRACE
from .unit_islands import GatheredOnEntry
from .unit_trace import UNIT_ATTR

PARENT_ISLAND_ATTR = "_zerograph_parent_island"  # the ParentIsland of a module that runs as one
# Dynamo's graph-break reasons (their first words) for a value or a shape read from tensor data
_DATA_DEPENDENT = ("Data dependent operator", "Dynamic shape operator", "Data-dependent branching",
                   "Unsupported Tensor.item()", "Tensor.tolist()", "Attempted to use `torch.nn.functional.one_hot`")
_INTERNAL = (torch.__file__.rsplit("/", 1)[0], __file__.rsplit("/", 2)[0])  # torch's and zerograph's files

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParentIsland:
    """What a parent island gathers on entry, in order: each unit's flat shard or its parameter
    slots, then the parameters below the parent outside every unit. ``inputs``: per entry,
    ``(marker key, slots)`` where slots are ``(module, name)`` pairs filled from that entry's
    full tensor (a flat shard's: several, cut by ``FlatShard.unflatten``)."""

    name: str
    inputs: tuple[tuple[int, tuple[tuple[nn.Module, str], ...], Any], ...]  # (key, slots, flat shard or None)


def data_dependent_breaks() -> int:
    """How many of Dynamo's graph breaks in this process read a value or shape from tensor data."""
    return sum(n for reason, n in counters["graph_break"].items() if str(reason).startswith(_DATA_DEPENDENT))


@torch._dynamo.assume_constant_result
def check_unit_caller(kind: int) -> bool:
    """At Dynamo's trace of a unit of ``kind``: when the unit is the trace's own frame, called
    from eager Python after a data-dependent graph break of this forward, make the module above
    that eager code an island (``make_island``) and raise ``TemplateUnavailable`` (the compiled
    forward traces the model again). Dynamo runs this while it traces (its result a constant)."""
    tx = InstructionTranslator.current_tx()
    while tx.parent is not None:
        tx = tx.parent
    unit = tx.f_locals.get("self")
    record = getattr(unit, UNIT_ATTR, None)
    if record is None or record.kind != kind or data_dependent_breaks() == TRACE.breaks_at_forward_start:
        return True
    parent, root = _eager_caller_module(unit, sys._getframe(1))
    if parent is None:
        return True
    name = make_island(parent, root)
    raise TemplateUnavailable(f"module {name!r} calls units from data-dependent control flow (unit "
                              f"{type(unit).__name__} of kind {kind}); it runs eagerly, gathered once on entry")


def _eager_caller_module(unit: nn.Module, frame: types.FrameType | None) -> tuple[nn.Module | None, nn.Module | None]:
    """``(parent, root)``: the innermost module, no unit, holding ``unit``, whose frame is on the
    stack above the first user frame that runs eagerly (Dynamo left it to Python), and the compiled
    model; ``(None, None)`` where the first user frame up the stack is Dynamo's compiled code
    (the unit is traced as a frame of its own after a graph break outside any loop)."""
    eager = False
    parent = None
    while frame is not None:
        code = frame.f_code
        internal = code.co_filename.startswith(_INTERNAL)
        if not internal and not eager:
            if code in output_codes:
                return None, None
            eager = True
        owner = frame.f_locals.get("self") if eager else None
        if isinstance(owner, nn.Module):
            if hasattr(owner, STATE_ATTR):  # the compiled model's own forward: the outermost candidate
                if parent is None and any(m is unit for m in owner.modules()):
                    parent = owner
                return parent, owner
            if parent is None and not hasattr(owner, UNIT_ATTR) and any(m is unit for m in owner.modules()):
                parent = owner
        frame = frame.f_back
    return None, None


def make_island(parent: nn.Module, root: nn.Module) -> str:
    """Make ``parent`` (a module of the compiled model ``root``, or ``root``) run as an island
    from now on: its forward (the instance's, for a submodule; the compiled forward reads the
    root's attribute) runs ``run_parent_island``. Returns the parent's name in the model."""
    runtime = state_of(root).runtime
    key_of = {id(shard): key for key, shard in runtime.shards.items()}
    name = next(n for n, m in root.named_modules() if m is parent) or "<root>"
    inputs: list = []
    inside_units: set[int] = set()
    for module in parent.modules():
        record = getattr(module, UNIT_ATTR, None)
        if record is None:
            continue
        inside_units.update(id(m) for m in module.modules())
        if record.flat is not None:
            inputs.append((record.flat.layout.key, tuple(record.param_slots), record.flat))
        else:
            inputs += [(key, (slot,), None) for slot, key in zip(record.param_slots, record.keys)]
    seen: set[int] = set()
    for module in parent.modules():
        if id(module) in inside_units:
            continue
        for pname, param in module._parameters.items():
            if param is not None and id(param) in key_of and id(param) not in seen:
                seen.add(id(param))
                inputs.append((key_of[id(param)], ((module, pname),), None))
    island = ParentIsland(name, tuple(inputs))
    object.__setattr__(parent, PARENT_ISLAND_ATTR, island)
    if parent is not root:
        forward = type(parent).forward
        # the class's function and the module apart: Dynamo would rebuild a bound method as the attribute
        object.__setattr__(parent, "forward", types.MethodType(
            lambda self, *args, **kwargs: run_parent_island(island, forward, (self, *args), kwargs), parent))
    log.warning("zerograph: module %s calls units from data-dependent control flow: it runs eagerly, every "
                "parameter below it gathered once on entry", name)
    return name


@torch._dynamo.disable
def run_parent_island(island: ParentIsland, forward: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``forward(*args, **kwargs)`` (the parent's own function, the parent first in ``args``)
    eagerly, outside every graph, on every parameter below the parent gathered once on entry in
    ``island``'s order: the full tensors stand in the
    parameter slots (the units below run their bodies on them) and the slots get their shards
    back on exit. In backward each is reduced once, in that order, on every rank alike."""
    keys, shards, slots = [], [], []
    for key, entry_slots, flat in island.inputs:
        keys.append(key)
        if flat is not None:
            shards.append(flat.input)
        else:
            (module, pname), = entry_slots
            shard = module._parameters[pname]
            shards.append(shard.to_local() if isinstance(shard, DTensor) else shard)
        slots.append(entry_slots)
    mode = TRACE.grad_mode if torch.is_grad_enabled() else GRAD_SYNC
    fulls = GatheredOnEntry.apply(tuple(keys), mode, *shards)
    saved = [(module, pname, module._parameters[pname]) for entry in slots for module, pname in entry]
    with TRACE.scope(tracing_unit=True):  # parameter attributes read their slots; units run their bodies
        try:
            for (_, entry_slots, flat), full in zip(island.inputs, fulls):
                pieces = flat.unflatten(full) if flat is not None else (full,)
                for (module, pname), piece in zip(entry_slots, pieces):
                    module._parameters[pname] = piece
            return forward(*args, **kwargs)
        finally:
            for module, pname, shard in saved:
                module._parameters[pname] = shard
