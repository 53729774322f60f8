"""What a compiled model gains: its ``forward`` through the captured graphs, the fallbacks when
a unit template cannot serve a trace, and FSDP2's / DDP's gradient-sync switches.

``compiled_class(cls)`` is the class ``zerograph.compile`` gives the model: ``cls`` with these
methods (FSDP2's ``fully_shard`` swaps the class the same way).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError, TorchRuntimeError
from torch.utils._pytree import tree_map_only

from ..errors import DynamicShapeTrace, SyncedForHooksWarning, TemplateUnavailable, ZeroGraphError
from ..graph.vocab import GRAD_ACCUMULATE, GRAD_FLUSH, GRAD_SYNC
from ..io import init, loading
from ..policies import MixedPrecisionPolicy
from ..runtime.state import STATE_ATTR, ZeroGraphState, state_of
from ..shard.sharding import forget_shape_history
from ..shard.trace_state import TRACE
from ..templates import parent_islands
from ..templates.kinds import refresh_unit_modes

log = logging.getLogger(__name__)


def compiled_class(cls: type) -> type:
    """``cls`` with the compiled model's ``forward``, ``set_requires_gradient_sync``, ``no_sync``
    and ``load_state_dict`` (full tensors or shards, ``loading.load_state_dict``), and, where
    ``cls`` defines one, its ``init_weights`` run unit by unit on full tensors
    (``init.init_whole_model``: torchtitan's whole-model init); same name."""
    methods = {"forward": compiled_forward, "set_requires_gradient_sync": set_requires_gradient_sync,
               "no_sync": no_sync, "load_state_dict": loading.load_state_dict, "__deepcopy__": _refuse_deepcopy}
    if callable(getattr(cls, "init_weights", None)):
        methods["init_weights"] = _init_unit_by_unit(cls.init_weights)
    return type(cls.__name__, (cls,), methods)


def _init_unit_by_unit(init_weights: Callable[..., Any]) -> Callable[..., Any]:
    """The model's own ``init_weights`` (torchtitan's: the root initialises every block through its
    attributes), run by ``init.init_whole_model``: called directly, on shards, every rank drew the
    same values for its rows."""

    @functools.wraps(init_weights)
    def compiled_init_weights(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return init.init_whole_model(self, lambda: init_weights(self, *args, **kwargs))

    return compiled_init_weights


def _refuse_deepcopy(self: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a compiled model (an EMA copy, ``timm``'s ``ModelEmaV2``): refused by
    name, where pickling its process group failed with ``cannot pickle 'ProcessGroup' object``."""
    raise TypeError(f"zerograph: a compiled model ({type(self).__name__}) cannot be deep-copied: it holds this rank's "
                    "shards, process groups and compiled graphs. Copy the model before zerograph.compile (and "
                    "compile the copy too, or keep it on one rank), or keep an average of the full parameters "
                    "(param.full_tensor()) yourself")


def compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The compiled model's ``forward``: checks that its parameters are as compiled (and, built on
    meta, given values), then runs the captured forward with the markers switched on, casting the
    inputs as ``Config.mixed_precision`` asks. zerograph's own errors raised inside Dynamo reach
    the caller unwrapped."""
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
    for kind in state.unit_kinds:  # a unit changed where Dynamo's guards cannot see: its kind runs inline
        kind.check_unchanged()
    refresh_unit_modes(state.unit_kinds)
    state.runtime.start_forward()
    mode = grad_mode_for(state, self)
    flats = tuple(state.runtime.flat_shards.values())
    # the markers on, and the mode the trace reads (and guards on)
    with TRACE.scope(gathering=True, substituted=substituted, grad_mode=mode,
                     breaks_at_forward_start=parent_islands.data_dependent_breaks()):
        try:
            for flat in flats:  # each unit's graph input, an autograd function of its shards
                flat.open_forward()
            state.runtime.grad_buffers.prepare_backward(mode)
            args, kwargs = _cast_inputs(state.config.mixed_precision, args, kwargs)
            out = _run_falling_back(state, self, args, kwargs)
            state.runtime.grad_buffers.flush_leftovers_after_backward(out, mode)
            return out
        except (BackendCompilerFailed, TorchRuntimeError, InternalTorchDynamoError) as exc:
            # zerograph's own errors raised while Dynamo compiled (a changed requires_grad, a broken
            # pass, a unit template that cannot be traced) reach the user as themselves, not wrapped
            # in Dynamo's compiler or fake-tensor error
            cause = own_error(exc)
            if cause is not None:
                raise cause from None
            raise
        finally:
            for flat in flats:
                flat.close_forward()


def grad_mode_for(state: ZeroGraphState, model: nn.Module) -> str:
    """What this forward's backward does with its gradients (``sharding.GRAD_MODES``): the
    runtime's mode, except that with gradient sync off it reduces anyway while a trainable
    parameter has a tensor hook (``register_hook``) or a ``register_post_accumulate_grad_hook``
    hook, and warns (``SyncedForHooksWarning``, naming the parameters).

    Why: eager runs a tensor hook on each micro-batch's gradient before it is accumulated, and a
    post-accumulate-grad hook after each backward on the sum so far, which it may edit in place
    (scale, clip, step an optimizer in backward). An unsynced backward has neither gradient (each
    rank holds its own micro-batch's full gradient; the shard receives zeros), so a hook would
    see zeros, a nonlinear one (a clamp) would later see the sum instead of each part, and an
    in-place edit of ``.grad`` would be lost. Synced, each backward hands the hooks the
    rank-averaged gradient of its micro-batch and adds it to ``.grad`` as eager does, so they see
    what eager's see; the micro-batches then cost one reduction each. (DDP runs the hooks on each
    rank's local gradient, which matches eager only for hooks linear in the gradient; FSDP2 runs
    none on an unsynced backward.)"""
    mode = state.runtime.grad_buffers.grad_mode()
    if mode != GRAD_ACCUMULATE:
        return mode
    hooked = [name for name, param in model.named_parameters()
              if param.requires_grad and (param._backward_hooks or param._post_accumulate_grad_hooks)]
    if not hooked:
        return mode
    warnings.warn(
        f"zerograph: gradient sync is off, yet this backward reduces its gradients: parameters "
        f"{', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} have tensor hooks (register_hook or "
        "register_post_accumulate_grad_hook), which must see each micro-batch's gradient and the sum so far, "
        "as in eager; remove the hooks while accumulating to skip the reductions", SyncedForHooksWarning,
        stacklevel=3)
    return GRAD_FLUSH if state.runtime.grad_buffers.unsynced_bytes() else GRAD_SYNC


class NextTrace(enum.Enum):
    """How the compiled forward traces again after a unit template could not serve a trace."""

    # a kind of unit now runs inline (``UnitKind.fall_back`` set its flags, which the graphs guard on)
    SAME = enum.auto()
    # a template met a dynamic shape: this forward's trace again with every templated unit inline
    EVERY_UNIT_INLINE = enum.auto()


@dataclasses.dataclass(frozen=True)
class Traced:
    """A trace attempt that compiled (or found its graph) and ran: the forward's ``output``."""

    output: Any


@dataclasses.dataclass(frozen=True)
class FellBack:
    """A trace attempt a unit template could not serve: ``reason`` (the kind and why, as the
    kind's ``exits`` and its log line say it) and how the next attempt traces."""

    reason: str
    next_trace: NextTrace


def _run_falling_back(state: ZeroGraphState, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The compiled forward; traced again each time a kind of unit cannot be a template (its
    units now run inline), at most three times per kind, and once with every unit inline when a
    template met a dynamic shape (that trace only). Every rank meets the same fallback in the same
    trace, so the ranks stay in step."""
    if not state.captured.graphs:  # this model's first trace: static, whatever other models of its class saw
        forget_shape_history(state.compiled_forward.__wrapped__)
    # a retry runs again the graphs that ran before the failed trace (those before a graph break):
    # their writes to buffers (a counter, running statistics) and their random numbers are undone
    # first, so the retried forward is the one eager runs once
    before = _ForwardSideEffects(model) if state.unit_kinds else None
    inline = False
    # a kind falls back at most three times (in a training-flag mode, off its flat shards, to islands),
    # and each module above units at most once, to a parent island (fewer of them than units)
    for _ in range(3 * len(state.unit_kinds) + len(state.runtime.units) + 2):
        island = getattr(model, parent_islands.PARENT_ISLAND_ATTR, None)
        if island is not None:  # the routing loop is the root's: the whole forward runs eagerly
            return parent_islands.run_parent_island(island, state.compiled_forward.__wrapped__, (model, *args), kwargs)
        outcome = _trace_once(state, model, args, kwargs, all_inline=inline)
        if isinstance(outcome, Traced):
            return outcome.output
        log.debug("zerograph: tracing the forward again (%s): %s", outcome.next_trace.name, outcome.reason)
        if before is not None:
            before.undo()
        inline = inline or outcome.next_trace is NextTrace.EVERY_UNIT_INLINE
    raise AssertionError("unreachable: each retry makes one more kind of unit, or the whole trace, more inline")


def _trace_once(state: ZeroGraphState, model: nn.Module, args: tuple, kwargs: dict, *,
                all_inline: bool) -> Traced | FellBack:
    """One attempt at the compiled forward (``all_inline``: every templated unit inline, no
    template asked). A template that cannot serve the trace raises ``TemplateUnavailable`` from
    inside Dynamo's trace, the one way out of it; here it becomes a ``FellBack``. Any other error
    propagates (``TemplateFallbackError`` under ``Config.strict_templates`` among them)."""
    inline_trace = TRACE.scope(inline_every_unit=True) if all_inline else contextlib.nullcontext()
    try:
        with inline_trace, shape_policy(state, args, kwargs):
            return Traced(state.compiled_forward(model, *args, **kwargs))
    except Exception as exc:
        error = own_error(exc)
        if not isinstance(error, TemplateUnavailable):
            raise
    dynamic = isinstance(error, DynamicShapeTrace)
    return FellBack(str(error), NextTrace.EVERY_UNIT_INLINE if dynamic else NextTrace.SAME)


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


# distinct input shapes a model with unit templates traces static, each with templates of its own
# (a batch size for evaluation, a shorter last batch, a few sequence lengths), before Dynamo's
# automatic dynamic shapes, whose trace runs every unit inline (counted as an exit of each kind)
STATIC_SHAPES = 8
# Dynamo's recompile limit for the compiled forward: the static shapes times the graphs a shape can
# need (train and eval, gradient sync on, off and flushing), so no trace falls back to eager Python
RECOMPILE_LIMIT = 64


def shape_policy(state: ZeroGraphState, args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """The Dynamo settings this forward is traced under: with unit templates, the first
    ``STATIC_SHAPES`` distinct input shapes are traced static (Dynamo's automatic dynamic shapes
    off), so a new batch size or sequence length keeps every unit on its template; past them,
    Dynamo's default. The recompile limit is ``RECOMPILE_LIMIT`` either way. Source:
    ``torch._dynamo.config`` (``automatic_dynamic_shapes``, ``recompile_limit``)."""
    settings: dict[str, Any] = {"recompile_limit": max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)}
    if state.unit_kinds:
        shapes = tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor))
        if shapes in state.static_shapes or len(state.static_shapes) < STATIC_SHAPES:
            state.static_shapes.add(shapes)
            settings["automatic_dynamic_shapes"] = False
    return torch._dynamo.config.patch(**settings)


def own_error(exc: BaseException) -> ZeroGraphError | None:
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

    The setting is read when a forward runs (which graph it runs) and again when its backward
    runs, which decides, as FSDP2's post-backward reads it: a forward run with sync off whose
    backward runs with it back on reduces its gradients (and what earlier micro-batches held) one
    parameter at a time, outside the graph; one run with sync on reduces in its graph whatever
    the setting at backward. ``no_sync()`` is decided by the forward instead. Off (gradient
    accumulation without communication): backward runs no reduce-scatter or all-reduce; each rank
    adds its full, unreduced gradients, in ``MixedPrecisionPolicy.reduce_dtype``, to buffers the runtime holds,
    and the shards' ``.grad`` receive zeros (created if ``None``). Back on, while such buffers are
    held, the backward adds them to its own gradients in the reductions' copy-in and reduces the
    sum once, so a step of micro-batches costs one reduction. Run the last micro-batch of a step
    with sync on, or ``.grad`` never receives the held gradients. While a trainable parameter has
    a tensor hook (``register_hook``, ``register_post_accumulate_grad_hook``), sync stays on
    (``grad_mode_for``): the hooks see what eager's see.

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
    state_of(self).runtime.grad_buffers.requires_gradient_sync = bool(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(self: nn.Module):
    """Context manager: ``set_requires_gradient_sync(False)`` inside, the previous setting after
    (DDP's ``no_sync``). Decided by the forward, as DDP's: the backwards of forwards run inside it
    keep their gradients unreduced wherever they run, unless a synced forward's backward runs in
    the same backward (a loss summing both), which reduces them at its end."""
    gradients = state_of(self).runtime.grad_buffers
    previous = gradients.requires_gradient_sync, gradients.no_sync
    gradients.requires_gradient_sync, gradients.no_sync = False, True
    try:
        yield
    finally:
        gradients.requires_gradient_sync, gradients.no_sync = previous
