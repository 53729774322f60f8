"""Run-time state: process group, shard layouts, eager collectives, step accounting, fault checks.

The runtime never rewrites graphs. It owns what the compiled graphs need at run time: the process
group they name, the layouts the markers' fake implementations read, the eager fallback used when a
frame runs outside a graph (a graph break), the full-size gradient buffers of gradient accumulation
without sync (``requires_gradient_sync`` off), the pool of reused comm buffers, the per-step
communication counters, and the checks that turn rank divergence and dead peers into errors instead of hangs: before
each graph call the
ranks compare a digest of the graph's communication schedule (``Runtime.check_schedule``), and a
communication failure inside a graph becomes a ``CollectiveError`` naming it (``Runtime.run_graph``).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from . import registry
from .buffer_pool import BufferPool
from .errors import CollectiveError, ProcessGroupError, ScheduleMismatchError
from .fake import is_fake_world
from .flat import FlatShard, accumulate_grad
from .kernels.ops import to_wire
from .kernels.quantize import BLOCK, DEQUANTIZE_SUM, PACK_QUANTIZED, QUANTIZABLE_DTYPES, UNPACK_DEQUANTIZED, quantizes
from .sharding import ParamLayout, Unit
from .vocab import (
    COLLECTIVE_KINDS,
    COLLECTIVES,
    GRAD_ACCUMULATE,
    GRAD_FLUSH,
    GRAD_SYNC,
    REPLICATE_DIM,
    SECONDARY_DIM,
    SHARD_DIM,
    TAG,
    all_gather_single,
    full_buffer,
)


@dataclasses.dataclass
class CommCounter:
    """Communication of one step on this rank.

    ``elements`` counts the full (unsharded) tensor moved by each collective, as in the ZeRO paper
    section 7 (an all-reduce counts twice, being a reduce-scatter plus an all-gather); ``bytes``
    counts what this rank sends with a ring algorithm: ``(N-1)/N`` of the full buffer per
    all-gather or reduce-scatter, twice that per all-reduce.
    """

    elements: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    graphs: set[int] = dataclasses.field(default_factory=set)  # captured graphs (compile order) that ran
    # the same per mesh dim (``MESH_DIMS``): dim -> kind -> elements / bytes; ``elements`` and
    # ``bytes`` above are their sums over the dims
    dim_elements: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    dim_bytes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, full_numel: int, itemsize: int, world_size: int, dim: str = SHARD_DIM) -> None:
        """Count one collective of ``kind`` over a group of ``world_size`` ranks on mesh dim ``dim``."""
        factor = 2 if kind == "all_reduce" else 1
        elements = factor * full_numel
        sent = factor * full_numel * itemsize * (world_size - 1) // world_size
        self.elements[kind] += elements
        self.bytes[kind] += sent
        self.dim_elements.setdefault(dim, dict.fromkeys(COLLECTIVES, 0))[kind] += elements
        self.dim_bytes.setdefault(dim, dict.fromkeys(COLLECTIVES, 0))[kind] += sent

    def merge(self, other: "CommCounter") -> None:
        for kind in COLLECTIVES:
            self.elements[kind] += other.elements[kind]
            self.bytes[kind] += other.bytes[kind]
        for mine, theirs in ((self.dim_elements, other.dim_elements), (self.dim_bytes, other.dim_bytes)):
            for dim, counts in theirs.items():
                into = mine.setdefault(dim, dict.fromkeys(COLLECTIVES, 0))
                for kind in COLLECTIVES:
                    into[kind] += counts[kind]
        self.graphs |= other.graphs


@dataclasses.dataclass(frozen=True)
class ScheduleEntry:
    """One collective of a graph's communication schedule.

    ``numel``: elements of the full (unsharded) buffer it moves; ``dtype``: e.g. ``"float32"``;
    ``units``: indices of the units whose parameters or gradients it moves (``Runtime.units``).
    """

    kind: str
    numel: int | str
    dtype: str
    units: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CommSchedule:
    """The ordered collectives one compiled graph runs on every call, plus a digest of them.

    ``label`` names the graph on this rank (``"backward graph #1"``, numbered in compile order);
    ``digest`` is a 63-bit hash of the graph kind and the entries, equal on every rank that runs
    the same schedule. Activation shapes are not part of it: ranks may feed different sequence
    lengths as long as they move the same parameters in the same order.
    """

    label: str
    graph_kind: str
    entries: tuple[ScheduleEntry, ...]
    digest: int


def schedule_of(graph: fx.Graph, graph_kind: str, label: str) -> CommSchedule:
    """Read the communication schedule of a lowered graph (its functional collectives in order)."""
    entries = []
    for node in graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target)
        if kind is None:
            continue
        val = full_buffer(node)
        tag = node.meta.get(TAG, {})
        units = tag.get("units", [tag["unit"]] if "unit" in tag else [])
        numel = val.numel()  # parameter-sized, so static; kept as text should a pass ever make it symbolic
        entries.append(ScheduleEntry(kind, numel if isinstance(numel, int) else str(numel),
                                     str(val.dtype).removeprefix("torch."), tuple(units)))
    # Python's hash() is salted per process, so ranks could never agree on it: use a fixed hash
    text = repr((graph_kind, [dataclasses.astuple(e) for e in entries]))
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    return CommSchedule(label, graph_kind, tuple(entries), digest)


# substrings of the errors gloo and NCCL raise when a peer is gone or a collective timed out
_COMM_FAILURE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out")


def is_communication_failure(exc: BaseException) -> bool:
    """True when ``exc`` comes from the communication layer rather than from the model's compute."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _COMM_FAILURE_MARKERS)


