"""Units traced once: every unit of one kind calls one traced, partitioned and lowered template.

``Config(unit_templates=True)``. Units of one structure (``unit_signature``) are one *kind*
(``UnitKind``); ``install_unit_templates`` makes each unit's ``forward`` one
``zerograph::unit_forward(kind, mode, arg_grads, primals)`` node (``unit_call`` until the
partition: ``passes/expand_unit_calls``). Dynamo traces the unit's parameter reads, still the
``zerograph::unshard`` markers the passes expand into all-gathers (one per unit with a flat shard,
``flat.py``), and the call, but not the body, which is traced once per kind and input signature
(``trace_template``; the trace itself is ``unit_trace.py``). So the model graph holds every unit's
collectives around a handful of nodes per unit, whatever the block's size.

Invariants: a unit runs its template only where the template stands for its body; otherwise it
runs inline, per call (parameters substituted by ``functional_call``), per training-flag mode
(``UnitKind.inline_modes``) or for the whole kind (``run_inline``), and a kind with data-dependent
control flow runs as eager islands (``run_island``); a kind that cannot tell which parameters its
output reaches leaves its flat shards first (``UnitKind._unflatten``). The kind's path is a
``unit_paths.UnitPath``, moved toward eager by ``UnitKind.leave`` only. A body that writes a
parameter in place is refused (``ShardingError``). The first failed trace raises
``TemplateUnavailable`` and the compiled forward traces the model again; a trace with dynamic
shapes runs every unit inline, that trace only (``DynamicShapeTrace``). The why of each rule, and
what the templates take from autograd and give back: docs/design.md, "Unit templates".
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
from torch import nn

from ..errors import DynamicShapeTrace, TemplateFallbackError, TemplateUnavailable, UnitPathError
from ..graph import registry
from ..graph.ops import UNIT_CALL as _unit_call
from ..graph.ops import unit_forward
from ..shard.flat import FlatShard
from ..shard.sharding import full_parameter, own_code
from ..shard.trace_state import TRACE
from . import unit_watch
from .parent_islands import check_unit_caller
from .template_cache import TraceFailure, shared_template
from .template_keys import unit_signature
from .unit_calls import TENSOR, call_key, describe, rebuild, unsupported
from .unit_islands import run_island
from .unit_paths import INLINE_ATTR, INLINE_MODE_PREFIX, ISLAND_ATTR, TRANSITIONS, UnitPath
from .unit_reach import lost_to_unread
from .unit_record import UnitRecord
from .unit_trace import UNIT_ATTR, TensorMeta, UnitTemplate

MODE_ATTR = "_zerograph_unit_mode"  # the unit's submodules' training flags as bits (refresh_unit_modes)
# the op as an OpOverload: Dynamo puts it in the graph directly (a CustomOpDef is a frame to inline)
_unit_forward = unit_forward._opoverload


log = logging.getLogger(__name__)


class TemplateKey(NamedTuple):
    """What one template of a kind is traced for."""

    metas: tuple[TensorMeta, ...]  # (shape, stride, dtype) of each primal
    mode: int  # the unit's submodules' training flags, as bits
    arg_grads: int  # which tensor arguments need a gradient, as bits
    call: int  # the call's structure and autocast state (unit_calls.call_key)


class UnitKind:
    """The units that share one structure, and the templates traced for them (one per input
    signature and training-flag mode). The representative ``module`` is the kind's first unit:
    its body is what gets traced, with each primal put in its parameter and buffer slots and its
    submodules' training flags set to the calling unit's for the trace."""

    def __init__(self, kind: int, name: str, module: nn.Module, lowering: str, record: list[UnitTemplate]):
        self.kind, self.name, self.module, self.lowering = kind, name, module, lowering
        self.units: list[str] = [name]
        self.modules: list[nn.Module] = [module]  # every unit of the kind
        self.watch = unit_watch.KindWatch()  # its units as compile grouped them (check_unchanged)
        self.templates: dict[TemplateKey, UnitTemplate] = {}
        # (call, mode) -> the structure of the body's output (unit_calls.flatten_output), as its traces agree
        self.output_structures: dict[tuple[int, int], Any] = {}
        # why units of the kind left the fast path -> traces (or eager calls) that took that exit
        self.exits: collections.Counter[str] = collections.Counter()
        self.strict = False  # Config.strict_templates: an exit raises TemplateFallbackError
        self.current_path = UnitPath.TEMPLATE  # moved by leave() only (unit_paths.TRANSITIONS)
        self.inline_reason: str | None = None  # set when the kind fell back to running inline (in some mode)
        self.inline_modes: dict[int, str] = {}  # training-flag mode -> why the kind runs inline in it
        self.holds_lstm = any(isinstance(m, nn.LSTM) for m in module.modules())  # runs inline: see template()
        self.flat_reason: str | None = "not asked"  # why its units have no flat shards (None: they have)
        self.flat_shards: list[FlatShard] = []  # its units' flat shards, in unit order
        # the parameters (slot order) its output does not reach, as every trace so far agrees
        # (``None``: no trace told); what ``FlatShard.no_grad`` holds while the units are flat
        self.no_grad: frozenset[int] | None = None
        self.retire: Callable[[FlatShard], None] = lambda flat: None  # forgets a flat shard (FlatPlan.retire)
        self._record = record

    def template(self, mode: int, arg_grads: int, primals: Sequence[torch.Tensor], call: int) -> UnitTemplate:
        if any(not isinstance(d, int) for p in primals for d in (*p.shape, *p.stride())):
            # this trace only: the graphs traced for static shapes keep their templates (no flag
            # for their guards to read, unlike fall_back's), the dynamic one runs every unit inline
            self.leave(self.current_path, "an input has a dynamic shape (a template is traced for static shapes)",
                       counted_as="a trace with dynamic shapes runs every unit inline (a template is traced for "
                       "static shapes)")
            raise DynamicShapeTrace(f"unit {self.name!r}: {self.inline_reason}")
        if self.holds_lstm:
            # its fused kernel's outputs differ between the trace and the run (the mkldnn layer's
            # workspace: a tensor when traced, undefined under the op's no-grad forward), so the op
            # cannot return them. A GRU's trace fails on its own and falls back. Inline is exact
            self.fall_back("it holds an nn.LSTM (its fused kernel's workspace is not a template output)")
        metas = tuple((tuple(p.shape), tuple(p.stride()), p.dtype) for p in primals)
        key = TemplateKey(metas, mode, arg_grads, call)
        template = self.templates.get(key)
        if template is None:
            template = shared_template(self, metas, mode, arg_grads, call, primals[0].device)
            if isinstance(template, TraceFailure):
                self._trace_failed(template, mode)
            if self.flat_shards and any(template.grad_mask):  # one for no_grad() input has no say
                self.note_reach(template.no_grad_params)
            known = self.output_structures.setdefault((call, mode), template.output_structure)
            if known != template.output_structure:  # the unit's rebuild of its output is one per call
                self.fall_back("its output's structure depends on its inputs' shapes", mode)
            self.templates[key] = template
            self._record.append(template)
        return template

    def path(self) -> dict[str, Any]:
        """The path the kind's units take, as plain data for ``explain`` and ``stats``: ``"island"``
        (eager, gathered once on entry), ``"inline"`` (every mode), ``"template"`` (with the
        training-flag modes that run inline listed in ``inline_modes``), whether its units keep
        flat shards, the templates traced, and each exit from the fast path with its count."""
        return {"kind": self.name, "units": len(self.units), "path": self.current_path.reported,
                "templates": len(self.templates),
                "inline_modes": {f"{mode:#b}": reason for mode, reason in self.inline_modes.items()},
                "flat_shards": self.flat_reason is None, "exits": dict(self.exits)}

    def note_exit(self, reason: str) -> None:
        """Count one exit of the kind's units from the fast path (a trace, or an eager call, that
        runs them inline), log it once per reason, and raise ``TemplateFallbackError`` under
        ``Config(strict_templates=True)``."""
        first = reason not in self.exits
        self.exits[reason] += 1
        if self.strict:
            raise TemplateFallbackError(f"unit {self.name!r} (and {len(self.units) - 1} more of its kind) left the "
                                        f"template fast path: {reason} (Config.strict_templates)")
        if first:
            log.warning("zerograph: units of kind %s (%d units) run inline: %s", self.name, len(self.units), reason)

    def note_reach(self, no_grad: frozenset[int]) -> None:
        """Record which parameters one trace of the body (a template's, or one that failed after
        autograd's pass: a partition or a write check) leaves without a gradient. The kind's flat
        shards follow it (``FlatShard.no_grad``) while every trace agrees; traces that disagree (a
        parameter used in one training-flag mode or input shape only) make the kind's units run
        inline on shards of their own (``fall_back``): one flat gradient cannot say which of its
        parameters autograd reached."""
        if self.no_grad is not None and self.no_grad != no_grad and self.flat_shards:
            self.fall_back("its traces leave different parameters without a gradient "
                           f"({sorted(self.no_grad)} against {sorted(no_grad)}); one flat shard's gradient "
                           "cannot follow both")
        self.no_grad = no_grad
        for flat in self.flat_shards:
            flat.no_grad = no_grad

    def leave(self, to: UnitPath, reason: str, mode: int | None = None, *, counted_as: str | None = None) -> None:
        """Move the kind's units to path ``to`` because of ``reason`` (kept as ``inline_reason``),
        in training-flag mode ``mode`` only where given (``inline_modes``), and count the exit
        (``note_exit``, as ``counted_as`` where given). The one place a kind's path changes: it
        sets the unit attributes Dynamo guards on (``unit_paths``), so the graphs that called the
        template are traced again. Units on flat shards whose kind cannot tell which parameters
        its output reaches leave them first (``_unflatten``), which runs them inline in every mode.

        Raises:
            UnitPathError: ``to`` is not a path the kind's current one leads to (``TRANSITIONS``),
                or a move to ``MODES_INLINE`` names no mode.
            TemplateFallbackError: under ``Config(strict_templates=True)``, after the move.
        """
        if to not in TRANSITIONS[self.current_path] or (
                to is UnitPath.MODES_INLINE and mode is None and self.current_path is not to):
            raise UnitPathError(f"unit {self.name!r}: no move from path {self.current_path.name} to {to.name} "
                                f"(mode {mode}) for: {reason}")
        self.inline_reason = reason
        if self.flat_shards and self.no_grad is None:
            # inline, a unit that reads its flat shard hands every parameter a part of the flat
            # gradient, zeros where autograd never reached: right only for the parameters no_grad leaves out
            self._unflatten(reason)
            to = to.inline(every_mode=True)
        if mode is not None:
            self.inline_modes[mode] = reason
        attributes = [f"{INLINE_MODE_PREFIX}{mode}"] if mode is not None else []
        attributes += [INLINE_ATTR] if to in (UnitPath.INLINE, UnitPath.ISLAND) else []
        attributes += [ISLAND_ATTR] if to is UnitPath.ISLAND else []
        for module in self.modules:
            for attribute in attributes:
                object.__setattr__(module, attribute, True)
        self.current_path = to
        if counted_as is None:
            counted_as = reason if mode is None else f"{reason} (in training-flag mode {mode:#b})"
        self.note_exit(counted_as)

    def _unflatten(self, reason: str) -> None:
        """Give every unit of the kind per-parameter shards again (each a storage of its own,
        with the same values; the ``DTensor`` parameters keep their identity, so optimizers and
        their state stay valid), for ``leave``, which runs the units inline in every mode: every
        graph traced with the flat shards guarded on ``INLINE_ATTR`` and is traced again, reading
        the parameters one marker each, whose gradients autograd hands to each parameter itself
        (``None`` where it never reached, as in eager). A kind whose trace failed before autograd
        ran (data-dependent control flow) cannot say which parameters its output reaches."""
        for flat in self.flat_shards:
            flat.restore_()
            self.retire(flat)
        self.flat_shards = []
        self.flat_reason = f"its units run inline ({reason}): a flat gradient cannot tell unused parameters"
        for module in self.modules:
            object.__setattr__(module, UNIT_ATTR, dataclasses.replace(getattr(module, UNIT_ATTR), flat=None))

    def _trace_failed(self, failure: TraceFailure, mode: int) -> NoReturn:
        """Leave the templates after a failed trace of the body in ``mode``: as islands where it met
        data-dependent control flow, else inline in that mode, on the flat shards where autograd's
        pass ran before the failure and told which parameters the output reaches. Raises
        ``TemplateUnavailable``."""
        if failure.data_dependent:
            self.run_as_islands(failure.reason)
        if self.flat_shards and failure.no_grad is not None:
            self.note_reach(failure.no_grad)
        self.fall_back(failure.reason, mode)

    def run_as_islands(self, reason: str) -> NoReturn:
        """Make every unit of the kind an eager island from now on (``run_island``): its body has
        data-dependent control flow (a loop over the experts that got tokens, a branch on a
        value), which Dynamo would split into graphs at points that differ from rank to rank,
        each gathering the unit's parameters again; ranks would then run different collectives.
        An island gathers the unit once on entry and releases it on exit, as FSDP2 does, so every
        rank runs the same collectives whatever the body does. Raises ``TemplateUnavailable``."""
        reason = f"{reason}; its units run eagerly, gathered once on entry"
        self.leave(UnitPath.ISLAND, reason)
        raise TemplateUnavailable(f"unit {self.name!r}: {reason}")

    def check_read_in_part(self, template: UnitTemplate, read: Sequence[bool]) -> None:
        """At the joint trace of a call of ``template`` whose outputs ``read`` marks got a gradient
        (the others go unread in the graph): when only the unread ones reach some gradient, which
        eager leaves ``None`` and the template's backward would fill with zeros, run the kind
        inline off its flat shards (``leave_flat_shards``; raises ``TemplateUnavailable``)."""
        if lost_to_unread(template, read):
            self.leave_flat_shards("a call leaves unread an output that alone reaches some gradient (eager leaves "
                                   "that parameter's .grad None; a template's backward would give zeros)")

    def leave_flat_shards(self, reason: str) -> NoReturn:
        """Run every unit of the kind inline, on per-parameter shards (``_unflatten``: autograd
        then decides each parameter's ``.grad``, ``None`` where it never reached), and raise
        ``TemplateUnavailable`` (the compiled forward traces the model again)."""
        self.no_grad = None  # so that _runs_inline takes the flat shards away
        self.fall_back(reason)

    def check_unchanged(self) -> None:
        """Before a forward: run the kind inline in every mode from now on (``run_inline``) if a
        unit changed since compile in what a template could read (``unit_watch.KindWatch``)."""
        if self.current_path not in (UnitPath.INLINE, UnitPath.ISLAND):
            reason = self.watch.first_change(self.units, self.templates.values())
            if reason is not None:
                self.run_inline(reason)

    def fall_back(self, reason: str, mode: int | None = None) -> NoReturn:
        """``run_inline``, then raise ``TemplateUnavailable`` (the compiled forward catches it and
        traces the model again)."""
        self.run_inline(reason, mode)
        raise TemplateUnavailable(f"unit {self.name!r}: {reason}")

    def run_inline(self, reason: str, mode: int | None = None) -> None:
        """Make every unit of the kind run inline from now on, in training-flag mode ``mode`` only
        (a body that cannot be a template in training: dropout, a batch norm's statistics) or in
        every mode (``None``); an island stays one (``leave``, ``UnitPath.inline``)."""
        self.leave(self.current_path.inline(every_mode=mode is None), reason, mode)


def install_unit_templates(units: Sequence[tuple[str, nn.Module]], key_of: dict[int, int], lowering: str,
                           record: list[UnitTemplate], flat: FlatPlan | None = None) -> list[UnitKind]:
    """Make each unit's forward one ``zerograph::unit_forward`` call of its kind's template.

    Args:
        units: ``(name, module)`` of every unit, after ``shard_module_`` (so its parameter
            attributes are the unshard properties), in unit order (unit index ``i + 1``).
        key_of: ``id(shard)`` -> its marker key, for every parameter of the units.
        lowering: ``"eager"`` or ``"inductor"``: how the templates' graphs are lowered.
        record: where each template is appended when it is traced (``CapturedGraphs.templates``).
        flat: when given, the units of every kind whose units all qualify (``flat.flattenable``)
            get their shards in one flat buffer each (``flat.py``): one graph input and one
            marker per unit. ``None``: one per parameter.

    Returns the kinds in order of first unit (their ``flat_shards`` list the flat buffers made);
    the caller keeps them alive (the registry holds them weakly).
    """
    kinds: dict[tuple, UnitKind] = {}
    members: list[tuple[UnitKind, int, str, nn.Module]] = []
    for index, (name, module) in enumerate(units, start=1):
        if "forward" in vars(module):  # a forward of the instance's own: the template traces the class's
            log.warning("zerograph: unit %s has a forward of its own (set on the instance), it runs inline", name)
            continue
        signature = unit_signature(module)
        kind = kinds.get(signature)
        if kind is None:
            kind = kinds[signature] = UnitKind(registry.next_key(), name, module, lowering, record)
            registry.register_unit_kind(kind.kind, kind)
        else:
            kind.units.append(name)
            kind.modules.append(module)
        members.append((kind, index, name, module))
    if flat is not None:
        for kind in kinds.values():
            reasons = [flat.flattenable(index, module) for k, index, _, module in members if k is kind]
            kind.flat_reason = next((r for r in reasons if r is not None), None)
            kind.retire = flat.retire
    for kind, index, name, module in members:
        # a code object per unit (sharding.own_code): a unit called from eager code (after a graph
        # break in its parent's loop) is a frame of its own, compiled at most 8 times per code object
        forward = own_code(_templated_forward, f"forward of {name}")
        param_slots, buffer_slots = _slots(module)
        keys = tuple(key_of[id(mod._parameters[name])] for mod, name in param_slots)
        flat_shard = None
        if flat is not None and kind.flat_reason is None:
            flat_shard = flat.flatten(index, name, module)
            flat_shard.install_reads(module)
            flat_shard.unreached_read = functools.partial(_read_unreached, kind.kind)
            kind.flat_shards.append(flat_shard)
        object.__setattr__(module, UNIT_ATTR,
                           UnitRecord(kind.kind, param_slots, buffer_slots, keys, tuple(module.modules()), flat_shard))
        object.__setattr__(module, INLINE_ATTR, False)  # UnitPath.TEMPLATE
        object.__setattr__(module, ISLAND_ATTR, False)
        object.__setattr__(module, "forward", types.MethodType(forward, module))
        kind.watch.add(module)
    refresh_unit_modes(list(kinds.values()))
    return list(kinds.values())


def refresh_unit_modes(kinds: Sequence[UnitKind]) -> None:
    """Store each templated unit's mode: its submodules' training flags as bits (submodule ``i``
    in ``modules()`` order -> bit ``i``), read by the unit's forward. Called before every model
    forward, outside the trace, so Dynamo guards on one int per unit instead of on every
    submodule's flag, and a flag changed anywhere in a unit,
    ``eval()`` of the model or of one submodule, still changes it and retraces."""
    for kind in kinds:
        for unit in kind.modules:
            mode = 0
            for i, module in enumerate(getattr(unit, UNIT_ATTR).modules):
                if module.training:
                    mode |= 1 << i
            object.__setattr__(unit, MODE_ATTR, mode)


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """How ``install_unit_templates`` asks whether a unit's shards can share one flat buffer
    (``flattenable(unit index, module)``: ``None``, or why not) and makes it (``flatten(unit
    index, name, module)``: the ``FlatShard``); ``api.compile`` builds it from the layouts."""

    flattenable: Callable[[int, nn.Module], str | None]
    flatten: Callable[[int, str, nn.Module], FlatShard]
    retire: Callable[[FlatShard], None] = lambda flat: None  # forget a flat shard whose unit left it


def unit_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The unit's distinct parameters in slot order (the order a template's primals take)."""
    return [mod._parameters[name] for mod, name in _slots(module)[0]]


def _slots(module: nn.Module) -> tuple[tuple[tuple[nn.Module, str], ...], tuple[tuple[nn.Module, str], ...]]:
    """``(submodule, attribute)`` of each distinct parameter, then each buffer, of ``module`` in
    ``named_parameters`` / ``named_buffers`` order (a parameter tied within the unit once)."""
    params, seen = [], set()
    for mod in module.modules():
        for name, param in mod._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append((mod, name))
    buffers = [(mod, name) for mod in module.modules() for name, b in mod._buffers.items() if b is not None]
    return tuple(params), tuple(buffers)


@torch._dynamo.assume_constant_result
def inlining_every_unit() -> bool:
    """Whether this trace runs every templated unit inline (``TraceState.inline_every_unit``: one
    with dynamic shapes). Dynamo takes the value as a constant and guards on nothing, so the graphs
    traced before, for static shapes, stay valid and keep their templates; the dynamic graph is
    inline throughout."""
    return TRACE.inline_every_unit


def _templated_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A templated unit's ``forward``: its parameters (unshard markers) and buffers, then one
    ``unit_forward`` of the call's tensors (every tensor of its positional and keyword arguments,
    nested in tuples, lists and dicts) in the mode of its submodules' training flags
    (``MODE_ATTR``, read here, so Dynamo guards on it and ``eval()`` retraces), keyed by the call's
    structure and autocast state (``unit_calls``); the op's outputs put back into the body's output
    structure. The body runs inline instead once its kind fell back to inline (in this mode or
    every mode), for a call with no tensor or with an argument no template can take (an object:
    counted and logged, ``UnitKind.note_exit``), in the template's own trace of the body, and
    outside the model's forward (a direct call of the unit, which the body refuses with
    ``ShardingError`` as without templates).

    Dynamo traces this once per unit, so it is written for Dynamo's cost, which is per bytecode
    and higher still per inlined call: plain loops instead of generators (``all``, ``sum`` and
    ``enumerate`` of a generator run as Dynamo polyfills), the module flags read directly instead
    of through their accessors, and the ops called as ``OpOverload``s (a ``CustomOpDef``'s
    ``__call__`` is one more Python frame to inline; ``full_parameter`` calls its op that way too)."""
    body = type(self).forward
    if torch.compiler.is_compiling():  # called from a routing loop Dynamo left to eager code: its parent an island
        check_unit_caller(getattr(self, UNIT_ATTR).kind)
    mode = getattr(self, MODE_ATTR)  # one guard per unit; refresh_unit_modes keeps it current
    inline = (getattr(self, INLINE_ATTR) or getattr(self, f"{INLINE_MODE_PREFIX}{mode}", False)
              or inlining_every_unit() or TRACE.tracing_unit or not TRACE.gathering)
    if inline:
        if getattr(self, ISLAND_ATTR) and TRACE.gathering and not TRACE.tracing_unit:
            return run_island(self, args, kwargs)
        return body(self, *args, **kwargs)
    record = getattr(self, UNIT_ATTR)
    kind, param_slots, buffer_slots, keys, flat = (record.kind, record.param_slots, record.buffer_slots,
                                                   record.keys, record.flat)
    tensors: list[torch.Tensor] = []
    arguments = (describe(args, tensors), describe(kwargs, tensors))
    # len() where `not` would do: Dynamo traces `not` of a list only as a branch condition
    exit_reason = _call_exit(arguments) if len(tensors) > 0 else "a call with no tensor argument"
    if exit_reason is not None:  # the call site repeats every step: the kind leaves its templates
        _leave_templates(kind, exit_reason, mode)
    if flat is not None and TRACE.substituted:  # this call only
        _note_exit(kind, "functional_call substitutes its parameters (the slots' tensors are read inline)")
        return body(self, *args, **kwargs)
    device_type = tensors[0].device.type
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    call = call_key((*arguments, autocast))
    # Dynamo guards on each input's requires_grad already: a constant for this trace
    arg_grads, bit = 0, 1
    for tensor in tensors:
        if tensor.requires_grad:
            arg_grads |= bit
        bit <<= 1
    # the shards straight from their slots, not through the parameter properties: the same
    # markers, for less of Dynamo's time per parameter
    if flat is not None:  # one marker for the unit: the template cuts the parameters out of its output
        primals = [*tensors, full_parameter(flat.input, flat.layout.key)]
    else:
        primals = [*tensors, *[full_parameter(mod._parameters[name], key) for (mod, name), key in zip(param_slots, keys)]]
    for mod, name in buffer_slots:
        primals.append(mod._buffers[name])
    if torch.compiler.is_compiling():  # the traces see one node per unit, its outputs and a token (ops.unit_call)
        outputs = _unit_call(kind, mode, arg_grads, primals, call)
    else:
        outputs = _unit_forward(kind, mode, arg_grads, primals, call)
    structure = _output_structure(kind, call, mode)
    if structure == TENSOR:
        return outputs[0]
    return rebuild(structure, iter(outputs))


def _call_exit(arguments: tuple) -> str | None:
    """Why a call of these arguments' structures cannot take a template, or ``None``."""
    bad = unsupported(arguments[0])
    if bad is None:
        bad = unsupported(arguments[1])
    return None if bad is None else f"an argument of type {bad} (a template takes tensors and constants)"


@torch._dynamo.assume_constant_result
def _note_exit(kind: int, reason: str) -> bool:
    """``UnitKind.note_exit`` of ``kind``, once per trace under Dynamo (a constant of the graph)."""
    registry.unit_kind(kind).note_exit(reason)
    return True


@torch._dynamo.assume_constant_result
def _leave_templates(kind: int, reason: str, mode: int) -> bool:
    """``UnitKind.fall_back`` of ``kind`` in training-flag mode ``mode``: a call no template can
    take (an object argument such as a Hugging Face KV cache, which an evaluation passes and
    training need not) comes again at every step in that mode, so the kind's units run inline in
    it from now on, off their flat shards when no trace has said which parameters their output
    reaches (``UnitKind.leave``): the per-parameter build's path, not a slower one; other modes keep
    their templates. Raises ``TemplateUnavailable`` (the compiled forward traces the model again)."""
    registry.unit_kind(kind).fall_back(reason, mode)
    return True


@torch._dynamo.assume_constant_result
def _output_structure(kind: int, call: int, mode: int) -> Any:
    """The structure the body's output had when traced for ``call`` in ``mode`` (the op that ran
    just before, or its fake implementation under Dynamo, traced it)."""
    return registry.unit_kind(kind).output_structures[call, mode]


@torch._dynamo.assume_constant_result
def _read_unreached(kind: int) -> bool:
    """A parameter that ``kind``'s template found its output does not reach (``FlatShard.no_grad``,
    whose gradient part is dropped) is read through its flat shard: by the unit's parent, outside
    the unit's forward, or by its body run inline, where the template's answer may not hold.
    Without knowing whether autograd reaches it, the kind's units leave their flat shards and run
    inline (``UnitKind.fall_back``), and the forward is traced again. Dynamo runs this while it
    traces (its result a constant of the graph); eager code calls it as it is."""
    registry.unit_kind(kind).leave_flat_shards("a parameter its template leaves without a gradient is read where "
                                               "the template does not see it (by the unit's parent, or in an inline body)")
