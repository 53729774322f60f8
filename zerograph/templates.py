"""Units traced once: every unit of one kind calls one traced, partitioned and lowered template.

``Config(unit_templates=True)``. Units are grouped into *kinds* by structure (``unit_signature``:
each submodule's class and plain attributes, each parameter's and buffer's name, shape, dtype and
``requires_grad``), so a GPT's 32 blocks are one kind, while blocks of another width, without a
bias, with an extra parameter or with a flag that changes their control flow are kinds of their
own. Each unit's ``forward`` becomes one ``zerograph::unit_forward(kind, primals)`` node
(``install_unit_templates``): Dynamo traces the unit's parameter reads, which are still the
``zerograph::unshard`` markers the passes expand into all-gathers, and the call, but not the
unit's body. The body is traced once per kind and input signature (``trace_template``): make_fx
of forward + backward on fake tensors, then the min-cut partitioner, as AOTAutograd does for a
whole graph; the two graphs are lowered once and called by every unit of the kind.

So the model graph the passes see holds every unit's all-gathers, reduce-scatters, prefetches and
releases, as before, around one node per unit; its size, and the time of the Dynamo and
AOTAutograd traces, no longer grow with the size of a block. Source of the idea: compiling a
repeated block once, as FSDP2 + ``torch.compile`` per block does, and Dynamo's
``nested_compile_region`` (``invoke_subgraph``); README "Compile time" says why not those.

Limits (the unit then runs inline, traced with the model as without templates): a unit called
with keyword arguments or non-tensor arguments. A unit whose body cannot be traced on fake
tensors (data-dependent Python control flow) or that writes a parameter or buffer in place is
refused with ``ShardingError`` naming the unit.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from . import registry
from .errors import ShardingError
from .ops import unit_forward
from .sharding import full_parameter, original_class, set_tracing_unit, tracing_unit

UNIT_ATTR = "_zerograph_unit"  # a templated unit's (kind, parameter slots, buffer slots)

# (shape, stride, dtype) of one tensor; a template is traced per tuple of these of its primals
TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


@dataclasses.dataclass
class UnitTemplate:
    """One unit kind traced for one input signature: its forward and backward graphs, lowered.

    Attributes:
        id: the registry id ``zerograph::unit_backward`` names it by.
        kind: the unit kind it belongs to.
        input_metas: ``(shape, stride, dtype)`` of each primal (unit arguments, parameters, buffers).
        n_outputs: outputs of the unit itself (1: the unit returns one tensor); ``unit_forward``
            returns these first, then the activations the backward needs.
        output_metas: ``(shape, stride, dtype)`` of every ``unit_forward`` output.
        saved_primals: indices of the primals the backward reads (saved by autograd, not returned,
            since a custom op's output may not alias its input).
        grad_mask: per primal, whether the backward returns its gradient (floating-point arguments
            and parameters that require grad).
        grad_metas: ``(shape, stride, dtype)`` of each gradient returned (``grad_mask`` order).
        forward_graph, backward_graph: the partitioned graphs (ATen ops), for tests and dumps.
        trace_seconds: wall seconds the trace, partition and lowering took.
        units: names of the units that call it (its kind's units).
    """

    id: int
    kind: int
    input_metas: tuple[TensorMeta, ...]
    n_outputs: int
    output_metas: list[TensorMeta]
    saved_primals: list[int]
    grad_mask: list[bool]
    grad_metas: list[TensorMeta]
    forward_graph: fx.GraphModule
    backward_graph: fx.GraphModule
    backward_sources: list[tuple[str, int]]  # per backward input but tangents: ("primal"|"output", index)
    run_forward: Callable[..., Any]
    run_backward: Callable[..., Any]
    trace_seconds: float = 0.0
    units: list[str] = dataclasses.field(default_factory=list)

    def forward(self, primals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.run_forward(*primals))

    def backward(self, primals: Sequence[torch.Tensor], saved: Sequence[torch.Tensor],
                 tangents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of the differentiable primals; zeros where the unit does not use one."""
        args = [primals[i] if source == "primal" else saved[i] for source, i in self.backward_sources]
        grads = self.run_backward(*args, *tangents)
        out = []
        for grad, wanted, (shape, stride, dtype) in zip(grads, self.grad_mask, self.input_metas):
            if wanted:
                out.append(grad if grad is not None else
                           torch.zeros(shape, dtype=dtype, device=tangents[0].device))
        return out


class UnitKind:
    """The units that share one structure, and the templates traced for them (one per input
    signature). The representative ``module`` is the kind's first unit: its body is what gets
    traced, with each primal put in its parameter and buffer slots for the trace."""

    def __init__(self, kind: int, name: str, module: nn.Module, lowering: str, record: list[UnitTemplate]):
        self.kind, self.name, self.module, self.lowering = kind, name, module, lowering
        self.units: list[str] = [name]
        self.templates: dict[tuple, UnitTemplate] = {}  # (input metas, training flags) -> template
        self._record = record
        self._ids: list[int] = []
        weakref.finalize(self, registry.release_templates, self._ids)  # a freed model frees its templates

    def template(self, primals: Sequence[torch.Tensor]) -> UnitTemplate:
        metas = tuple((tuple(p.shape), tuple(p.stride()), p.dtype) for p in primals)
        # train / eval changes what the body does (dropout, branches on self.training)
        key = (metas, tuple(m.training for m in self.module.modules()))
        template = self.templates.get(key)
        if template is None:
            template = self.templates[key] = trace_template(self, metas, primals[0].device)
            self._ids.append(template.id)
            self._record.append(template)
        return template


def install_unit_templates(units: Sequence[tuple[str, nn.Module]], key_of: dict[int, int], lowering: str,
                           record: list[UnitTemplate]) -> list[UnitKind]:
    """Make each unit's forward one ``zerograph::unit_forward`` call of its kind's template.

    Args:
        units: ``(name, module)`` of every unit, after ``shard_module_`` (so its parameter
            attributes are the unshard properties).
        key_of: ``id(shard)`` -> its marker key, for every parameter of the units.
        lowering: ``"eager"`` or ``"inductor"``: how the templates' graphs are lowered.
        record: where each template is appended when it is traced (``CapturedGraphs.templates``).

    Returns the kinds in order of first unit; the caller keeps them alive (the registry holds
    them weakly).
    """
    kinds: dict[tuple, UnitKind] = {}
    for name, module in units:
        signature = unit_signature(module)
        kind = kinds.get(signature)
        if kind is None:
            kind = kinds[signature] = UnitKind(registry.next_key(), name, module, lowering, record)
            registry.register_unit_kind(kind.kind, kind)
        else:
            kind.units.append(name)
        param_slots, buffer_slots = _slots(module)
        keys = tuple(key_of[id(mod._parameters[name])] for mod, name in param_slots)
        object.__setattr__(module, UNIT_ATTR, (kind.kind, param_slots, buffer_slots, keys))
        object.__setattr__(module, "forward", types.MethodType(_templated_forward, module))
    return list(kinds.values())


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


def _templated_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A templated unit's ``forward``: its parameters (unshard markers) and buffers, then one
    ``unit_forward``. Keyword or non-tensor arguments run the body inline instead; so does the
    template's own trace of the body."""
    body = type(self).forward
    if tracing_unit() or kwargs or not args or not all(isinstance(a, torch.Tensor) for a in args):
        return body(self, *args, **kwargs)
    kind, param_slots, buffer_slots, keys = getattr(self, UNIT_ATTR)
    # the shards straight from their slots, not through the parameter properties: the same
    # markers, for less of Dynamo's time per parameter
    primals = [*args, *[full_parameter(mod._parameters[name], key) for (mod, name), key in zip(param_slots, keys)],
               *[mod._buffers[name] for mod, name in buffer_slots]]
    return unit_forward(kind, primals)[0]


def unit_signature(module: nn.Module) -> tuple:
    """What must match for two units to share a template: for every submodule, its path, original
    class and plain attributes (numbers, strings, flags, dtypes; other objects by identity), and
    its parameters' and buffers' names, full shapes, dtypes and ``requires_grad``."""
    parts = []
    for path, mod in module.named_modules():
        attrs = tuple(sorted((k, _attribute_key(v)) for k, v in vars(mod).items()
                             if k not in _MODULE_INTERNALS and not k.startswith("_zerograph")))
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mod._parameters.items() if p is not None)
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in mod._buffers.items() if b is not None)
        parts.append((path, original_class(mod), attrs, params, buffers))
    return tuple(parts)


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "forward"}) | {
    k for k in vars(nn.Module()) if k.endswith("hooks") or "hooks_" in k or k.endswith("_hooks_with_kwargs")}


