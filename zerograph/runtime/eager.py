"""The markers' eager fallback: gathers and reductions outside a graph, with the graphs' code.

A frame Dynamo ran eagerly (a graph break), an island (``unit_islands.py``) and the gradients a
``no_sync`` run held back (``grad_buffers.py``, which reduces through ``EagerCollectives``) run
``zerograph::unshard`` / ``reduce_grad`` as the ops themselves, one parameter at a time, through
the tensor functions the passes trace into the graphs (``collectives.gather_fn`` / ``reduce_fn``;
[Note: one collective function, traced and run] in ``collectives.py``). Each
call's collectives are counted into the step as a graph's are (``_CountCollectives``: kind, full
buffer, group, as ``collective_volume`` reads them off a graph), and a communication failure
becomes a ``CollectiveError`` naming the parameter.

Layer: execution.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CollectiveError
from ..graph.vocab import COLLECTIVE_KINDS
from ..shard.sharding import ParamLayout
from .accounting import StepAccounting
from .collective_watch import watching
from .collectives import funcol, gather_fn, reduce_fn
from .comm_schedule import is_communication_failure
from .topology import Topology


class _CountCollectives(TorchDispatchMode):
    """Count each functional collective run under it into the step: its kind and full buffer (an
    all-gather's output, another collective's input) over the group it names, on that group's
    mesh dim, as ``capture._account`` counts a graph's collective nodes."""

    def __init__(self, topology: Topology, accounting: StepAccounting):
        super().__init__()
        self.topology, self.accounting = topology, accounting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = COLLECTIVE_KINDS.get(func)
        if kind is not None:
            full = out if kind == "all_gather" else args[0]
            dim, size = self.topology.comm_dim(kwargs.get("group_name", args[-1]))
            self.accounting.current.add(kind, full.numel(), full.element_size(), size, dim)
        return out


class EagerCollectives:
    """The eager gathers and reductions of one compiled model on this rank.

    Attributes:
        gather_quantization, reduce_quantization: ``Config``'s (set by compile), as the passes
            read them from ``PassContext``: a graph break's gathers quantize as the graphs' do.
        watch_collectives: ``ZEROGRAPH_DEBUG_COLLECTIVES``: each call's buffers checked
            (``collective_watch``).
    """

    def __init__(self, layouts: Mapping[int, ParamLayout], topology: Topology, accounting: StepAccounting,
                 device: torch.device, *, watch_collectives: bool = False):
        self.layouts = layouts  # every key a marker may carry (the runtime's marker_layouts)
        self.topology = topology
        self.accounting = accounting
        self.device = device
        self.gather_quantization: str | None = None
        self.reduce_quantization: str | None = None
        self.watch_collectives = watch_collectives

    def unshard(self, shard: torch.Tensor, key: int) -> torch.Tensor:
        """All-gather one parameter outside a graph. ``shard``: (local_rows, *rest) -> full shape,
        in ``param_dtype`` (cast before sending, as the graphs' copy-in does)."""
        layout, topology = self.layouts[key], self.topology
        if not layout.sharded or topology.world_size == 1:
            return shard.to(layout.param_dtype).clone()
        gather = gather_fn([layout], topology.world_size, topology.group_name, self.gather_quantization)
        (full,) = self._run("all_gather", key, gather, shard)
        return full

    def reduce_grad(self, grad: torch.Tensor, key: int, *, flush: bool = False) -> torch.Tensor:
        """Average one full gradient across ranks outside a graph: reduce-scatter to this rank's
        shard (stages 1-3) or all-reduce (stage 0), in ``reduce_dtype``. ``grad``: full shape ->
        local shard shape in the parameter's dtype. ``flush``: first add what a ``no_sync`` run
        held for ``key`` (``zerograph::take_unsynced``). World size 1: the gradient cast through
        ``reduce_dtype``, as the reduction would round it."""
        layout, topology = self.layouts[key], self.topology
        self.accounting.backward_ran = True
        if topology.dp_size == 1:
            return grad.to(layout.reduce_dtype).to(layout.dtype, copy=True)
        rows = layout.rank_rows[topology.rank] if layout.sharded else 0
        reduce = reduce_fn([key], [layout], [rows], topology.world_size, topology.group_name, layout.sharded,
                           flush=flush, replicate_group=topology.replicate_spec,
                           quantization=self.reduce_quantization)
        (local,) = self._run("reduce_scatter" if layout.sharded else "all_reduce", key, reduce, grad)
        return local

    def reached_on_any_rank(self, reached: list[bool], key: int) -> list[bool]:
        """For each of a unit's parameters, whether its gradient reached the loss on any rank
        (``reached`` is this rank's answer): one small all-reduce (max) over every data-parallel
        rank, so that ranks whose data took other paths through a unit still reduce the same
        gradients, and a parameter no rank reached keeps ``.grad`` ``None`` as in eager. ``key``
        names the collective in errors."""
        flags = torch.tensor(reached, dtype=torch.uint8, device=self.device)  # on the device NCCL needs
        if self.topology.dp_size > 1:
            name = self.topology.world_group.group_name
            flags = self._run("all_reduce", key, lambda: funcol.wait_tensor(funcol.all_reduce(flags, "max", name)))
        return [bool(flag) for flag in flags.tolist()]

    def _run(self, kind: str, key: int, fn: Callable[..., Any], *tensors: torch.Tensor) -> Any:
        """``fn(*tensors)``, its collectives counted into the step; a communication failure
        becomes a ``CollectiveError`` naming it (as ``ScheduleCheck.run_graph`` does for graphs),
        chaining gloo's or NCCL's error."""
        self.topology.check_in_step()
        start = time.monotonic()
        try:
            scope = f"rank {self.topology.rank}, the eager {kind} of {self.layouts[key].fqn!r}"
            with _CountCollectives(self.topology, self.accounting), watching(scope, self.watch_collectives):
                return fn(*tensors)
        except RuntimeError as exc:
            if not is_communication_failure(exc):
                raise
            self.topology.check_group()
            self.topology.mark_out_of_step(f"the eager {kind} of {self.layouts[key].fqn!r}: {type(exc).__name__}")
            raise CollectiveError(
                f"rank {self.topology.rank}: the eager {kind} of {self.layouts[key].fqn!r} (run outside a graph: "
                f"Dynamo fell back to eager for this frame) failed after {time.monotonic() - start:.1f} s. A peer "
                "rank probably died, raised, or is stuck elsewhere: check the other ranks' logs. Eager collectives "
                f"wait the process group's timeout. Cause: {type(exc).__name__}: {exc}") from exc
