"""Run-time state: process group, shard layouts, eager collectives and step accounting.

The runtime never rewrites graphs. It owns what the compiled graphs need at run time: the process
group they name, the layouts the markers' fake implementations read, the eager fallback used when a
frame runs outside a graph (a graph break), and the per-step communication counters.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .sharding import ParamLayout, Unit

# Markers carry an int key; this maps it back to its layout and runtime. Keys are handed out in
# compile order, so every rank that compiles the same models in the same order agrees on them.
_LAYOUTS: dict[int, ParamLayout] = {}
_RUNTIME_OF_KEY: dict[int, "weakref.ReferenceType[Runtime]"] = {}
_KEYS = itertools.count()

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def next_key() -> int:
    return next(_KEYS)


def layout_of(key: int) -> ParamLayout:
    return _LAYOUTS[key]


def runtime_of(key: int) -> "Runtime":
    runtime = _RUNTIME_OF_KEY[key]()
    assert runtime is not None, f"marker key {key} outlived its model"
    return runtime


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

    def add(self, kind: str, full_numel: int, itemsize: int, world_size: int) -> None:
        factor = 2 if kind == "all_reduce" else 1
        self.elements[kind] += factor * full_numel
        self.bytes[kind] += factor * full_numel * itemsize * (world_size - 1) // world_size

    def merge(self, other: "CommCounter") -> None:
        for kind in COLLECTIVES:
            self.elements[kind] += other.elements[kind]
            self.bytes[kind] += other.bytes[kind]


class Runtime:
    """Per-compiled-model run-time state on this rank."""

    def __init__(self, group: dist.ProcessGroup, stage: int, layouts: list[ParamLayout], units: list[Unit]):
        self.group = group
        self.group_name = group.group_name
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stage = stage
        self.layouts = {layout.key: layout for layout in layouts}
        self.units = units
        self.current = CommCounter()
        self.last: CommCounter | None = None
        self.backward_ran = False
        self.graph_memory: list[dict] = []  # per captured graph: {'forward'|'backward': liveness.Timeline}
        for layout in layouts:
            _LAYOUTS[layout.key] = layout
            _RUNTIME_OF_KEY[layout.key] = weakref.ref(self)

    # -- step accounting -------------------------------------------------------------------
    def start_forward(self) -> None:
        """A forward after a finished backward opens a new step."""
        if self.backward_ran:
            self.last, self.current, self.backward_ran = self.current, CommCounter(), False

    def finished_step(self) -> CommCounter:
        return self.current if self.backward_ran or self.last is None else self.last

    # -- eager fallback of the graph markers ------------------------------------------------
    def local_shape(self, key: int) -> tuple[int, ...]:
        return self.layouts[key].local_shape(self.rank)

    def unshard_eager(self, shard: torch.Tensor, key: int) -> torch.Tensor:
        """All-gather one parameter outside a graph. ``shard``: (local_rows, *rest) -> full shape."""
        layout = self.layouts[key]
        if not layout.sharded or self.world_size == 1:
            return shard.clone()
        padded = _pad_rows(shard, layout.chunk_rows)
        gathered = shard.new_empty((self.world_size * layout.chunk_rows, *layout.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded, group=self.group)
        self.current.add("all_gather", gathered.numel(), gathered.element_size(), self.world_size)
        return gathered[: layout.shape[0]].clone()

    def reduce_grad_eager(self, grad: torch.Tensor, key: int) -> torch.Tensor:
        """Average one full gradient across ranks outside a graph: reduce-scatter to this rank's
        shard (stages 1-3) or all-reduce (stage 0). ``grad``: full shape -> local shard shape."""
        layout = self.layouts[key]
        self.backward_ran = True
        if self.world_size == 1:
            return grad.clone()
        if not layout.sharded:
            out = grad.contiguous().clone()
            dist.all_reduce(out, group=self.group)
            self.current.add("all_reduce", out.numel(), out.element_size(), self.world_size)
            return out.div_(self.world_size)
        padded = _pad_rows(grad, self.world_size * layout.chunk_rows)
        out = grad.new_empty((layout.chunk_rows, *layout.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=self.group)
        self.current.add("reduce_scatter", padded.numel(), padded.element_size(), self.world_size)
        return out[: layout.rank_rows[self.rank]].div_(self.world_size).clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - t.shape[0]
    if missing == 0:
        return t.contiguous()
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])