def _attribute_key(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (tuple, list, frozenset)):
        return (type(value).__name__, tuple(_attribute_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _attribute_key(v)) for k, v in value.items())))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return ("function", getattr(value, "__module__", None), getattr(value, "__qualname__", repr(value)))
    return ("object", id(value))


def trace_template(kind: UnitKind, metas: tuple[TensorMeta, ...], device: torch.device) -> UnitTemplate:
    """Trace ``kind``'s body for primals of ``metas``: forward + backward on fake tensors, the
    min-cut partitioner, lowering. Runs in a thread of its own: it is called from the op's fake
    implementation inside Dynamo's and AOTAutograd's traces, below autograd and under their fake
    modes, and the trace needs autograd and a fake mode of its own.

    Raises:
        ShardingError: the body returned something other than one tensor, could not be traced on
            fake tensors, or writes a parameter, buffer or argument in place.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["template"] = _trace(kind, metas, device)
        except BaseException as exc:  # handed to the calling thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name=f"zerograph-trace-{kind.name}")
    worker.start()
    worker.join()
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, ShardingError):
            raise error
        raise ShardingError(f"unit {kind.name!r} ({type(kind.module).__name__}) could not be traced as a template "
                            f"(Config(unit_templates=True)): {type(error).__name__}: {error}. Its body must trace "
                            "on fake tensors without data-dependent Python control flow; compile with "
                            "unit_templates=False to trace it inline with the model") from error
    return outcome["template"]


def _trace(kind: UnitKind, metas: tuple[TensorMeta, ...], device: torch.device) -> UnitTemplate:
    start = time.perf_counter()
    module = kind.module
    _, param_slots, buffer_slots, _ = getattr(module, UNIT_ATTR)
    n_params, n_buffers = len(param_slots), len(buffer_slots)
    n_args = len(metas) - n_params - n_buffers
    wants_grad = ([dtype.is_floating_point for _, _, dtype in metas[:n_args]]
                  + [mod._parameters[name].requires_grad for mod, name in param_slots] + [False] * n_buffers)
    fake_mode = FakeTensorMode()
    with fake_mode:
        primals = [torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)
                   for (shape, stride, dtype), grad in zip(metas, wants_grad)]

    def body(*p: torch.Tensor) -> list[torch.Tensor]:
        slots = [(mod._parameters, name) for mod, name in param_slots] + [(mod._buffers, name) for mod, name in buffer_slots]
        previous_values = [table[name] for table, name in slots]
        previous = set_tracing_unit(True)
        try:
            for (table, name), value in zip(slots, p[n_args:]):
                table[name] = value
            out = type(module).forward(module, *p[:n_args])
        finally:
            for (table, name), value in zip(slots, previous_values):
                table[name] = value
            set_tracing_unit(previous)
        if not isinstance(out, torch.Tensor):
            raise ShardingError(f"unit {kind.name!r} returned {type(out).__name__}; Config(unit_templates=True) "
                                "templates units that return one tensor (compile with unit_templates=False)")
        return [out]

    with fake_mode:
        tangents = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in body(*primals)]

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[list, list]:
        outs = body(*primals)
        differentiable = [p for p in primals if p.requires_grad]
        grads = iter(torch.autograd.grad(outs, differentiable, tangents, allow_unused=True))
        return outs, [next(grads) if p.requires_grad else None for p in primals]

    joint_graph = make_fx(joint)(primals, tangents)
    _check_no_writes(kind.name, joint_graph, len(metas))
    # views of a primal (a weight's transpose) are replayed in backward instead of saved: the
    # op cannot return a view of its input, and the primal itself is saved by autograd anyway
    with torch._functorch.config.patch(recompute_views=True):
        fwd, bwd = min_cut_rematerialization_partition(joint_graph, (primals, tangents), num_fwd_outputs=len(tangents))
    n_outputs = len(tangents)
    template_id, backward_sources, saved_primals = _own_outputs(fwd, n_outputs)
    out_node = fwd.graph.output_node()
    outputs = out_node.args[0]
    bwd_inputs = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    assert len(bwd_inputs) == len(backward_sources) + n_outputs, (len(bwd_inputs), len(backward_sources))
    output_metas = [_meta(n.meta["val"]) for n in outputs]
    grad_metas = [_meta(primals[i]) for i, wanted in enumerate(wants_grad) if wanted]
    run_forward, run_backward = _lower(kind.lowering, fwd, bwd, fake_mode, primals, outputs, backward_sources,
                                       saved_primals, tangents)
    template = UnitTemplate(template_id, kind.kind, metas, n_outputs, output_metas, saved_primals, wants_grad,
                            grad_metas, fwd, bwd, backward_sources, run_forward, run_backward)
    registry.register_template_as(template_id, template)
    template.trace_seconds = time.perf_counter() - start
    template.units = kind.units
    return template


def _own_outputs(fwd: fx.GraphModule, n_outputs: int) -> tuple[int, list[tuple[str, int]], list[int]]:
    """Rewrite the partitioned forward to return the unit's outputs, then each saved activation
    once, with no output aliasing a primal or an earlier output (a clone where one would); saved
    primals are left to autograd. Returns the new template id, where each backward input comes
    from (``("primal", i)``: the i-th saved primal; ``("output", j)``: ``unit_forward``'s j-th
    output past the unit's own) and the indices of the saved primals."""
    graph = fwd.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primal_index = {n: i for i, n in enumerate(placeholders)}
    out_node = graph.output_node()
    values = list(out_node.args[0])
    user, saved = values[:n_outputs], values[n_outputs:]
    returned: list[fx.Node] = list(user)
    sources: list[tuple[str, int]] = []
    saved_primals: list[int] = []
    for node in saved:
        if node in primal_index:
            if primal_index[node] not in saved_primals:
                saved_primals.append(primal_index[node])
            sources.append(("primal", saved_primals.index(primal_index[node])))
        else:
            if node not in returned:
                returned.append(node)
            sources.append(("output", returned.index(node)))
    # outputs must be new tensors: clone any that shares a storage with a primal or an earlier output
    storages = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in placeholders
                if isinstance(n.meta.get("val"), torch.Tensor)}
    final = []
    with graph.inserting_before(out_node):
        for node in returned:
            ref = StorageWeakRef(node.meta["val"].untyped_storage())
            if ref in storages:
                clone = graph.call_function(torch.ops.aten.clone.default, (node,))
                clone.meta["val"] = node.meta["val"].clone()
                node = clone
                ref = StorageWeakRef(node.meta["val"].untyped_storage())
            storages.add(ref)
            final.append(node)
    out_node.args = (final,)
    graph.lint()
    fwd.recompile()
    # "output" sources index unit_forward's outputs past the unit's own
    sources = [(s, i - n_outputs if s == "output" else i) for s, i in sources]
    return registry.next_template_id(), sources, saved_primals


