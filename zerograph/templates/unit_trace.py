"""One unit kind's body traced into a template: forward + backward on fake tensors, the min-cut
partitioner, the lowering (``trace_unit``), and what it yields (``UnitTemplate``).

``templates/kinds.py`` decides which units share a template and when one is traced (in a thread of its
own, from the unit op's fake implementation); this module is the trace itself: the body run
with the template's primals in the unit's parameter and buffer slots (``UNIT_ATTR``), the joint
graph made with ``make_fx``, checked for in-place writes to parameters and inputs, partitioned
(views of parameters and the cuts of a flat shard replayed in backward, not saved), and lowered.
Source: AOTAutograd's joint trace and ``min_cut_rematerialization_partition``, applied to one
block instead of a whole graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from ..graph import registry
from ..passes._fx import sink_to_first_use
from ..shard.trace_state import TRACE
from .attribute_reads import instance_reads, recording_reads
from .unit_calls import TENSOR, call_arguments, call_structure, flatten_output
from .unit_flat_grad import write_flat_gradient_in_place
from .unit_reach import per_output_reach
from .unit_record import UNIT_ATTR, UnitRecord
from .unit_saved import rebase_saved_views, recompute_norms
from .unit_writes import check_no_writes, functional_joint, save_random_values

if TYPE_CHECKING:
    from torch import nn

# the min-cut partitioner's options for a template (``zerograph.plan`` estimates with the same):
# views of a primal (a weight's transpose) are replayed in backward instead of saved (the op cannot
# return a view of its input, and autograd saves the primal anyway); an op of the partitioner's
# cheap list (pointwise, views; never a matmul, attention or collective) is recomputed in backward
# even where its output is materialized there (a GPT's gelu: its input is saved, not both);
# and the joint graph's layer norms are marked for recompute (``unit_saved.recompute_norms``)
PARTITION_OPTIONS = {"recompute_views": True, "ban_recompute_materialized_backward": False}

# (shape, stride, dtype) of one tensor; a template is traced per tuple of these of its primals
TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


class TracedKind(Protocol):
    """What a trace reads of a unit kind (``templates.kinds.UnitKind``, which decides when to trace and
    imports this module: the trace names only what it needs, so the two do not import each other)."""

    kind: int  # the kind's registry key
    name: str  # its first unit's name, for messages
    module: nn.Module  # its first unit: the body traced
    lowering: str  # "eager" or "inductor"
    units: list[str]  # names of every unit of the kind


@dataclasses.dataclass
class UnitTemplate:
    """One unit kind traced for one input signature: its forward and backward graphs, lowered.

    Attributes:
        id: the registry id ``zerograph::unit_backward`` names it by.
        kind: the unit kind it belongs to.
        input_metas: ``(shape, stride, dtype)`` of each primal (unit arguments, parameters, buffers).
        n_outputs: tensors of the unit's own output (1: the unit returns one tensor); ``unit_forward``
            returns these first, then the activations the backward needs.
        output_structure: where those tensors sit in the body's output (``unit_calls``: ``TENSOR``
            for one tensor; a tuple such as ``(hidden, None)`` or a dict otherwise).
        output_metas: ``(shape, stride, dtype)`` of every ``unit_forward`` output.
        saved_primals: indices of the primals the backward reads (saved by autograd, not returned,
            since a custom op's output may not alias its input).
        grad_mask: per primal, whether the backward returns its gradient (floating-point arguments
            and parameters that require grad and that the output reaches through autograd; for
            the others autograd gets ``None``, as in eager).
        grad_metas: ``(shape, stride, dtype)`` of each gradient returned (``grad_mask`` order).
        forward_graph, backward_graph: the partitioned graphs (ATen ops), for tests and dumps.
        no_grad_params: with a flat shard, the indices (slot order) of the unit's parameters the
            output does not reach: their part of the flat gradient is zeros, their ``.grad``
            stays ``None`` (``FlatShard.no_grad``).
        trace_seconds: wall seconds the trace, partition and lowering took (0 for a copy).
        units: names of the units that call it (its kind's units).
        reused_from: the id of the template this one copies (traced for another unit kind in
            this process, ``template_cache.shared_template``), or ``None`` when traced for this one.
        read_attrs: ``(module index, name)`` of each instance attribute of the unit's modules
            (``modules()`` order) the body read while traced, ``None`` when it read them all
            (``attribute_reads``): what ``template_keys.read_values`` compares.
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
    no_grad_params: frozenset[int] = frozenset()
    trace_seconds: float = 0.0
    units: list[str] = dataclasses.field(default_factory=list)
    reused_from: int | None = None
    read_attrs: frozenset[tuple[int, str]] | None = None  # instance attributes the body read (None: all)
    output_structure: Any = TENSOR
    draws_random: bool = False  # its forward draws random numbers (dropout): run once, never recomputed
    saved_outputs: list[int] = dataclasses.field(default_factory=list)  # unit_forward outputs backward reads
    # per unit output, the gradients it reaches (positions among the differentiable primals, then
    # a flat shard's cut parameters): unit_reach.lost_to_unread
    output_reach: tuple[frozenset[int], ...] = ()

    def forward(self, primals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.run_forward(*primals))

    def backward(self, primals: Sequence[torch.Tensor], saved: Sequence[torch.Tensor],
                 tangents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of the primals of ``grad_mask`` (those the output reaches), in primal order."""
        args = [primals[i] if source == "primal" else saved[i] for source, i in self.backward_sources]
        grads = self.run_backward(*args, *tangents)
        return [grad for grad, wanted in zip(grads, self.grad_mask) if wanted]


def trace_unit(kind: TracedKind, metas: tuple[TensorMeta, ...], mode: int, arg_grads: int, call: int,
               device: torch.device, reach: dict[str, Any] | None = None) -> UnitTemplate:
    """``kind``'s body for primals of ``metas`` (``(shape, stride, dtype)`` each: the unit's tensor
    arguments, then its parameters, or its one flat shard, then its buffers) passed as call
    ``call`` (``unit_calls.call_key``: where the tensors sit among the call's constants, and the
    autocast dtype the forward runs under), with its submodules' training flags from ``mode``'s
    bits and gradients for the arguments of ``arg_grads``'s bits and the trainable parameters, as
    a registered, lowered ``UnitTemplate``. Call from a thread with autograd on and no fake mode
    active (``template_cache.trace_template``).

    Raises whatever the trace meets (the caller makes the kind run inline, or an island where the
    body made a data-dependent value: ``reach["shape_env"]`` is the trace's shape environment), or
    ``ShardingError`` for a body that writes a parameter in place. Once autograd's pass has run, ``reach["no_grad"]``
    holds the parameters of a flat shard the output does not reach (``UnitTemplate.no_grad_params``),
    where some gradient is asked for: a later failure (the partition, a write check) leaves the kind
    that answer for its inline units."""
    start = time.perf_counter()
    body = _Body(kind.module, mode, len(metas), call, device)
    wants_grad = body.wants_grad(metas, arg_grads)
    # a ShapeEnv (no symbol is made: every size is an int) so that Inductor's FX graph cache takes
    # the lowered body: without one it bypasses the cache ("No shape env"), and a restart lowered
    # and generated every template's code again
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    if reach is not None:  # whether the body made a data-dependent value, asked after a failure
        reach["shape_env"] = fake_mode.shape_env
    with fake_mode:
        primals = [torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)
                   for (shape, stride, dtype), grad in zip(metas, wants_grad)]
        tangents = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in body(*primals)]
    joint_graph, grad_mask, no_grad_params, output_reach = _joint(body, primals, tangents, wants_grad, fake_mode)
    if reach is not None and body.flat is not None and any(grad_mask):
        reach["no_grad"] = no_grad_params
    check_no_writes(kind.name, joint_graph, len(metas), body.parameter_names(), body.cut_out)
    joint_graph = functional_joint(joint_graph, primals, tangents, fake_mode)
    draws_random = save_random_values(joint_graph.graph) > 0  # dropout's mask drawn once, in forward
    fwd, bwd = _partition(joint_graph, primals, tangents, body.n_args if body.flat is not None else None)
    if body.flat is not None and kind.lowering != "inductor":  # the flat gradient held once, not twice
        write_flat_gradient_in_place(bwd, body.n_args)
    template = _template(kind, metas, fwd, bwd, fake_mode, primals, tangents, grad_mask, no_grad_params)
    template.output_structure, template.output_reach = body.output_structure, output_reach
    template.draws_random = draws_random
    template.read_attrs = instance_reads(body.modules, body.reads)
    template.trace_seconds = time.perf_counter() - start
    template.units = kind.units
    return template


class _Body:
    """A unit's body as a function of its primals, for ``make_fx``: a call puts the primals in the
    unit's parameter and buffer slots (a flat shard cut into its parameters first) and its
    submodules' training flags from ``mode``'s bits, runs the class's ``forward`` on the call's
    arguments (``unit_calls.call_arguments``) under the call's autocast state, puts everything
    back, whatever the forward raised, and returns the output's tensors (its structure in
    ``output_structure``)."""

    def __init__(self, module: nn.Module, mode: int, n_primals: int, call: int, device: torch.device) -> None:
        self.module, self.mode, self.call = module, mode, call
        self.autocast = call_structure(call)[2]
        self.device_type = device.type
        self.output_structure: Any = None
        record: UnitRecord = getattr(module, UNIT_ATTR)
        self.param_slots, self.buffer_slots = record.param_slots, record.buffer_slots
        self.modules, self.flat = record.modules, record.flat
        self.n_params = 1 if self.flat is not None else len(self.param_slots)
        self.n_args = n_primals - self.n_params - len(self.buffer_slots)
        self.slot_names = [_slot_name(module, slot) for slot in self.param_slots]
        # storages of the parameters the body computes with, when they are cut out of a flat shard (a
        # write to one is refused as a write to the parameter is; the last trace's are what count)
        self.cut_out: dict[StorageWeakRef, str] = {}
        self.cut_params: list[torch.Tensor] = []  # the parameters as the last trace cut them out of the flat shard
        self.reads: set[tuple[int, str]] = set()  # (module index, attribute name) the body looked up

    def wants_grad(self, metas: tuple[TensorMeta, ...], arg_grads: int) -> list[bool]:
        """Per primal, whether the trace differentiates it: the floating-point and complex
        arguments of ``arg_grads``'s bits, the trainable parameters (a flat shard always), no buffer.
        (Complex counts: a complex activation between units carries the gradient of every unit
        before it; left out, those units' weights would get no gradient.)"""
        param_grads = ([True] if self.flat is not None
                       else [mod._parameters[name].requires_grad for mod, name in self.param_slots])
        args = [(dtype.is_floating_point or dtype.is_complex) and bool(arg_grads >> i & 1)
                for i, (_, _, dtype) in enumerate(metas[:self.n_args])]
        return args + param_grads + [False] * len(self.buffer_slots)

    def parameter_names(self) -> dict[int, str]:
        """Primal index -> the parameter's name in the unit (the flat shard's: ``"<flat shard>"``)."""
        if self.flat is not None:
            return {self.n_args: "<flat shard>"}
        return {self.n_args + i: name for i, name in enumerate(self.slot_names)}

    def __call__(self, *p: torch.Tensor) -> list[torch.Tensor]:
        slots = ([(mod._parameters, name) for mod, name in self.param_slots]
                 + [(mod._buffers, name) for mod, name in self.buffer_slots])
        n_args, n_params = self.n_args, self.n_params
        params = list(p[n_args:n_args + n_params])
        if self.flat is not None:
            params = self.flat.unflatten(params[0])
            self.cut_params[:] = params
            self.cut_out.clear()
            self.cut_out.update({StorageWeakRef(t.untyped_storage()): name for t, name in zip(params, self.slot_names)})
        values = [*params, *p[n_args + n_params:]]
        previous_values = [table[name] for table, name in slots]
        previous_flags = [m.training for m in self.modules]
        with TRACE.scope(tracing_unit=True):
            try:
                for (table, name), value in zip(slots, values):
                    table[name] = value
                for i, m in enumerate(self.modules):  # the calling unit's train / eval flags
                    m.training = bool(self.mode >> i & 1)
                args, kwargs = call_arguments(self.call, list(p[:n_args]))
                autocast = (torch.autocast(self.device_type, dtype=self.autocast) if self.autocast is not None
                            else contextlib.nullcontext())
                with recording_reads(self.modules, self.reads), autocast:
                    out = type(self.module).forward(self.module, *args, **kwargs)
            finally:
                for (table, name), value in zip(slots, previous_values):
                    table[name] = value
                for m, flag in zip(self.modules, previous_flags):
                    m.training = flag
        self.output_structure, tensors = flatten_output(out)
        return tensors


def _joint(body: _Body, primals: list[torch.Tensor], tangents: list[torch.Tensor], wants_grad: list[bool],
           fake_mode: FakeTensorMode) -> tuple[fx.GraphModule, list[bool], frozenset[int], tuple[frozenset[int], ...]]:
    """The joint forward + backward graph of ``body`` (``make_fx``), the primals whose gradient it
    returns (``grad_mask``: wanted and reached by autograd; eager leaves the others' ``.grad``
    ``None``, AdamW then skips them, so must we), the parameters cut out of a flat shard that
    the output never reaches (one flat gradient cannot say so itself), and the gradients each
    output reaches (``UnitTemplate.output_reach``)."""
    reached: dict[str, list[bool]] = {}

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[list, list]:
        outs = body(*primals)
        differentiable = [p for p in primals if p.requires_grad]
        # outputs autograd can differentiate (an index, a detached value has no grad_fn)
        reached_outs = [(o, t) for o, t in zip(outs, tangents) if o.requires_grad]
        grads = [None] * len(differentiable)
        if differentiable and reached_outs:
            grads = list(torch.autograd.grad([o for o, _ in reached_outs], differentiable,
                                             [t for _, t in reached_outs], allow_unused=True))
        reached["primals"] = [g is not None for g in grads]
        reached["cut_out"] = [_reaches(outs, t) for t in body.cut_params]
        reached["outputs"] = per_output_reach(outs, [p for p in primals if p.requires_grad] + body.cut_params)
        grads_iter = iter(grads)
        return outs, [next(grads_iter) if p.requires_grad else None for p in primals]

    with fake_mode:  # so that what autograd creates (zeros for an unused output's gradient) is fake too
        joint_graph = make_fx(joint)(primals, tangents)
    used = iter(reached["primals"])
    grad_mask = [wanted and next(used) for wanted in wants_grad]
    no_grad_params = frozenset(i for i, hit in enumerate(reached["cut_out"]) if not hit)
    return joint_graph, grad_mask, no_grad_params, reached["outputs"]


def template_min_cut(joint_graph: fx.GraphModule, primals: list[torch.Tensor],
                     tangents: list[torch.Tensor]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The min-cut partition a template's joint graph gets (``zerograph.plan`` estimates with the
    same): its norms marked for recompute (``unit_saved.recompute_norms``), ``PARTITION_OPTIONS``."""
    recompute_norms(joint_graph)
    with torch._functorch.config.patch(**PARTITION_OPTIONS):
        return min_cut_rematerialization_partition(joint_graph, (primals, tangents), num_fwd_outputs=len(tangents))


def _partition(joint_graph: fx.GraphModule, primals: list[torch.Tensor], tangents: list[torch.Tensor],
               flat_index: int | None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs of ``template_min_cut``, each saved storage handed over
    once (``unit_saved``); with a flat shard (primal ``flat_index``), its cuts recomputed in
    backward and sunk to their first uses in forward."""
    if flat_index is not None:
        _recompute_cut_out(joint_graph, flat_index)
    fwd, bwd = template_min_cut(joint_graph, primals, tangents)
    # the partitioner prices a saved view by its own size: hand each saved storage over once
    rebase_saved_views(fwd, bwd, len(tangents))
    if flat_index is not None:
        _sink_cut_out(fwd, flat_index)
    return fwd, bwd


def _template(kind: TracedKind, metas: tuple[TensorMeta, ...], fwd: fx.GraphModule, bwd: fx.GraphModule,
              fake_mode: FakeTensorMode, primals: list[torch.Tensor], tangents: list[torch.Tensor],
              grad_mask: list[bool], no_grad_params: frozenset[int]) -> UnitTemplate:
    """The partitioned graphs made a custom op's (no output aliasing an input or another output),
    lowered, and registered as a ``UnitTemplate``."""
    n_outputs = len(tangents)
    backward_sources, saved_primals, saved_outputs = _own_outputs(fwd, n_outputs)
    _own_gradients(bwd)
    template_id = registry.next_template_id()
    outputs = fwd.graph.output_node().args[0]
    bwd_inputs = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    assert len(bwd_inputs) == len(backward_sources) + n_outputs, (len(bwd_inputs), len(backward_sources))
    output_metas = [_meta(n.meta["val"]) for n in outputs]
    grad_metas = [_meta(primals[i]) for i, wanted in enumerate(grad_mask) if wanted]
    saved_values = [outputs[i] for i in saved_outputs]
    run_forward, run_backward = _lower(kind.lowering, fwd, bwd, fake_mode, primals, saved_values, backward_sources,
                                       saved_primals, tangents)
    template = UnitTemplate(template_id, kind.kind, metas, n_outputs, output_metas, saved_primals, grad_mask,
                            grad_metas, fwd, bwd, backward_sources, run_forward, run_backward, no_grad_params)
    template.saved_outputs = saved_outputs
    registry.register_template_as(template_id, template)
    return template


def _reaches(outs: Sequence[torch.Tensor], tensor: torch.Tensor) -> bool:
    """Whether autograd reaches ``tensor`` from ``outs``: its gradient is not ``None``."""
    if tensor.grad_fn is None:
        return False
    seen, stack = set(), [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is tensor.grad_fn:
            return True
        if fn in seen:
            continue
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return False


def _own_outputs(fwd: fx.GraphModule, n_outputs: int) -> tuple[list[tuple[str, int]], list[int], list[int]]:
    """Rewrite the partitioned forward to return the unit's outputs, then each saved activation
    that is not one of them once, with no output aliasing a primal or an earlier output (a clone
    where one would); saved primals are left to autograd. Returns where each backward input comes
    from (``("primal", i)``: the i-th saved primal; ``("output", j)``: the j-th saved output),
    the indices of the saved primals, and the indices of the saved outputs among
    ``unit_forward``'s (``UnitTemplate.saved_outputs``: those past the unit's own, and any of its
    own outputs backward reads, such as a ``relu``'s result returned by the unit)."""
    graph = fwd.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primal_index = {n: i for i, n in enumerate(placeholders)}
    out_node = graph.output_node()
    values = list(out_node.args[0])
    user, saved = values[:n_outputs], values[n_outputs:]
    returned: list[fx.Node] = list(user)
    sources: list[tuple[str, int]] = []
    saved_primals: list[int] = []
    saved_outputs: list[int] = []
    for node in saved:
        if node in primal_index:
            if primal_index[node] not in saved_primals:
                saved_primals.append(primal_index[node])
            sources.append(("primal", saved_primals.index(primal_index[node])))
        else:
            if node not in returned:
                returned.append(node)
            if returned.index(node) not in saved_outputs:
                saved_outputs.append(returned.index(node))
            sources.append(("output", saved_outputs.index(returned.index(node))))
    out_node.args = (_unaliased(graph, returned),)
    graph.lint()
    fwd.recompile()
    return sources, saved_primals, saved_outputs


def _own_gradients(bwd: fx.GraphModule) -> None:
    """Rewrite the partitioned backward so that no gradient it returns aliases one of its inputs
    or an earlier gradient (a clone where one would): ``unit_backward``, a custom op, may not
    return a view of its input, and a block whose input gradient is the incoming gradient itself
    (``return x``, ``fc(x) + y``) would."""
    out_node = bwd.graph.output_node()
    out_node.args = (_unaliased(bwd.graph, list(out_node.args[0])),)
    bwd.graph.lint()
    bwd.recompile()


def _unaliased(graph: fx.Graph, returned: list[Any]) -> list[Any]:
    """``returned`` (a graph's outputs; ``None`` for an absent gradient) with a clone, inserted
    before the output node, in place of each tensor that shares a storage with a placeholder or
    an earlier output: a custom op's outputs must be new tensors."""
    storages = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    final = []
    with graph.inserting_before(graph.output_node()):
        for node in returned:
            if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor):
                if StorageWeakRef(node.meta["val"].untyped_storage()) in storages:
                    clone = graph.call_function(torch.ops.aten.clone.default, (node,))
                    clone.meta["val"] = node.meta["val"].clone()
                    node = clone
                storages.add(StorageWeakRef(node.meta["val"].untyped_storage()))
            final.append(node)
    return final


# what ``FlatShard.unflatten`` traces to: the cuts that make a unit's parameters out of its flat shard
_CUTTING_OPS = frozenset({torch.ops.aten.view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.clone.default,
                          torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
                          torch.ops.aten.alias.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
                          torch.ops.aten.permute.default, torch.ops.aten.expand.default,
                          torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor, operator.getitem})


def _recompute_cut_out(joint: fx.GraphModule, flat_index: int) -> None:
    """Mark the cuts of the gathered flat shard (primal ``flat_index``) into parameters, and their
    views, ``MUST_RECOMPUTE``: the partitioner then hands backward the flat primal, which the model
    graph re-gathers there (stage 3) or saves once from forward (stages 1-2), instead of saving
    the cut-out parameters as activations (at stage 3 that would keep every gathered parameter
    alive from forward to backward; at stages 1-2, a second copy of them beside the buffer)."""
    flat = [n for n in joint.graph.nodes if n.op == "placeholder"][flat_index]
    stack = [flat]
    while stack:
        for user in stack.pop().users:
            if user.target in _CUTTING_OPS and user.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
                user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                stack.append(user)


def _sink_cut_out(fwd: fx.GraphModule, flat_index: int) -> None:
    """Move each cut of the gathered flat shard (primal ``flat_index``) down to just before its
    first use in the partitioned forward. The trace cuts every parameter out at the top of the
    body (``FlatShard.unflatten``), and a cut where ranks' rows interleave is a copy, so the
    unit would be held twice through its forward (the flat buffer and every copy); cut at
    their uses, the copies live one parameter at a time. Same ops, same values."""
    flat = [n for n in fwd.graph.nodes if n.op == "placeholder"][flat_index]
    cuts, stack = set(), [flat]
    while stack:
        for user in stack.pop().users:
            if user.target in _CUTTING_OPS and user not in cuts:
                cuts.add(user)
                stack.append(user)
    if cuts:
        sink_to_first_use([n for n in fwd.graph.nodes if n in cuts])
        fwd.recompile()


def _slot_name(module: nn.Module, slot: tuple[nn.Module, str]) -> str:
    """A parameter slot's name inside its unit (``attn.proj.weight``)."""
    paths = {id(m): path for path, m in module.named_modules()}
    return f"{paths[id(slot[0])]}.{slot[1]}".lstrip(".")


def _meta(t: torch.Tensor) -> TensorMeta:
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _lower(lowering: str, fwd: fx.GraphModule, bwd: fx.GraphModule, fake_mode: FakeTensorMode,
           primals: list[torch.Tensor], saved_outputs: Sequence[fx.Node], backward_sources: list[tuple[str, int]],
           saved_primals: list[int], tangents: list[torch.Tensor]) -> tuple[Callable, Callable]:
    if lowering != "inductor":
        return fwd, bwd
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    with fake_mode:
        fwd_inputs = [p.detach() for p in primals]
        saved_values = [n.meta["val"] for n in saved_outputs]
        bwd_inputs = [fwd_inputs[saved_primals[i]] if s == "primal" else saved_values[i]
                      for s, i in backward_sources] + list(tangents)
        lowered = []
        for gm, inputs, backward in ((fwd, fwd_inputs, False), (bwd, bwd_inputs, True)):
            decomposed = make_fx(fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*inputs)
            with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):  # where the cache finds the ShapeEnv
                compiled = compile_fx_inner(decomposed, inputs, is_backward=backward)
            lowered.append(_unboxed(compiled))
    return lowered[0], lowered[1]


def _unboxed(compiled: Callable) -> Callable:
    def call(*args: torch.Tensor) -> Any:
        return compiled(list(args))

    return call
