"""A unit's parameter shards in one flat buffer: one graph input and one marker per unit.

With unit templates (the default), each templated unit's shards are stored back to back in one 1-D
buffer, this rank's *flat shard*: parameter ``i`` at element offset ``offsets[i]``, its padded chunk
of ``chunk_rows * row_numel`` elements, of which the first ``local_rows * row_numel`` hold its rows
(the rest is padding, zero). That is the all-gather's copy-in ([Note: the copy-in layout] in
``zerograph/kernels/ops.py``), so the all-gathered flat shards, ``(N * T,)``, hold each parameter's
rows rank by rank, and ``unflatten`` cuts the full parameters out of it. At stage 0 nothing is
sharded: the buffer holds the unit's whole parameters, ``(T,)`` on every rank, and its gradient is
all-reduced whole (one bucket per unit, as DDP's flat buckets).

Contract: each parameter is still its own ``DTensor`` shard, whose local tensor is a view of the
flat shard's storage, so in-place updates (``opt.step()``, ``load_state_dict``, ``init_weights``)
reach the buffer the graph reads; the graph reads ``FlatShard.input``, made at each forward by
``ShardsAsFlat`` (an autograd ``Function`` of the shards: the buffer, no copy, forward; each
shard's gradient a view of the reduced flat gradient, backward), so the shards stay autograd's
leaves and ``AccumulateGrad``, hooks and ``.grad`` behave as without the layout. Parameters the
unit's output does not reach keep ``.grad`` ``None``; a tensor put in a parameter's slot
(``functional_call``) is read instead of the shard; a kind that cannot tell which parameters get a
gradient goes back to per-parameter shards (``restore_``). Why (compile time) and what it keeps:
docs/design.md, section "Capture", and docs/semantics.md.

Source: FSDP1's ``FlatParameter`` (one flat tensor per unit), with FSDP2's per-parameter
``DTensor`` view kept for everything outside forward.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..errors import ModelChangedError
from .sharding import FLAT_READS_ATTR, SUBSTITUTED_ATTR, ParamLayout, full_parameter


@dataclasses.dataclass(eq=False)
class FlatShard:
    """One unit's parameter shards in one flat buffer (module docstring).

    Attributes:
        layout: the flat shard as one parameter of the markers: shape ``(N * T,)``, ``chunk_rows``
            T elements on every rank, the unit's dtypes; its key is what the unit's ``unshard``
            and ``reduce_grad`` carry.
        param: this rank's flat shard, ``(T,)`` in the parameters' dtype: the buffer the shards'
            local tensors view. Not registered on any module and requires no grad: the optimizer,
            ``state_dict`` and autograd see the parameters, not it.
        shards: the unit's parameters (``DTensor`` shards), each a view of ``param``'s storage.
        layouts: their layouts, in the same order.
        offsets: element offset of each parameter's padded chunk in ``param``.
        rank: this rank in the shard group.
        no_grad: indices of the parameters the unit's output does not reach (its template
            found them, ``unit_trace.UnitTemplate.no_grad_params``): their part of the flat
            gradient is dropped and their ``.grad`` left as it is, ``None`` in a first backward, as
            eager does.
        input: what the graph reads for the unit in this forward (``open_forward``): the buffer
            as an autograd function of the shards (``ShardsAsFlat``), ``None`` between forwards.
    """

    layout: ParamLayout
    param: nn.Parameter
    shards: tuple[nn.Parameter, ...]
    layouts: tuple[ParamLayout, ...]
    offsets: tuple[int, ...]
    rank: int
    no_grad: frozenset[int] = frozenset()
    # called when a parameter of ``no_grad`` is read through the flat shard (full_parameter): its
    # kind's template did not see that read (its parent reads it, or an inline body's own trace
    # does), so whether autograd reaches it is unknown; templates/kinds.py makes the units leave the flat shard
    unreached_read: Callable[[], None] = lambda: None
    # each module that holds some of the shards, with (attribute, shard) of each (install_reads)
    slots: tuple[tuple[nn.Module, tuple[tuple[str, nn.Parameter], ...]], ...] = ()
    # the state_dict post-hooks of those modules (install_reads; removed by restore_)
    state_dict_hooks: tuple[RemovableHandle, ...] = ()
    input: torch.Tensor | None = None

    def open_forward(self) -> None:
        """Make ``input`` for a forward: with grad enabled, ``ShardsAsFlat`` of the shards (the
        graph's gradient for it reaches each shard through autograd), else the buffer itself."""
        self.input = ShardsAsFlat.apply(self, *self.shards) if torch.is_grad_enabled() else self.param

    def close_forward(self) -> None:
        """Drop ``input`` after the forward (the graph holds what its backward needs)."""
        self.input = None

    def unflatten(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The full parameters from the all-gathered flat shards. ``full``: ``(N * T,)`` ->
        one tensor of ``layout.shape`` per parameter (a copy where ranks' rows interleave)."""
        n, total = self.layout.padded_numel // self.layout.chunk_rows, self.layout.chunk_rows
        # one split, not a slice per parameter: its backward is one concatenation of the
        # gradients, where slices' would add a zero-filled (N * T,) buffer per parameter
        blocks = full.view(n, total).split([layout.shard_numel for layout in self.layouts], dim=1)
        return [_cut(block, layout) for block, layout in zip(blocks, self.layouts)]

    def full_parameter(self, index: int) -> torch.Tensor:
        """Parameter ``index`` of the unit in full, inside a zerograph forward that runs the unit
        inline (a kind that fell back from its template): the unit's one ``unshard`` marker (one
        all-gather however many parameters read it), then the cut. Reading the ``DTensor`` shards
        themselves would hand Dynamo several tensors on one storage, which it cannot fake."""
        if index in self.no_grad:  # read, yet unreached by the body as its template saw it
            self.unreached_read()
        n, total = self.layout.padded_numel // self.layout.chunk_rows, self.layout.chunk_rows
        layout, offset = self.layouts[index], self.offsets[index]
        full = full_parameter(self.input, self.layout.key).view(n, total)
        return _cut(full[:, offset : offset + layout.shard_numel], layout)

    def install_reads(self, unit: nn.Module) -> None:
        """Make every parameter attribute of ``unit``'s modules that names one of its shards read
        it through ``full_parameter`` inside forward (``sharding``'s parameter properties)."""
        index_of = {id(shard): i for i, shard in enumerate(self.shards)}
        slots = []
        for module in unit.modules():
            reads = {name: functools.partial(self.full_parameter, index_of[id(p)])
                     for name, p in module._parameters.items() if p is not None and id(p) in index_of}
            if reads:
                object.__setattr__(module, FLAT_READS_ATTR, reads)
                object.__setattr__(module, SUBSTITUTED_ATTR, frozenset())
                slots.append((module, tuple((name, module._parameters[name]) for name in reads)))
        self.slots = tuple(slots)
        self.state_dict_hooks = tuple(module.register_state_dict_post_hook(functools.partial(_copyable_values, tuple(
            name for name, _ in shards))) for module, shards in slots)

    def restore_(self) -> None:
        """Undo ``flatten_unit_`` and ``install_reads``: each parameter's local tensor gets a
        storage of its own again, with its values (the ``DTensor`` keeps its identity), and its
        module's attributes read it through its own marker. The flat buffer is no longer read."""
        # called from inside a trace (a template that failed): the copies are real tensors
        with torch.no_grad(), torch.utils._python_dispatch._disable_current_modes():
            for shard in self.shards:
                shard._local_tensor = shard._local_tensor.clone()
        for module, _ in self.slots:
            object.__delattr__(module, FLAT_READS_ATTR)
            object.__delattr__(module, SUBSTITUTED_ATTR)
        for handle in self.state_dict_hooks:
            handle.remove()
        self.slots, self.state_dict_hooks = (), ()

    def substituted(self) -> bool:
        """Whether some module slot of the unit's parameters holds another tensor than its shard
        now (``torch.func.functional_call`` and ``nn.utils.stateless`` swap them for one call);
        each module's ``SUBSTITUTED_ATTR`` is set to the names of its slots that do."""
        any_substituted = False
        for module, shards in self.slots:
            names = frozenset(name for name, shard in shards if module._parameters.get(name) is not shard)
            if names or getattr(module, SUBSTITUTED_ATTR):
                object.__setattr__(module, SUBSTITUTED_ATTR, names)
            any_substituted = any_substituted or bool(names)
        return any_substituted

    def shard_grads(self, flat_grad: torch.Tensor, needed: Sequence[bool]) -> list[DTensor | None]:
        """Each parameter's part of this rank's reduced flat gradient, ``(T,)``: a ``DTensor`` like
        the shard whose local tensor is a view of ``flat_grad`` (no copy); ``None`` where
        ``needed`` says autograd does not ask for it, and for the parameters of ``no_grad``."""
        grads: list[DTensor | None] = [None] * len(self.shards)
        for index, local in self._local_grads(flat_grad):
            if needed[index]:
                grads[index] = grad_like(self.shards[index], local)
        return grads

    def add_grad(self, flat_grad: torch.Tensor) -> None:
        """Hand this rank's flat gradient, ``(T,)``, reduced outside autograd (what a ``no_sync``
        backward held back), to the parameters as autograd would (``accumulate_grad``); nothing
        for the parameters of ``no_grad``."""
        with torch.no_grad():
            for index, local in self._local_grads(flat_grad):
                accumulate_grad(self.shards[index], local)

    def zero_parts_(self, full: torch.Tensor, keep: Sequence[bool]) -> None:
        """Zero, in place, the parts of parameters ``keep`` says no of in ``full``, the unit's full
        flat gradient (all ranks' flat shards, ``(N * T,)``)."""
        n, total = self.layout.padded_numel // self.layout.chunk_rows, self.layout.chunk_rows
        columns = full.view(n, total)
        for index, (layout, offset) in enumerate(zip(self.layouts, self.offsets)):
            if not keep[index]:
                columns[:, offset : offset + layout.shard_numel].zero_()

    def _local_grads(self, flat_grad: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """``(index, view)`` of each parameter outside ``no_grad``: its part of ``flat_grad`` in
        the shard's local shape."""
        for index, (layout, offset) in enumerate(zip(self.layouts, self.offsets)):
            if index not in self.no_grad:
                shape = layout.local_shape(self.rank)
                yield index, flat_grad[offset : offset + math.prod(shape)].view(shape)

    def check_views(self) -> bool:
        """Raise ``ModelChangedError`` when a parameter's local tensor no longer lives in the flat
        shard (its ``.data`` replaced, ``.to()`` or ``set_`` after compile): the graph would read
        values the optimizer no longer writes. Returns whether every parameter still requires
        grad (all did when flattened; the graph's guards see the flat leaf, not them, so the
        caller checks a change: ``ParameterWatch.check_trainable``)."""
        storage = self.param.untyped_storage().data_ptr()
        trainable = True
        for shard, layout in zip(self.shards, self.layouts):
            trainable = trainable and shard.requires_grad
            if shard._local_tensor.untyped_storage().data_ptr() != storage:  # to_local() costs autograd's dispatch
                raise ModelChangedError(
                    f"parameter {layout.fqn!r} no longer lives in its unit's flat shard (Config.unit_templates "
                    "stores a unit's shards in one buffer): its data was replaced after zerograph.compile "
                    "(.data =, .to(), set_). Change parameters in place (copy_ under torch.no_grad()) instead")
        return trainable


def accumulate_grad(shard: nn.Parameter, local: torch.Tensor) -> None:
    """What autograd's ``AccumulateGrad`` does for a leaf, for a ``DTensor`` shard whose reduced
    gradient reaches it outside autograd (from its unit's flat shard, or the gradients a
    ``no_sync`` backward held back): the shard's ``register_hook`` hooks run on the gradient, as a
    ``DTensor`` like the shard, each replacing it when it returns a tensor; the result becomes
    ``.grad`` (a view of ``local``: no copy) or is added to the ``.grad`` held; then its
    ``register_post_accumulate_grad_hook`` hooks run (an optimizer stepped in backward). ``local``:
    this rank's rows of the gradient, the shard's local shape and dtype."""
    grad = grad_like(shard, local)
    for hook in tuple((shard._backward_hooks or {}).values()):
        replaced = hook(grad)
        if replaced is not None:
            grad = replaced
    with torch.no_grad():
        if shard.grad is None:
            shard.grad = grad
        elif isinstance(grad, DTensor):  # local to local: DTensor's dispatch of add_ costs more
            shard.grad.to_local().add_(grad.to_local())
        else:
            shard.grad.add_(grad)
    for hook in tuple((shard._post_accumulate_grad_hooks or {}).values()):
        hook(shard)


def grad_like(shard: DTensor, local: torch.Tensor) -> DTensor:
    """A gradient for ``shard``: ``local`` (this rank's rows, the shard's local shape and dtype)
    as a ``DTensor`` of the shard's own spec (mesh, placements, global shape and stride). Built
    with ``DTensor``'s constructor, as FSDP2 builds its sharded gradients: ``from_local`` would
    add an autograd function and a new spec per parameter, a cost paid on every step."""
    return DTensor(local, shard._spec, requires_grad=False)


def _copyable_values(names: tuple[str, ...], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     local_metadata: dict) -> None:
    """``nn.Module`` state_dict post-hook of a module holding flat-shard parameters: each of their
    entries, ``param.detach()``, becomes the same ``DTensor`` (same local tensor: an alias of the
    parameter, as in eager) in a wrapper at storage offset 0, so that ``copy.deepcopy`` of the state
    dict copies it. ``DTensor``'s constructor gives its wrapper the local tensor's storage offset,
    and ``Tensor.__deepcopy__`` takes a wrapper whose ``data_ptr()`` is not 0 for one with a storage
    of its own: copying that storage raised "Attempted to call copy_() on an invalid python storage"
    for every parameter but the first of a flat shard. (``keep_vars=True`` entries, the parameters
    themselves, keep the wrapper they were built with, at offset 0, and are left as they are.)"""
    for name in names:
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor) and value.storage_offset() != 0:
            state_dict[prefix + name] = _offset_free_wrapper(value)


def _offset_free_wrapper(value: DTensor) -> DTensor:
    """``value``'s local tensor and spec in a new ``DTensor`` wrapper at storage offset 0, as
    ``DTensor.__new__`` built it before it took the local tensor's (``_make_wrapper_subclass``)."""
    wrapper = torch.Tensor._make_wrapper_subclass(
        DTensor, value.shape, strides=value.stride(), storage_offset=0, dtype=value.dtype, device=value.device,
        layout=value.layout, requires_grad=value.requires_grad)
    wrapper._spec, wrapper._local_tensor = value._spec, value._local_tensor
    return wrapper


def flatten_unit_(unit: int, name: str, shards: Sequence[nn.Parameter], layouts: Sequence[ParamLayout],
                  rank: int, key: int) -> FlatShard:
    """Move the shards of unit ``unit`` (named ``name``) into one flat buffer, in place: each
    ``DTensor``'s local tensor becomes a view of it, with the same values. ``shards`` and
    ``layouts`` in the unit's parameter order; every layout sharded or every one whole, of one dtype, ``param_dtype``
    and ``reduce_dtype`` (``flattenable``). ``key``: the flat shard's marker key."""
    first = layouts[0]
    offsets, total = [], 0
    for layout in layouts:
        offsets.append(total)
        total += layout.shard_numel
    local0 = shards[0].to_local()
    flat = torch.zeros(total, dtype=first.dtype, device=local0.device)
    with torch.no_grad():
        for shard, layout, offset in zip(shards, layouts, offsets):
            local = shard._local_tensor  # the DTensor's own (to_local() may hand out a fresh view)
            view = flat[offset : offset + local.numel()].view(local.shape)
            view.copy_(local)
            # the DTensor keeps its identity (the optimizer holds it); its local tensor becomes a view
            # of the buffer (a view, with its base, so that fake tensors of it alias as the real ones do)
            shard._local_tensor = view
    world_size = first.world_size
    full = world_size * total if first.sharded else total  # stage 0: every rank holds the whole buffer
    layout = ParamLayout(key, f"{name}.<flat shard>" if name else "<flat shard>", unit, (full,),
                         first.dtype, world_size, first.sharded, (total,) * world_size, total, first.param_dtype,
                         first.reduce_dtype)
    return FlatShard(layout, flat, tuple(shards), tuple(layouts), tuple(offsets), rank)


class ShardsAsFlat(torch.autograd.Function):
    """A unit's flat buffer as an autograd function of its parameter shards: forward returns the
    buffer (``FlatShard.param`` detached: the same storage, no copy); backward cuts the gradient
    the graph computed for it, ``(T,)`` (this rank's reduced rows), into each shard's gradient
    (``FlatShard.shard_grads``). The shards stay autograd's leaves, so ``AccumulateGrad`` runs for
    each as it does without flat shards. Mirrors FSDP1's ``FlatParameter``, whose original
    parameters are views of it, with the edges turned round: here the shards are the leaves."""

    @staticmethod
    def forward(ctx: Any, flat: FlatShard, *shards: nn.Parameter) -> torch.Tensor:
        ctx.flat = flat
        ctx.set_materialize_grads(False)  # no gradient reached the unit: every .grad stays as it is
        return flat.param.detach()

    @staticmethod
    def backward(ctx: Any, flat_grad: torch.Tensor | None) -> tuple[DTensor | None, ...]:
        needed = ctx.needs_input_grad[1:]
        if flat_grad is None:
            return (None,) * (1 + len(needed))
        return (None, *ctx.flat.shard_grads(flat_grad, needed))


def flattenable(shards: Sequence[nn.Parameter], layouts: Sequence[ParamLayout], unit: int) -> str | None:
    """Why the unit's shards cannot share one flat buffer, or ``None`` when they can: every
    parameter sharded (stages 1-3) or every one whole (stage 0), trainable, owned by this unit, of one dtype, ``param_dtype`` and
    ``reduce_dtype``, and a local tensor of its own (contiguous, not shared)."""
    if not layouts:
        return "it has no parameters"
    first = layouts[0]
    for shard, layout in zip(shards, layouts):
        if layout.unit != unit:
            return f"parameter {layout.fqn!r} belongs to another unit (tied)"
        if layout.sharded != first.sharded:  # a 0-d parameter is replicated at every stage
            return f"parameter {layout.fqn!r} is {'' if layout.sharded else 'not '}sharded, unlike {first.fqn!r}"
        if not shard.requires_grad:
            return f"parameter {layout.fqn!r} is frozen"
        if (layout.dtype, layout.param_dtype, layout.reduce_dtype) != (first.dtype, first.param_dtype,
                                                                       first.reduce_dtype):
            return f"parameter {layout.fqn!r} has dtypes of its own"
        if not shard.to_local().is_contiguous():
            return f"parameter {layout.fqn!r} has a non-contiguous shard"
    return None


def _cut(block: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """One parameter in full from its column block of the gathered flat shards, ``(N,
    chunk_rows * row_numel)``: the ranks' chunks stacked, then the padding rows dropped (no slice
    where there is none, so no zero-filled ``slice_backward`` in the gradient). An unsharded
    layout's block, ``(1, numel)``, is the parameter itself."""
    if not layout.sharded:  # stage 0 (or a 0-d parameter): the block is the whole parameter
        return block.reshape(layout.shape)
    padded = block.reshape(layout.world_size * layout.chunk_rows, *layout.shape[1:])
    return padded if padded.shape[0] == layout.shape[0] else padded[: layout.shape[0]]
