"""What one step communicated on this rank: the runtime's step accounting.

Every graph call adds the volume of its collectives (``capture._account``), every eager
collective what it ran (``eager.py``), into ``StepAccounting.current``; a forward after a finished
backward opens a new step, keeping the finished one as ``last`` (``zerograph.stats`` reads it).

Layer: execution.

Source: ZeRO (arXiv 1910.02054) section 7, the communication volume of each stage.
"""
from __future__ import annotations

import dataclasses

from ..graph.vocab import COLLECTIVES, SHARD_DIM


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


class StepAccounting:
    """The step counters of one compiled model on this rank.

    Attributes:
        current: the step running (or the one just finished, until the next forward).
        last: the step before it, ``None`` before a second step.
        backward_ran: a backward (or an eager reduction) ran since ``current`` opened.
        graph_memory: per captured graph: ``{'forward'|'backward': liveness.Timeline}``.
    """

    def __init__(self) -> None:
        self.current = CommCounter()
        self.last: CommCounter | None = None
        self.backward_ran = False
        self.graph_memory: list[dict] = []

    def start_forward(self) -> None:
        """A forward after a finished backward opens a new step."""
        if self.backward_ran:
            self.last, self.current, self.backward_ran = self.current, CommCounter(), False

    def finished_step(self) -> CommCounter:
        """The last finished step: ``current`` once its backward ran, else ``last``."""
        return self.current if self.backward_ran or self.last is None else self.last