def _check_no_writes(name: str, joint: fx.GraphModule, n_primals: int) -> None:
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"][:n_primals]
    storages = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in placeholders
                if isinstance(n.meta.get("val"), torch.Tensor)}
    for node in joint.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            val = value.meta.get("val") if isinstance(value, fx.Node) else None
            if isinstance(val, torch.Tensor) and StorageWeakRef(val.untyped_storage()) in storages:
                raise ShardingError(f"unit {name!r} writes an input, parameter or buffer in place ({node.target}); "
                                    "a unit template cannot (its inputs are the gathered copies): compile with "
                                    "Config(unit_templates=False)")


def _meta(t: torch.Tensor) -> TensorMeta:
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _lower(lowering: str, fwd: fx.GraphModule, bwd: fx.GraphModule, fake_mode: FakeTensorMode,
           primals: list[torch.Tensor], outputs: Sequence[fx.Node], backward_sources: list[tuple[str, int]],
           saved_primals: list[int], tangents: list[torch.Tensor]) -> tuple[Callable, Callable]:
    if lowering != "inductor":
        return fwd, bwd
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    with fake_mode:
        fwd_inputs = [p.detach() for p in primals]
        saved_values = [n.meta["val"] for n in outputs]
        bwd_inputs = [fwd_inputs[saved_primals[i]] if s == "primal" else saved_values[len(tangents) + i]
                      for s, i in backward_sources] + list(tangents)
        lowered = []
        for gm, inputs, backward in ((fwd, fwd_inputs, False), (bwd, bwd_inputs, True)):
            decomposed = make_fx(fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*inputs)
            compiled = compile_fx_inner(decomposed, inputs, is_backward=backward)
            lowered.append(_unboxed(compiled))
    return lowered[0], lowered[1]


def _unboxed(compiled: Callable) -> Callable:
    def call(*args: torch.Tensor) -> Any:
        return compiled(list(args))

    return call
