"""The graph markers capture leaves for the passes to expand, and the ops the passes emit for
gradient accumulation without synchronisation.

``zerograph::unshard(shard, key, grad_mode)`` stands for "the full parameter ``key``" (in its
``param_dtype``); its autograd backward is ``zerograph::reduce_grad(grad, key, grad_mode)``, "this
rank's shard of the gradient averaged over ranks" (in the shard's own dtype). ``grad_mode``
(``sharding.GRAD_MODES``): reduce (``"sync"``), keep the full gradient in the runtime's buffer
(``"accumulate"``), or add that buffer and reduce the sum (``"flush"``). In a captured graph the
stage's passes replace the markers by functional collectives (or by nothing at stage 0 / world
size 1); in a frame that runs eagerly (a graph break) their real implementations run the
collective directly, so results are right either way. No output aliases its input.

``accumulate_unsynced`` and ``take_unsynced`` are what ``insert_reduce_scatter`` emits for the two
accumulation modes: the runtime owns the full-size buffers, the graph only calls these ops.

``unit_forward(kind, primals)`` and ``unit_backward(template, ...)`` call one traced unit
(``templates/kinds.py``): its output followed by what its backward needs, from its activations and
parameters; until the partition the graphs hold ``unit_call`` / ``unit_call_backward`` instead
([Note: a unit is one node until the partition], below).

``shard_activation`` and ``gather_activation`` are what ``activation_partition`` emits for
partitioned activations (ZeRO-R P_a, arXiv 1910.02054 section 6.1): forward keeps this rank's
1/M of a saved activation, backward all-gathers it back over the activation group (M ranks).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.distributed_c10d import _resolve_process_group

from . import registry
from .vocab import GRAD_SYNC, all_gather_single


@torch.library.custom_op("zerograph::unshard", mutates_args=())
def unshard(shard: torch.Tensor, key: int, grad_mode: str = GRAD_SYNC) -> torch.Tensor:
    """Full parameter from this rank's shard. ``shard``: (local_rows, *rest) in the parameter's dtype
    -> ``layout.shape`` in ``layout.param_dtype``."""
    return registry.runtime_of(key).eager.unshard(shard, key)


@unshard.register_fake
def _unshard_fake(shard: torch.Tensor, key: int, grad_mode: str = GRAD_SYNC) -> torch.Tensor:
    layout = registry.layout_of(key)
    return shard.new_empty(layout.shape, dtype=layout.param_dtype)


@torch.library.custom_op("zerograph::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, key: int, grad_mode: str = GRAD_SYNC) -> torch.Tensor:
    """This rank's shard of the rank-averaged gradient. ``grad``: full shape in ``param_dtype`` ->
    (local_rows, *rest) in the parameter's dtype (zeros under ``"accumulate"``)."""
    return registry.runtime_of(key).reduce_grad(grad, key, grad_mode)


@reduce_grad.register_fake
def _reduce_grad_fake(grad: torch.Tensor, key: int, grad_mode: str = GRAD_SYNC) -> torch.Tensor:
    return grad.new_empty(registry.runtime_of(key).local_shape(key), dtype=registry.layout_of(key).dtype)


def _unshard_backward(ctx, grad: torch.Tensor | None):
    if grad is None:  # the full parameter was read, but nothing the loss depends on used it
        return None, None, None
    return reduce_grad(grad.contiguous(), ctx.key, ctx.grad_mode), None, None


def _unshard_setup(ctx, inputs, output) -> None:
    ctx.key = inputs[1]
    ctx.grad_mode = inputs[2] if len(inputs) > 2 else GRAD_SYNC
    # autograd runs this backward for every read parameter, with an undefined gradient where the
    # read reached no loss (a unit template's None); materialized, that would be a zero gradient
    # reduced and handed to the optimizer (AdamW would decay it), where eager leaves .grad None
    ctx.set_materialize_grads(False)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("zerograph::accumulate_unsynced", mutates_args=())
def accumulate_unsynced(grad: torch.Tensor, key: int) -> torch.Tensor:
    """Add a full gradient to the runtime's unsynced buffer of ``key`` (in ``reduce_dtype``); no
    collective. Returns zeros of this rank's shard shape in the parameter's dtype, the shard's
    gradient for this micro-batch (its share arrives when the buffer is reduced)."""
    return registry.runtime_of(key).grad_buffers.accumulate(grad, key)


@accumulate_unsynced.register_fake
def _accumulate_unsynced_fake(grad: torch.Tensor, key: int) -> torch.Tensor:
    return grad.new_empty(registry.runtime_of(key).local_shape(key), dtype=registry.layout_of(key).dtype)