class Runtime:
    """Per-compiled-model run-time state on this rank.

    ``timeout_s`` (seconds) bounds the wait of the schedule check; ``device`` holds its tensors
    (CPU for gloo, the rank's GPU for NCCL).

    Hybrid sharding (a 2-D mesh, ``(replicate, shard)``): ``group`` is this rank's shard group
    (``world_size``, ``rank`` and the layouts are the shard dim's); ``replicate_group`` the ranks
    holding the same shards, across which reduced gradient shards are all-reduced;
    ``world_group`` every rank of the mesh (the schedule check and checkpoints run over it).
    Without a mesh both default to ``group`` alone (no replicate group).
    """

    def __init__(self, group: dist.ProcessGroup, stage: int, layouts: list[ParamLayout], units: list[Unit], *,
                 timeout_s: float = 300.0, device: torch.device | str = "cpu",
                 replicate_group: dist.ProcessGroup | None = None, world_group: dist.ProcessGroup | None = None,
                 secondary_group: dist.ProcessGroup | None = None):
        self.group = group
        self.world_group = world_group or group
        # a replicate dim of one rank reduces nothing: treated as none (no collective, no accounting)
        if replicate_group is not None and dist.get_world_size(replicate_group) == 1:
            replicate_group = None
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.replicate_group_name = None if replicate_group is None else replicate_group.group_name
        # hpZ: this rank's node, over which backward re-gathers from the secondary partition
        self.secondary_group = secondary_group
        self.secondary_size = 1 if secondary_group is None else dist.get_world_size(secondary_group)
        self.secondary_group_name = None if secondary_group is None else secondary_group.group_name
        self._group_sizes: dict[str, int] = {}  # other groups a graph's collectives name (P_a's)
        self.timeout_s = timeout_s  # bound on the schedule check's wait (seconds)
        self.device = torch.device(device)  # where the schedule check's tensors live (CUDA for NCCL)
        self._graphs_seen = 0
        self.group_name = group.group_name
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dp_size = self.world_size * self.replicate_size  # N: ranks whose gradients are averaged
        # this rank among all of them (the dump's rank<r> folders, its manifests): under hybrid
        # sharding ``rank`` is the shard group's, which two replicas share
        self.mesh_rank = dist.get_rank(self.world_group)
        self.fake_world = is_fake_world(group)  # zerograph.fake_world: no peers, collectives move no data
        self.stage = stage
        self.layouts = {layout.key: layout for layout in layouts}  # the model's parameters
        # every key a marker may carry: the parameters' and the units' flat shards' (``add_flat_shards``)
        self.marker_layouts: dict[int, ParamLayout] = dict(self.layouts)
        self.flat_shards: dict[int, FlatShard] = {}  # flat shard key -> the unit's FlatShard (flat.py)
        self.units = units
        self.current = CommCounter()
        self.last: CommCounter | None = None
        self.backward_ran = False
        self.graph_memory: list[dict] = []  # per captured graph: {'forward'|'backward': liveness.Timeline}
        self.requires_gradient_sync = True  # False: backward keeps full gradients here (no_sync)
        self.unsynced: dict[int, torch.Tensor] = {}  # key -> full gradient summed while unsynced (reduce_dtype)
        self.buffer_pool = BufferPool()  # the comm buffers ``buffer_reuse`` assigns graphs to
        self.shards: dict[int, torch.Tensor] = {}  # key -> the model's parameter (DTensor shard); set by compile
        self.gather_quantization: str | None = None  # Config.gather_quantization; set by compile
        self.reduce_quantization: str | None = None  # Config.reduce_quantization; set by compile
        registry.register(layouts, self)  # what the markers' implementations look their keys up in

    # -- step accounting -------------------------------------------------------------------
    def start_forward(self) -> None:
        """A forward after a finished backward opens a new step (on a live process group)."""
        self.check_group()
        if self.backward_ran:
            self.last, self.current, self.backward_ran = self.current, CommCounter(), False

    def finished_step(self) -> CommCounter:
        return self.current if self.backward_ran or self.last is None else self.last

    def check_group(self) -> None:
        """Raise ``ProcessGroupError`` when the model's process group was destroyed (e.g. by
        ``dist.destroy_process_group()``): its graphs name the group and could no longer resolve it.
        One dictionary lookup (``dist.get_rank``, which refuses an unregistered group)."""
        try:
            dist.get_rank(self.group)
        except (ValueError, RuntimeError) as exc:
            raise ProcessGroupError(
                f"the model's process group ({self.group_name!r}) was destroyed (destroy_process_group?) or "
                "never initialised here; a compiled model is bound to the group it was compiled with: compile "
                f"a fresh model after initialising a new group. Cause: {type(exc).__name__}: {exc}") from exc

    # -- agreement across ranks before each graph runs ---------------------------------------
    def schedule(self, graph: fx.Graph, graph_kind: str) -> CommSchedule:
        """The schedule of a newly lowered graph, labelled with its compile-order number."""
        label = f"{graph_kind} graph #{self._graphs_seen}"
        self._graphs_seen += 1
        return schedule_of(graph, graph_kind, label)

    def check_schedule(self, schedule: CommSchedule) -> None:
        """Check, before a graph's first collective, that every rank is about to run the same schedule.

        Costs one all-gather of two int64 per rank (digest, collective count: 16 bytes) per graph
        call, one small latency-bound message; skipped at world size 1 and for graphs without
        collectives (they cannot hang a peer) and in a fake world (``zerograph.fake_world``: no
        peers, and the gathered digests would be uninitialised memory). The wait is bounded by ``Config.timeout_s`` (and by
        the process group's own timeout), so a peer that died or never calls the model makes this
        rank raise instead of hang. Source: the fingerprint check that
        ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (c10d's ``ProcessGroupWrapper``) runs before every
        collective; here one comparison covers all the collectives of a graph.

        Raises:
            ScheduleMismatchError: on every rank, naming the first collective where rank 0 and the
                first rank that differs from it disagree (kind, size, dtype, unit).
            CollectiveError: the exchange failed or timed out (a peer rank is gone or stuck).
        """
        size = dist.get_world_size(self.world_group)  # every rank of the mesh: replicas must agree too
        if size == 1 or not schedule.entries or self.fake_world:
            return
        mine = torch.tensor([schedule.digest, len(schedule.entries)], dtype=torch.int64, device=self.device)
        everyone = torch.empty(size * 2, dtype=torch.int64, device=self.device)  # (N * 2,)
        start = time.monotonic()
        try:
            work = all_gather_single(everyone, mine, group=self.world_group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise CollectiveError(self.failure_message(f"the schedule check before {schedule.label}",
                                                       schedule, exc, time.monotonic() - start)) from exc
        digests = everyone.view(size, 2)[:, 0].tolist()
        if any(d != digests[0] for d in digests):
            self._raise_mismatch(schedule, digests)

    def _raise_mismatch(self, schedule: CommSchedule, digests: list[int]) -> None:
        """Every rank saw the same digests, so every rank comes here and raises the same message."""
        peers: list = [None] * len(digests)
        try:  # the error path only: the full schedules, to name the difference
            dist.all_gather_object(peers, (schedule.label, schedule.entries), group=self.world_group)
        except RuntimeError as exc:
            what = "exchanging schedules after a mismatch"
            raise CollectiveError(self.failure_message(what, schedule, exc, 0.0)) from exc
        other = next(r for r, d in enumerate(digests) if d != digests[0])
        same = [r for r, d in enumerate(digests) if d == digests[0]]
        raise ScheduleMismatchError(self._describe_mismatch(peers[0], other, peers[other])
                                    + f" (ranks with rank 0's schedule: {same}; this is rank "
                                    f"{dist.get_rank(self.world_group)})")

    def _describe_mismatch(self, first: tuple, other: int, second: tuple) -> str:
        (label_a, a), (label_b, b) = first, second
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if i == len(a) == len(b):
            where = "the same collectives in graphs of different kinds"
        else:
            where = (f"collective {i}: rank 0 runs {self._entry_text(a, i)}, "
                     f"rank {other} runs {self._entry_text(b, i)}")
        return (f"ranks diverged before communicating: rank 0 is about to run {label_a} ({len(a)} collectives) "
                f"and rank {other} {label_b} ({len(b)} collectives); they differ at {where}. Every rank must "
                "run the same collectives in each step: the same model (parameter shapes and dtypes) and "
                "the same layers used in the same order; only activation shapes, such as sequence "
                "lengths, may differ between ranks. Look for rank- or data-dependent control flow that "
                "skips or repeats a layer on some ranks, or that Dynamo splits into graphs at data-dependent "
                "points inside a unit (a loop over the experts that got tokens): with Config(unit_templates=True), "
                "the default, such a unit runs eagerly, gathered once on entry, and the ranks stay in step"
                f"{self._early_end_hint(a, other, b)}")

    @staticmethod
    def _early_end_hint(a: tuple, other: int, b: tuple) -> str:
        """When one schedule is the start of the other, the shorter rank's forward was cut there
        (Dynamo ends a graph where Python code it cannot trace runs: a ``raise``, an early
        ``return``): its own error, which it would raise right after, never got to run."""
        if len(a) == len(b) or tuple(a[:len(b)]) != tuple(b[:len(a)]):
            return ""
        short = other if len(b) < len(a) else 0
        return (f". Rank {short}'s graph stops early, where the other continues: its forward was cut there "
                f"(Dynamo ends a graph before Python code it cannot trace, such as a raise or an early return), "
                f"so if rank {short} raises an exception of its own right after these collectives, that "
                "exception is the cause and this check stopped it from surfacing; move checks that can raise "
                "on one rank only before the model call")

    def _entry_text(self, entries: tuple[ScheduleEntry, ...], i: int) -> str:
        if i >= len(entries):
            return f"nothing (its schedule ends after {len(entries)} collectives)"
        e = entries[i]
        names = ", ".join(repr(self.units[u].name) if 0 <= u < len(self.units) else str(u) for u in e.units)
        numel = f"{e.numel:,}" if isinstance(e.numel, int) else e.numel
        return f"{e.kind} of {numel} {e.dtype} elements for unit {names or '?'}"

    def failure_message(self, what: str, schedule: CommSchedule, exc: BaseException, waited_s: float) -> str:
        """Text of a ``CollectiveError``: which graph and collective, and the likely cause."""
        return (f"rank {self.rank}: {what} failed after {waited_s:.1f} s; the graph's first collective is "
                f"{self._entry_text(schedule.entries, 0)}. A peer rank probably died, raised before "
                "reaching this graph, or is stuck elsewhere: check the other ranks' logs. The schedule check "
                f"waits at most Config.timeout_s ({self.timeout_s:g} s here), collectives inside a graph the "
                f"process group's timeout. Cause: {type(exc).__name__}: {exc}")

    def run_graph(self, schedule: CommSchedule, compiled: Callable[[list], Any], args: list) -> Any:
        """Run a lowered graph; a communication failure inside it becomes a ``CollectiveError``
        naming the graph (chaining gloo's or NCCL's own error), any other error passes unchanged."""
        start = time.monotonic()
        try:
            return compiled(args)
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError) or not schedule.entries:
                raise
            self.check_group()  # a group destroyed between forward and backward: say so, not "Could not resolve"
            if not is_communication_failure(exc):
                raise
            what = f"a collective of {schedule.label}"
            raise CollectiveError(self.failure_message(what, schedule, exc, time.monotonic() - start)) from exc
        finally:
            self.buffer_pool.release_all()  # every pooled buffer of the graph is dead once it returns

    # -- gradient synchronisation switch (FSDP2's set_requires_gradient_sync) ------------------
    def grad_mode(self) -> str:
        """What the next forward's backward does with full gradients (``sharding.GRAD_MODES``):
        keep them here while sync is off, add the kept ones before reducing once it is back on,
        else reduce them (the only mode, and graph, of a run that never turns sync off)."""
        if not self.requires_gradient_sync:
            return GRAD_ACCUMULATE
        return GRAD_FLUSH if self.unsynced else GRAD_SYNC

    def unsynced_bytes(self) -> int:
        """Bytes of full gradients held while gradient sync is off (Ψ in ``reduce_dtype`` at most)."""
        return sum(t.numel() * t.element_size() for t in self.unsynced.values())

    def accumulate_unsynced(self, grad: torch.Tensor, key: int) -> torch.Tensor:
        """Add a full gradient to ``key``'s unsynced buffer, in ``reduce_dtype`` (FSDP2 also
        accumulates unsharded gradients in the reduce dtype). No collective. Returns zeros of the
        local shard shape in the parameter's dtype: the shard's gradient for this micro-batch."""
        layout = self.marker_layouts[key]
        self.backward_ran = True
        held = self.unsynced.get(key)
        if held is None:
            # a contiguous copy of our own: the graph may reuse grad's storage
            self.unsynced[key] = grad.to(layout.reduce_dtype, copy=True, memory_format=torch.contiguous_format)
        else:
            held.add_(grad)
        return grad.new_zeros(self.local_shape(key), dtype=layout.dtype)

    def flush_leftovers_after_backward(self, outputs: Any, grad_mode: str) -> None:
        """After a flushing forward (``grad_mode`` ``"flush"``: sync back on while unsynced
        gradients are held; any other mode returns at once): make its backward, once done, reduce
        the held gradients that no gradient of it took (a parameter used in the unsynced
        micro-batches, e.g. a head, but not in this one), each into its shard's ``.grad``, so
        ``.grad`` holds the rank-averaged sum of every micro-batch, as DDP's ``no_sync`` gives,
        and nothing is carried into the next step. The flushing graph cannot: it reduces the
        parameters whose gradients it produces. Rank-agreed: every rank held the same keys
        (ranks that ran other graphs fail the schedule check first), reduced in key order.
        Source: FSDP2's post-backward final callback (``Variable._execution_engine.queue_callback``
        from a hook on the forward's outputs)."""
        if grad_mode != GRAD_FLUSH or not self.unsynced or not torch.is_grad_enabled():
            return
        tensors = [t for t in torch.utils._pytree.tree_leaves(outputs)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: torch.autograd.Variable._execution_engine.queue_callback(
                    self._reduce_leftovers), mode="any")

    def add_flat_shards(self, flat_shards: list[FlatShard]) -> None:
        """Make the units' flat shards (``flat.py``) keys the markers may carry."""
        for flat in flat_shards:
            self.marker_layouts[flat.layout.key] = flat.layout
            self.flat_shards[flat.layout.key] = flat
        registry.register([flat.layout for flat in flat_shards], self)

    def _reduce_leftovers(self) -> None:
        for key in sorted(self.unsynced):
            local = self.reduce_grad_eager(self.unsynced.pop(key), key, GRAD_SYNC)  # (local rows, *rest)
            if key in self.flat_shards:
                self.flat_shards[key].add_grad(local)
                continue
            accumulate_grad(self.shards[key], local)

    def take_unsynced(self, grad: torch.Tensor, key: int) -> torch.Tensor:
        """``grad`` plus ``key``'s unsynced buffer, in ``reduce_dtype`` (a new tensor); forgets the buffer."""
        out = grad.to(self.marker_layouts[key].reduce_dtype, copy=True, memory_format=torch.contiguous_format)
        held = self.unsynced.pop(key, None)
        return out if held is None else out.add_(held)

    # -- eager fallback of the graph markers ------------------------------------------------
    def local_shape(self, key: int) -> tuple[int, ...]:
        return self.marker_layouts[key].local_shape(self.rank)

    def unshard_eager(self, shard: torch.Tensor, key: int) -> torch.Tensor:
        """All-gather one parameter outside a graph. ``shard``: (local_rows, *rest) -> full shape,
        in ``param_dtype`` (cast before sending, as the graphs' copy-in does)."""
        layout = self.marker_layouts[key]
        if (self.gather_quantization is not None and layout.sharded and self.world_size > 1
                and quantizes([layout.shard_numel], layout.param_dtype)):
            return self._unshard_quantized_eager(shard, key)
        shard = shard.to(layout.param_dtype)
        if not layout.sharded or self.world_size == 1:
            return shard.clone()
        padded = _pad_rows(shard, layout.chunk_rows)
        gathered = shard.new_empty((self.world_size * layout.chunk_rows, *layout.shape[1:]))
        self._eager("all_gather", key,  # bool as bytes, complex as reals (to_wire)
                    lambda: all_gather_single(to_wire(gathered.view(-1)), to_wire(padded.reshape(-1)), group=self.group))
        self.current.add("all_gather", gathered.numel(), gathered.element_size(), self.world_size)
        return gathered[: layout.shape[0]].clone()

    def _unshard_quantized_eager(self, shard: torch.Tensor, key: int) -> torch.Tensor:
        """``unshard_eager`` with ``gather_quantization``: the graphs' quantized copy-in, all-gather of
        bytes and dequantizing copy-out (``passes/insert_allgather.py``), for one parameter."""
        layout = self.marker_layouts[key]
        send = PACK_QUANTIZED([shard], [layout.chunk_rows], 1, layout.param_dtype, BLOCK)  # (rank_bytes,) uint8
        gathered = send.new_empty(self.world_size * send.numel())
        self._eager("all_gather", key, lambda: all_gather_single(gathered, send, group=self.group))
        self.current.add("all_gather", gathered.numel(), gathered.element_size(), self.world_size)
        return UNPACK_DEQUANTIZED(gathered, self.world_size, [layout.chunk_rows], [layout.shape[0]],
                                  [layout.row_numel], layout.param_dtype, BLOCK).view(layout.shape)

    def reduce_grad_eager(self, grad: torch.Tensor, key: int, grad_mode: str = GRAD_SYNC) -> torch.Tensor:
        """Average one full gradient across ranks outside a graph: reduce-scatter to this rank's
        shard (stages 1-3) or all-reduce (stage 0), in ``reduce_dtype``. ``grad``: full shape ->
        local shard shape in the parameter's dtype. ``grad_mode`` as ``ops.reduce_grad``'s (at world
        size 1 nothing is worth keeping: every mode hands the gradient straight to the shard)."""
        layout = self.marker_layouts[key]
        self.backward_ran = True
        if self.dp_size == 1:
            return grad.to(layout.reduce_dtype).to(layout.dtype, copy=True)
        if grad_mode == GRAD_ACCUMULATE:
            return self.accumulate_unsynced(grad, key)
        grad = self.take_unsynced(grad, key) if grad_mode == GRAD_FLUSH else grad.to(layout.reduce_dtype)
        if not layout.sharded:
            out = grad.contiguous().clone()
            self._eager("all_reduce", key, lambda: dist.all_reduce(out, group=self.group))
            self.current.add("all_reduce", out.numel(), out.element_size(), self.world_size)
            self._all_reduce_replicas(out, key)
            return out.div_(self.dp_size).to(layout.dtype)
        if (self.reduce_quantization is not None and grad.dtype in QUANTIZABLE_DTYPES
                and quantizes([layout.shard_numel], layout.reduce_dtype)):
            return self._reduce_quantized_eager(grad, key)
        padded = _pad_rows(grad, self.world_size * layout.chunk_rows)
        out = grad.new_empty((layout.chunk_rows, *layout.shape[1:]))
        # complex as reals (to_wire): Python's reduce_scatter_tensor, unlike all_reduce, does not view it so
        self._eager("reduce_scatter", key, lambda: dist.reduce_scatter_tensor(
            to_wire(out.view(-1)), to_wire(padded.reshape(-1)), group=self.group))
        self.current.add("reduce_scatter", padded.numel(), padded.element_size(), self.world_size)
        self._all_reduce_replicas(out, key)
        return out[: layout.rank_rows[self.rank]].div_(self.dp_size).to(layout.dtype, copy=True)

    def reached_on_any_rank(self, reached: list[bool], key: int) -> list[bool]:
        """For each of a unit's parameters, whether its gradient reached the loss on any rank
        (``reached`` is this rank's answer): one small all-reduce (max) over every data-parallel
        rank, so that ranks whose data took other paths through a unit still reduce the same
        gradients, and a parameter no rank reached keeps ``.grad`` ``None`` as in eager. ``key``
        names the collective in errors."""
        flags = torch.tensor(reached, dtype=torch.uint8, device=self.device)  # on the device NCCL needs
        if self.dp_size > 1:
            self._eager("all_reduce", key, lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.world_group))
            self.current.add("all_reduce", flags.numel(), flags.element_size(), self.dp_size)
        return [bool(flag) for flag in flags.tolist()]

    def _all_reduce_replicas(self, out: torch.Tensor, key: int) -> None:
        """Hybrid sharding: sum ``out`` (a reduced shard, in place) over the replicate group."""
        if self.replicate_group is None:
            return
        self._eager("all_reduce", key, lambda: dist.all_reduce(to_wire(out.view(-1)), group=self.replicate_group))
        self.current.add("all_reduce", out.numel(), out.element_size(), self.replicate_size, REPLICATE_DIM)

    def comm_dim(self, group_name: str) -> tuple[str, int]:
        """``(mesh dim, group size)`` of the group a graph's collective names: the replicate dim
        for the replicate group, else the shard dim (the model's group; a 1-D mesh's only dim)."""
        if group_name is not None and group_name == self.replicate_group_name:
            return REPLICATE_DIM, self.replicate_size
        if group_name is not None and group_name == self.secondary_group_name:
            return SECONDARY_DIM, self.secondary_size
        if group_name is not None and group_name != self.group_name:  # P_a's activation group
            if group_name not in self._group_sizes:
                self._group_sizes[group_name] = dist.get_world_size(_resolve_process_group(group_name))
            return SHARD_DIM, self._group_sizes[group_name]
        return SHARD_DIM, self.world_size

    def _reduce_quantized_eager(self, grad: torch.Tensor, key: int) -> torch.Tensor:
        """``reduce_grad_eager`` with ``reduce_quantization``: the graphs' quantized all-to-all and
        fp32 sum (``passes/insert_reduce_scatter.py``), for one parameter."""
        layout, n = self.marker_layouts[key], self.world_size
        send = PACK_QUANTIZED([grad], [layout.chunk_rows], n, layout.reduce_dtype, BLOCK)  # (N * rank_bytes,) uint8
        received = torch.empty_like(send)
        self._eager("reduce_scatter", key, lambda: dist.all_to_all_single(received, send, group=self.group))
        self.current.add("reduce_scatter", send.numel(), send.element_size(), n)
        out = DEQUANTIZE_SUM(received, n, [layout.chunk_rows], [layout.row_numel], layout.reduce_dtype, BLOCK)
        out = out.view(layout.chunk_rows, *layout.shape[1:])
        self._all_reduce_replicas(out, key)  # hybrid sharding: fp32, unquantized, across replicas
        return out[: layout.rank_rows[self.rank]].div_(self.dp_size).to(layout.dtype, copy=True)

    def _eager(self, kind: str, key: int, collective: Callable[[], Any]) -> None:
        """Run one eager collective; a communication failure becomes a ``CollectiveError`` naming
        it (as ``run_graph`` does for graphs), chaining gloo's or NCCL's error."""
        start = time.monotonic()
        try:
            collective()
        except RuntimeError as exc:
            if not is_communication_failure(exc):
                raise
            self.check_group()
            raise CollectiveError(
                f"rank {self.rank}: the eager {kind} of {self.marker_layouts[key].fqn!r} (run outside a graph: Dynamo fell "
                f"back to eager for this frame) failed after {time.monotonic() - start:.1f} s. A peer rank probably "
                "died, raised, or is stuck elsewhere: check the other ranks' logs. Eager collectives wait the "
                f"process group's timeout. Cause: {type(exc).__name__}: {exc}") from exc


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - t.shape[0]
    if missing == 0:
        return t.contiguous()
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])
