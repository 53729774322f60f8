"""Agreement across ranks on what each graph communicates, and errors instead of hangs.

Each lowered graph's communication schedule (its functional collectives in order, ``schedule_of``)
is read once; before every call the ranks compare a digest of it (``ScheduleCheck.check_schedule``:
one 16-byte all-gather), so ranks about to run different collectives raise
``ScheduleMismatchError`` naming the first difference instead of hanging in it; a communication
failure inside a graph becomes a ``CollectiveError`` naming the graph (``ScheduleCheck.run_graph``).

Layer: execution.

Source: the fingerprint check of ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (c10d's ``ProcessGroupWrapper``).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import CollectiveError, ScheduleMismatchError
from ..graph.vocab import COLLECTIVE_KINDS, TAG, all_gather_single, full_buffer
from ..shard.sharding import Unit
from .topology import Topology


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
    return schedule_from(entries, graph_kind, label)


def schedule_from(entries: Sequence[ScheduleEntry], graph_kind: str, label: str) -> CommSchedule:
    """The schedule of ``entries`` run in this order, with its digest: a graph's (``schedule_of``)
    or the collectives an island runs outside every graph (``unit_islands``)."""
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


class ScheduleCheck:
    """The schedule check of one compiled model on this rank.

    ``timeout_s`` (seconds) bounds the wait of the check; ``device`` holds its tensors (CPU for
    gloo, the rank's GPU for NCCL); ``units`` name the collectives in errors.
    """

    def __init__(self, topology: Topology, units: Sequence[Unit], timeout_s: float, device: torch.device):
        self.topology = topology
        self.units = units
        self.timeout_s = timeout_s
        self.device = device
        self._graphs_seen = 0

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
        size = dist.get_world_size(self.topology.world_group)  # every rank of the mesh: replicas must agree too
        if size == 1 or not schedule.entries or self.topology.fake_world:
            return
        self.topology.check_in_step()
        mine = torch.tensor([schedule.digest, len(schedule.entries)], dtype=torch.int64, device=self.device)
        everyone = torch.empty(size * 2, dtype=torch.int64, device=self.device)  # (N * 2,)
        start = time.monotonic()
        try:
            work = all_gather_single(everyone, mine, group=self.topology.world_group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            what = f"the schedule check before {schedule.label}"
            self.topology.mark_out_of_step(f"{what}: {type(exc).__name__}")
            raise CollectiveError(self.failure_message(what, schedule, exc, time.monotonic() - start)) from exc
        digests = everyone.view(size, 2)[:, 0].tolist()
        if any(d != digests[0] for d in digests):
            self._raise_mismatch(schedule, digests)

    def _raise_mismatch(self, schedule: CommSchedule, digests: list[int]) -> None:
        """Every rank saw the same digests, so every rank comes here and raises the same message."""
        peers: list = [None] * len(digests)
        try:  # the error path only: the full schedules, to name the difference
            dist.all_gather_object(peers, (schedule.label, schedule.entries), group=self.topology.world_group)
        except RuntimeError as exc:
            what = "exchanging schedules after a mismatch"
            self.topology.mark_out_of_step(f"{what}: {type(exc).__name__}")
            raise CollectiveError(self.failure_message(what, schedule, exc, 0.0)) from exc
        other = next(r for r, d in enumerate(digests) if d != digests[0])
        same = [r for r, d in enumerate(digests) if d == digests[0]]
        raise ScheduleMismatchError(self._describe_mismatch(peers[0], other, peers[other])
                                    + f" (ranks with rank 0's schedule: {same}; this is rank "
                                    f"{dist.get_rank(self.topology.world_group)})")

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
                "the default, such a unit runs eagerly, gathered once on entry, and the ranks stay in step, "
                "as does a module above units whose loop over the data calls them (experts made units under "
                "a router that loops over the experts that got tokens): it runs eagerly, every parameter below "
                "it gathered once on entry. Config(unit_templates=False) does neither: leave it at the default"
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
        return (f"rank {self.topology.rank}: {what} failed after {waited_s:.1f} s; the graph's first collective is "
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
            self.topology.check_group()  # a group destroyed between forward and backward: say so, not "Could not resolve"
            if not is_communication_failure(exc):
                raise
            what = f"a collective of {schedule.label}"
            self.topology.mark_out_of_step(f"{what}: {type(exc).__name__}")
            raise CollectiveError(self.failure_message(what, schedule, exc, time.monotonic() - start)) from exc