@torch.library.custom_op("zerograph::take_unsynced", mutates_args=())
def take_unsynced(grad: torch.Tensor, key: int) -> torch.Tensor:
    """``grad`` (full shape) plus the unsynced buffer of ``key``, in ``reduce_dtype``; empties the
    buffer. Without a buffer (the parameter was unused while unsynced) a copy of ``grad``."""
    return registry.runtime_of(key).grad_buffers.take(grad, key)


@take_unsynced.register_fake
def _take_unsynced_fake(grad: torch.Tensor, key: int) -> torch.Tensor:
    return grad.new_empty(grad.shape, dtype=registry.layout_of(key).reduce_dtype)


def activation_chunk(numel: int, group_size: int) -> int:
    """Elements of each rank's piece of a partitioned activation of ``numel`` elements (the last
    piece is zero-padded, as the all-gather needs equal pieces)."""
    return -(-numel // group_size)


@torch.library.custom_op("zerograph::shard_activation", mutates_args=())
def shard_activation(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """This rank's piece of ``x`` (contiguous, any shape and dtype), as a new 1-D tensor of
    ``activation_chunk(x.numel(), group_size)`` elements: elements ``[r * chunk, (r + 1) * chunk)``
    of ``x`` flattened, r = this rank in the group named ``group_name``, zero-padded."""
    rank = dist.get_rank(_resolve_process_group(group_name))
    chunk = activation_chunk(x.numel(), group_size)
    piece = x.reshape(-1)[rank * chunk:(rank + 1) * chunk]
    out = x.new_zeros(chunk)
    out[:piece.numel()].copy_(piece)
    return out


@shard_activation.register_fake
def _shard_activation_fake(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    return x.new_empty(activation_chunk(x.numel(), group_size))


@torch.library.custom_op("zerograph::gather_activation", mutates_args=())
def gather_activation(piece: torch.Tensor, shape: Sequence[int], group_name: str, group_size: int) -> torch.Tensor:
    """The full activation back from every rank's ``piece`` (1-D, ``chunk`` elements): an
    all-gather over the group named ``group_name`` (its timeout applies), then the first
    ``prod(shape)`` elements as a contiguous tensor of ``shape``.

    Raises:
        torch.distributed.DistBackendError: a peer of the group failed or timed out.
    """
    full = piece.new_empty(group_size * piece.numel())
    all_gather_single(full, piece, group=_resolve_process_group(group_name))
    return full[:math.prod(shape)].view(list(shape))


@gather_activation.register_fake
def _gather_activation_fake(piece: torch.Tensor, shape: Sequence[int], group_name: str,
                            group_size: int) -> torch.Tensor:
    return piece.new_empty(list(shape))


def _empty_like_meta(like: torch.Tensor, metas: Sequence[tuple]) -> list[torch.Tensor]:
    """New tensors of ``metas`` (``(shape, stride, dtype)`` each) on ``like``'s device, for a fake
    implementation. With fake inputs they are made as meta tensors and wrapped straight into
    ``like``'s fake mode, which is what that mode's own ``empty_strided`` returns, without its
    dispatch: a unit op's outputs (16 for a GPT block) are made four times per unit in a first
    step (Dynamo's trace, AOTAutograd's metadata pass twice, its joint trace), so the dispatch's
    cost per tensor is paid many times over in every compile."""
    if not isinstance(like, FakeTensor):
        return [torch.empty_strided(shape, stride, dtype=dtype, device=like.device) for shape, stride, dtype in metas]
    mode, device = like.fake_mode, like.device
    with unset_fake_temporarily():
        made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in metas]
    return [mode.fake_tensor_converter.from_meta_and_device(mode, tensor, device) for tensor in made]


@torch.library.custom_op("zerograph::unit_forward", mutates_args=())
def unit_forward(kind: int, mode: int, arg_grads: int, primals: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    """One unit's forward through its kind's template. ``mode``: the unit's submodules' training
    flags as bits (submodule ``i`` in ``modules()`` order -> bit ``i``); ``arg_grads``: which of
    the unit's tensor arguments need a gradient, as bits (argument ``i`` -> bit ``i``; the
    template differentiates only those, so an input that needs none costs no backward matmul and
    no re-gather of the weights only its gradient would read); ``primals``: the unit's tensor
    arguments (every tensor of its positional and keyword arguments, in call order), then its full
    parameters and buffers (template order); ``call``: the call's structure around those tensors
    (``unit_calls.call_key``) -> the unit's output tensors (``UnitTemplate.n_outputs``), then the
    activations its backward needs (new tensors: none aliases an input or another output)."""
    return registry.unit_template(kind, mode, arg_grads, primals, call).forward(primals)


@unit_forward.register_fake
def _unit_forward_fake(kind: int, mode: int, arg_grads: int, primals: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    return _empty_like_meta(primals[0], registry.unit_template(kind, mode, arg_grads, primals, call).output_metas)


@torch.library.custom_op("zerograph::unit_backward", mutates_args=())
def unit_backward(template: int, primals: list[torch.Tensor], saved: list[torch.Tensor],
                  tangents: list[torch.Tensor]) -> list[torch.Tensor]:
    """One unit's backward through template ``template``. ``primals``: the inputs its backward
    reads (``UnitTemplate.saved_primals``); ``saved``: the ``unit_forward`` outputs it reads
    (``UnitTemplate.saved_outputs``); ``tangents``: the gradient of each unit output (zeros where none reached it) -> the
    gradient of each differentiable primal (``UnitTemplate.grad_mask``), in primal order."""
    return registry.template_of(template).backward(primals, saved, tangents)


@unit_backward.register_fake
def _unit_backward_fake(template: int, primals: list[torch.Tensor], saved: list[torch.Tensor],
                        tangents: list[torch.Tensor]) -> list[torch.Tensor]:
    return _empty_like_meta(tangents[0], registry.template_of(template).grad_metas)


def _unit_forward_setup(ctx, inputs, output) -> None:
    kind, mode, arg_grads, primals, call = inputs
    template = registry.unit_template(kind, mode, arg_grads, primals, call)
    ctx.template, ctx.template_object = template.id, template  # the object: alive until backward
    ctx.n_primals, ctx.grad_mask, ctx.output_metas = len(primals), template.grad_mask, template.output_metas
    ctx.n_needed = len(template.saved_primals)
    ctx.save_for_backward(*[primals[i] for i in template.saved_primals], *[output[i] for i in template.saved_outputs])
    # the saved activations carry no gradient of their own: said so, AOTAutograd's joint trace
    # skips two detach nodes per saved output
    ctx.mark_non_differentiable(*output[template.n_outputs:], *_integral(output[:template.n_outputs]))
    # and autograd hands their backward None instead of a zero tensor each: AOTAutograd's joint
    # trace would make a zero per such output, dead code traced only to be dropped later
    ctx.set_materialize_grads(False)
    ctx.n_outputs = template.n_outputs


def _unit_forward_backward(ctx, grads: list[torch.Tensor | None]):
    if all(g is None for g in grads[:ctx.n_outputs]):  # no gradient reached the unit's outputs
        return None, None, None, [None] * ctx.n_primals, None
    values = ctx.saved_tensors
    needed, saved = list(values[:ctx.n_needed]), list(values[ctx.n_needed:])
    tangents = _tangents(grads[:ctx.n_outputs], ctx.output_metas)
    grad_iter = iter(unit_backward(ctx.template, needed, saved, tangents))
    return None, None, None, [next(grad_iter) if differentiable else None for differentiable in ctx.grad_mask], None


def _integral(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of a dtype with no gradient (an index, a mask): non-differentiable, as in eager."""
    return [o for o in outputs if not (o.dtype.is_floating_point or o.dtype.is_complex)]


def _tangents(grads: Sequence[torch.Tensor | None], metas: Sequence[tuple]) -> list[torch.Tensor]:
    """The gradient of each unit output as the template's backward takes it: contiguous, and
    zeros of the output's shape and dtype where autograd brought none (an output the loss does not
    read, or one of an integral dtype)."""
    device = next(g.device for g in grads if g is not None)
    return [g.contiguous() if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, _, dtype) in zip(grads, metas)]


unit_forward.register_autograd(_unit_forward_backward, setup_context=_unit_forward_setup)


# [Note: a unit is one node until the partition]
# A templated unit is traced, partitioned and lowered once per kind of unit and input shapes, and
# every unit of the kind calls it. Its op ``unit_forward`` returns the unit's output and every
# activation its backward reads (16 values for a GPT block, each a ``getitem`` node in every trace),
# and Dynamo, AOTAutograd and the min-cut partitioner each pay per graph value. So until the
# partition the model's graphs hold ``unit_call`` (the unit's output and a token only) and its
# backward ``unit_call_backward``: one node with one output per unit through those traces.
# ``passes/expand_unit_calls`` then puts ``unit_forward`` / ``unit_backward`` in their place in the
# partitioned forward and backward, once, reading which call a backward belongs to off the token.


@torch.library.custom_op("zerograph::unit_call", mutates_args=())
def unit_call(kind: int, mode: int, arg_grads: int, primals: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    """One unit's forward as the model's graphs carry it until the partition: ``unit_forward``'s
    arguments (same meaning) -> the unit's outputs (new tensors, the shapes and dtypes of the
    template's first ``n_outputs`` outputs), then a token (an empty tensor of its own that only the
    call's backward reads: it pairs the two, ``passes/expand_unit_calls``). The partitioned graphs
    hold ``unit_forward`` in its place; run as it is, it is ``unit_forward``'s outputs and a token."""
    template = registry.unit_template(kind, mode, arg_grads, primals, call)
    outputs = template.forward(primals)[:template.n_outputs]
    return [*outputs, outputs[0].new_empty(0)]


@unit_call.register_fake
def _unit_call_fake(kind: int, mode: int, arg_grads: int, primals: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    template = registry.unit_template(kind, mode, arg_grads, primals, call)
    metas = template.output_metas[:template.n_outputs]
    return _empty_like_meta(primals[0], [*metas, ((0,), (1,), metas[0][2])])


@torch.library.custom_op("zerograph::unit_call_backward", mutates_args=())
def unit_call_backward(template: int, primals: list[torch.Tensor], token: torch.Tensor,
                       tangents: list[torch.Tensor]) -> list[torch.Tensor]:
    """``unit_call``'s backward until the partition: ``primals`` the inputs template ``template``'s
    backward reads (``UnitTemplate.saved_primals``), ``token`` the token of the ``unit_call`` it
    is the backward of, ``tangents`` the gradient of each of that call's outputs (contiguous;
    zeros where none reached it) -> the gradient of each differentiable primal
    (``UnitTemplate.grad_mask``), in primal order, as ``unit_backward`` returns them.

    Raises ``RuntimeError`` if run: every partitioned backward holds ``unit_backward`` in its place."""
    raise RuntimeError("zerograph::unit_call_backward ran; expand_unit_calls should have replaced it with "
                       "zerograph::unit_backward in the partitioned backward")


@unit_call_backward.register_fake
def _unit_call_backward_fake(template: int, primals: list[torch.Tensor], token: torch.Tensor,
                             tangents: list[torch.Tensor]) -> list[torch.Tensor]:
    return _empty_like_meta(tangents[0], registry.template_of(template).grad_metas)


def _unit_call_setup(ctx, inputs, output) -> None:
    kind, mode, arg_grads, primals, call = inputs
    template = registry.unit_template(kind, mode, arg_grads, primals, call)
    ctx.template, ctx.grad_mask = template.id, template.grad_mask
    ctx.output_metas = template.output_metas[:template.n_outputs]
    # the token, not the output, names the call: user code may write the output in place
    # (x = block(x); x.mul_(2)), and then the output backward sees is another value
    ctx.save_for_backward(*[primals[i] for i in template.saved_primals], output[-1])
    ctx.mark_non_differentiable(output[-1], *_integral(output[:-1]))
    ctx.set_materialize_grads(False)


def _unit_call_backward_formula(ctx, grads: list[torch.Tensor | None]):
    grads = grads[:len(ctx.output_metas)]
    if all(g is None for g in grads):  # no gradient reached the unit's outputs
        return None, None, None, [None] * len(ctx.grad_mask), None
    if any(g is None for g in grads):  # some output unread in the graph: the kind may have to run inline
        template = registry.template_of(ctx.template)
        registry.unit_kind(template.kind).check_read_in_part(template, [g is not None for g in grads])
    *primals, token = ctx.saved_tensors
    grad_iter = iter(unit_call_backward(ctx.template, primals, token, _tangents(grads, ctx.output_metas)))
    return None, None, None, [next(grad_iter) if differentiable else None for differentiable in ctx.grad_mask], None


unit_call.register_autograd(_unit_call_backward_formula, setup_context=_unit_call_setup)


def grad_mode_of(marker: fx.Node) -> str:
    """A marker node's ``grad_mode`` (traced graphs may leave out an argument at its default)."""
    if len(marker.args) > 2:
        return marker.args[2]
    return marker.kwargs.get("grad_mode", GRAD_SYNC)


UNSHARD = torch.ops.zerograph.unshard.default
REDUCE_GRAD = torch.ops.zerograph.reduce_grad.default
ACCUMULATE_UNSYNCED = torch.ops.zerograph.accumulate_unsynced.default
TAKE_UNSYNCED = torch.ops.zerograph.take_unsynced.default
SHARD_ACTIVATION = torch.ops.zerograph.shard_activation.default
GATHER_ACTIVATION = torch.ops.zerograph.gather_activation.default
UNIT_FORWARD = torch.ops.zerograph.unit_forward.default
UNIT_BACKWARD = torch.ops.zerograph.unit_backward.default
UNIT_CALL = torch.ops.zerograph.unit_call.default
UNIT_CALL_BACKWARD = torch.ops.zerograph.unit_call_backward.default
