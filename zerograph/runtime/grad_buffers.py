"""Gradient accumulation without sync: the full gradients a ``no_sync`` backward holds back.

With ``requires_gradient_sync`` off (FSDP2's ``set_requires_gradient_sync``, DDP's ``no_sync``)
a backward reduces nothing: each full gradient is added to a buffer here, in ``reduce_dtype``
(``accumulate``, what ``zerograph::accumulate_unsynced`` runs), and the shard's ``.grad`` gets
zeros. The next synced backward adds the held sum to each gradient before its one reduction
(``take``, what ``zerograph::take_unsynced`` runs); what no gradient of it took is reduced once
its backward ends (``flush_leftovers_after_backward``). ``set_requires_gradient_sync`` is read again
when the backward runs (``holds_now``); ``no_sync()`` is decided by the forward. ``GradientBuffers.grad_mode`` says which
of the three a forward's backward does (``sharding.GRAD_MODES``); each traces its own graph.

Layer: execution.

Source: FSDP2's ``set_requires_gradient_sync`` (unsharded gradients accumulated in the reduce
dtype) and its post-backward final callback.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import HeldGradientsError
from ..graph.vocab import GRAD_ACCUMULATE, GRAD_FLUSH, GRAD_SYNC
from ..shard.flat import FlatShard, accumulate_grad
from ..shard.sharding import ParamLayout
from .accounting import StepAccounting
from .eager import EagerCollectives
from .topology import Topology


class GradientBuffers:
    """The held full gradients of one compiled model on this rank.

    Attributes:
        requires_gradient_sync: ``False``: backward keeps full gradients here (no_sync).
        unsynced: key -> full gradient summed while unsynced, in ``reduce_dtype``.
        eager: the eager reductions (``eager.py``) that reduce a gradient at once, as a synced
            backward does, and the held ones when sync comes back.
        shards, flat_shards: the runtime's parameter of each key and flat shard of each unit's
            key, read to find the parameters a key's gradient goes to.
    """

    def __init__(self, layouts: Mapping[int, ParamLayout], topology: Topology, accounting: StepAccounting,
                 eager: EagerCollectives, shards: Mapping[int, torch.Tensor], flat_shards: Mapping[int, FlatShard]):
        self.layouts = layouts  # every key a marker may carry (the runtime's marker_layouts)
        self.topology = topology
        self.accounting = accounting
        self.eager = eager
        self.shards = shards
        self.flat_shards = flat_shards
        # each key's parameters' AccumulateGrad nodes (found at a forward: the custom ops' bodies, where
        # accumulate and take run, record no autograd to find them by); held, so autograd reuses them
        self.accumulators: dict[int, tuple[Node, ...]] = {}
        self.requires_gradient_sync = True  # FSDP2's switch: read when the backward runs
        self.no_sync = False  # inside DDP's no_sync() (sync off too): its forwards hold, whenever their backward runs
        self.ever_unsynced = False  # sync was off once: synced backwards look for held gradients to reduce
        self._backward_holds = False  # a no_sync forward's backward is running
        self._backward_syncs = False  # another forward's backward is running
        self.unsynced: dict[int, torch.Tensor] = {}
        # key -> each parameter's (.grad, its version) when the last holding backward ended: a
        # caller's in-place write since (zero_grad(set_to_none=False)) shows as a new version
        self.held_grads: dict[int, tuple[tuple[torch.Tensor | None, int], ...]] = {}
        self._noting = False  # a callback noting held_grads is queued for the running backward
        _LIVE.add(self)

    def grad_mode(self) -> str:
        """What the next forward's backward does with full gradients (``sharding.GRAD_MODES``):
        keep them here while sync is off, add the kept ones before reducing once it is back on,
        else reduce them (the only mode, and graph, of a run that never turns sync off)."""
        if not self.requires_gradient_sync:
            self.ever_unsynced = True
            return GRAD_ACCUMULATE
        return GRAD_FLUSH if self.unsynced else GRAD_SYNC

    def holds_now(self) -> bool:
        """Inside a backward: whether gradients are held, not reduced. Sync off
        (``set_requires_gradient_sync(False)``, read now, as FSDP2 reads it in its post-backward),
        inside ``no_sync()``, or the backward of a forward run inside ``no_sync()`` (DDP's
        ``no_sync`` is decided by the forward)."""
        return not self.requires_gradient_sync or self._backward_holds

    def unsynced_bytes(self) -> int:
        """Bytes of full gradients held while gradient sync is off (Ψ in ``reduce_dtype`` at most)."""
        return sum(t.numel() * t.element_size() for t in self.unsynced.values())

    def accumulate(self, grad: torch.Tensor, key: int) -> torch.Tensor:
        """Add a full gradient to ``key``'s unsynced buffer, in ``reduce_dtype`` (FSDP2 also
        accumulates unsharded gradients in the reduce dtype). No collective. Returns zeros of the
        local shard shape in the parameter's dtype: the shard's gradient for this micro-batch.
        Only the parts of parameters this backward accumulates into are held (not those
        ``backward(inputs=...)`` leaves out); under ``torch.autograd.grad``, which hands the
        gradient back instead, nothing is held and the gradient is reduced at once and returned."""
        layout = self.layouts[key]
        self.accounting.backward_ran = True
        runs = self._accumulates(key)
        if runs is None:
            return self.eager.reduce_grad(grad, key)
        if not self.holds_now():  # a forward traced unsynced, its backward run with sync back on
            return self.eager.reduce_grad(self.take(grad, key), key)
        if any(runs):
            # a contiguous copy of our own: the graph may reuse grad's storage
            kept = grad.to(layout.reduce_dtype, copy=True, memory_format=torch.contiguous_format)
            if not all(runs):  # a unit's flat gradient, some of its parameters left out
                self.flat_shards[key].zero_parts_(kept, runs)
            held = self.unsynced.get(key)
            if held is None:
                self.unsynced[key] = kept
            else:
                held.add_(kept)
            if not self._noting:  # once AccumulateGrad has run: what .grad then is
                self._noting = True
                torch.autograd.Variable._execution_engine.queue_callback(self._note_held_grads)
        return grad.new_zeros(layout.local_shape(self.topology.rank), dtype=layout.dtype)

    def take(self, grad: torch.Tensor, key: int) -> torch.Tensor:
        """``grad`` plus ``key``'s unsynced buffer, in ``reduce_dtype`` (a new tensor), forgetting
        the buffer, where this backward accumulates into the ``.grad`` of each of ``key``'s
        parameters. Otherwise (``backward(inputs=...)`` leaving one out, ``torch.autograd.grad``)
        the buffer is kept for the leftovers' reduction into ``.grad`` after the backward: added to
        a gradient that autograd drops or hands back, the held micro-batches would be lost from
        ``.grad``, or added to what ``autograd.grad`` returns."""
        out = grad.to(self.layouts[key].reduce_dtype, copy=True, memory_format=torch.contiguous_format)
        runs = self._accumulates(key) if key in self.unsynced else None
        held = self.unsynced.pop(key) if runs is not None and all(runs) else None
        return out if held is None else out.add_(held)

    def prepare_backward(self, grad_mode: str) -> None:
        """Before every forward: forget the held gradients the caller cleared (``_forget_cleared``);
        then, for a backward that may hold (``"accumulate"``) or take (``"flush"``) gradients, with
        grad enabled, find the ``AccumulateGrad`` nodes of the keys it may meet."""
        if self.unsynced:
            self._forget_cleared()
        if grad_mode == GRAD_SYNC or not torch.is_grad_enabled():
            return
        for key in tuple(self.layouts if grad_mode == GRAD_ACCUMULATE else self.unsynced):
            params = self._params_of(key)
            if key not in self.accumulators and params is not None:
                self.accumulators[key] = tuple(_grad_accumulator(param) for param in params)

    def _params_of(self, key: int) -> tuple[torch.Tensor, ...] | None:
        """The parameters ``key``'s gradient goes to: its unit's flat shard's, or its own; ``None``
        for a flat shard its unit left (its parameters' own keys stand for them now)."""
        if key in self.flat_shards:
            return self.flat_shards[key].shards
        return (self.shards[key],) if key in self.shards else None

    def _note_held_grads(self) -> None:
        """At the end of a backward that held gradients: each held key's parameters' ``.grad``
        and its version (``_version``, which every in-place write moves)."""
        self._noting = False
        self.held_grads = {key: tuple((p.grad, p.grad._version if p.grad is not None else 0)
                                      for p in self._params_of(key) or ())
                           for key in self.unsynced}

    def _forget_cleared(self) -> None:
        """Before a forward: drop the held gradients whose parameters' ``.grad`` the caller cleared
        since the backward that held them, as eager's ``zero_grad`` discards the micro-batches so
        far: set to ``None`` (``zero_grad()``, ``set_to_none=True``), written in place
        (``zero_grad(set_to_none=False)``, ``.grad.zero_()``: a new version) or replaced. An unsynced
        backward gave each a ``.grad`` of zeros, so any of these means the caller discarded it; for a
        unit's flat gradient, the cleared parameters' parts. Source: the version counter
        autograd keeps for in-place checks (``Tensor._version``)."""
        for key in tuple(self.unsynced):
            noted = self.held_grads.get(key, ())
            kept = tuple(_unchanged(param.grad, noted[i] if i < len(noted) else None)
                         for i, param in enumerate(self._params_of(key) or ()))
            if not any(kept):
                del self.unsynced[key]
            elif not all(kept):
                self.flat_shards[key].zero_parts_(self.unsynced[key], kept)

    def _accumulates(self, key: int) -> tuple[bool, ...] | None:
        """Inside a backward, per parameter of ``key``: whether it runs its ``AccumulateGrad``
        (not so for those ``backward(inputs=...)`` leaves out); ``None`` under
        ``torch.autograd.grad``, which accumulates into none. A key without nodes: all true."""
        nodes = self.accumulators.get(key, ())
        try:
            return tuple(torch._C._will_engine_execute_node(node) for node in nodes) or (True,)
        except RuntimeError:  # autograd.grad(): PyTorch refuses the question for leaves, never accumulated
            return None

    def flush_leftovers_after_backward(self, outputs: Any, grad_mode: str) -> None:
        """After a forward (once sync was ever off): make its backward, when it starts, say
        whether it holds (a forward run inside ``no_sync()``: DDP's ``no_sync`` is decided by the
        forward) or syncs (any other), and, when the backward ends, reduce each held gradient into
        its shard's ``.grad`` if it synced and sync is on then (``_end_backward``): what no gradient
        of it took (a parameter used in the unsynced micro-batches, e.g. a head, but not in this
        one; a ``no_sync`` forward's loss summed with a synced one's), so ``.grad`` holds the
        rank-averaged sum of every micro-batch, as eager's does, and nothing is carried into the
        next step. The graphs cannot: each reduces the parameters whose gradients it produces.
        Rank-agreed: every rank held the same keys (ranks that ran other graphs fail the schedule
        check first), reduced in key order. Source: FSDP2's post-backward final callback
        (``Variable._execution_engine.queue_callback`` from a hook on the forward's outputs)."""
        if not (self.ever_unsynced or self.unsynced) or not torch.is_grad_enabled():
            return
        tensors = [t for t in torch.utils._pytree.tree_leaves(outputs)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        holds = self.no_sync and grad_mode == GRAD_ACCUMULATE

        def started(grads: Any) -> None:
            if holds:
                self._backward_holds = True
            else:
                self._backward_syncs = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, started, mode="any")

    def _end_backward(self) -> None:
        """Once per backward's end (later calls find nothing left): the held gradients reduced
        where a synced forward's backward ran in it and sync is on now."""
        syncs, self._backward_holds, self._backward_syncs = self._backward_syncs, False, False
        if syncs and self.requires_gradient_sync:
            for key in sorted(self.unsynced):
                self._reduce_into_grad(self.unsynced.pop(key), key)

    def _reduce_into_grad(self, grad: torch.Tensor, key: int) -> None:
        """Reduce one held full gradient into its shard's ``.grad`` (its unit's flat gradient for
        a flat shard's key)."""
        local = self.eager.reduce_grad(grad, key)  # (local rows, *rest)
        if key in self.flat_shards:
            self.flat_shards[key].add_grad(local)
            return
        accumulate_grad(self.shards[key], local)


def _unchanged(grad: torch.Tensor | None, noted: tuple[torch.Tensor | None, int] | None) -> bool:
    """Whether ``grad`` is not ``None`` and, where noted, the same tensor at the same version."""
    return grad is not None and (noted is None or (noted[0] is grad and noted[1] == grad._version))


def _grad_accumulator(param: torch.Tensor) -> Node:
    """A leaf's ``AccumulateGrad`` node: the next edge of any differentiable op on it, ``to_local()``
    for a ``DTensor`` (``get_gradient_edge``'s ``view_as`` runs DTensor's view, which fails for
    uneven shards on some ranks only). Called with grad enabled."""
    alias = param.to_local() if isinstance(param, DTensor) else param.view_as(param)
    return alias.grad_fn.next_functions[0][0]


# every model's held gradients, read by the optimizer step check (``_check_step``)
_LIVE: weakref.WeakSet[GradientBuffers] = weakref.WeakSet()


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any optimizer's ``step``: refuse a step over parameters whose gradients a ``no_sync``
    backward still holds (``HeldGradientsError``). Their ``.grad`` lacks those micro-batches (the
    step would lose them, or the next step would count them), where eager's ``.grad`` has them;
    a step whose last backward was a ``no_sync()`` forward's, run after leaving the context, is the
    usual cause. Held gradients the caller cleared since (``zero_grad``) are dropped first, so a
    discarded step is no error. Source: ``torch.optim.optimizer.register_optimizer_step_pre_hook``."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for buffers in list(_LIVE):
        if not buffers.unsynced:
            continue
        buffers._forget_cleared()
        held = [buffers.layouts[key].fqn for key in sorted(buffers.unsynced)
                if any(id(p) in stepped for p in buffers._params_of(key) or ())]
        if held:
            raise HeldGradientsError(
                f"optimizer.step() over parameters whose gradients no_sync still holds ({', '.join(held[:3])}"
                f"{' ...' if len(held) > 3 else ''}): run the last micro-batch's forward and backward with gradient "
                "sync on (outside no_sync()), or decide at backward with set_requires_gradient_sync(True) before it; "
                "zero_grad() first to discard them")


register_optimizer_step_pre_hook(_check_step)
