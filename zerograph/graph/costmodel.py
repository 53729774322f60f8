"""How long a graph node or a collective takes on one rank: roofline compute, alpha-beta collectives.

The scheduling passes and ``zerograph.report.timeline.predict`` ask this model, never a hard-coded guess
(DESIGN.md, "decisions that depend on sizes and speeds come from a cost model"). ``calibrate``
measures the model on the machine at hand; ``to_dict`` / ``from_dict`` describe another cluster as
JSON (the benchmark's ``--simulate``). Hardware rates are written in one place, the cluster table
``clusters.json`` (``CLUSTERS_FILE``): ``cluster_cost_model`` reads an entry of it, and
``nominal_cost_model`` is the entry ``NOMINAL_CLUSTER``, which prices what a decision needs when no
model is given (the activation plan's default).

Sources: the alpha-beta (latency-bandwidth) model of collectives (Hockney 1994; Thakur et al.,
"Optimization of Collective Communication Operations in MPICH", 2005); the roofline model
(Williams et al., CACM 2009); FLOPs from ``torch.utils.flop_counter``, the formulas
``FlopCounterMode`` uses.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13 names it hint_int
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint
from torch.utils.flop_counter import flop_registry

from ..errors import ConfigError
from .vocab import COLLECTIVE_KINDS as COLLECTIVE_OPS  # the ops the passes insert
from .vocab import WAIT, full_buffer

COLLECTIVE_KINDS = tuple(dict.fromkeys(COLLECTIVE_OPS.values()))  # all_gather has an out= variant too


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Alpha-beta collectives + roofline compute, per rank.

    Attributes:
        world_size: ranks taking part in every collective (collectives cost 0 at 1).
        flops_per_s: achieved matmul FLOP/s on this device (FLOP/s).
        bytes_per_s: achieved memory bandwidth of a copy, bytes read + written per second.
        op_overhead_s: fixed cost of launching one op (dispatch, kernel launch), seconds.
        collectives: kind in ``COLLECTIVE_KINDS`` -> ``(alpha_s, beta_s_per_byte)``; a collective
            over a full (unsharded) buffer of ``b`` bytes takes ``alpha_s + beta_s_per_byte * b``
            seconds at this ``world_size`` (beta folds in the algorithm's ``(N-1)/N`` factor).
        host_bytes_per_s: bandwidth of the link between device and host memory, one direction,
            bytes/s (what an activation offloaded to the host crosses twice); ``None``: unknown.

    Raises:
        ConfigError: a non-positive rate or world size, a negative overhead/alpha/beta, or an
            unknown collective kind.
    """

    world_size: int
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float
    collectives: dict[str, tuple[float, float]]
    host_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"CostModel.world_size must be >= 1, got {self.world_size}")
        if self.flops_per_s <= 0 or self.bytes_per_s <= 0:
            raise ConfigError(f"CostModel rates must be positive, got flops_per_s={self.flops_per_s}, "
                              f"bytes_per_s={self.bytes_per_s}")
        if self.op_overhead_s < 0:
            raise ConfigError(f"CostModel.op_overhead_s must be >= 0 seconds, got {self.op_overhead_s}")
        for kind, (alpha, beta) in self.collectives.items():
            if kind not in COLLECTIVE_KINDS:
                raise ConfigError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
            if alpha < 0 or beta < 0:
                raise ConfigError(f"collective {kind!r} needs alpha, beta >= 0, got ({alpha}, {beta})")
        if self.host_bytes_per_s is not None and not self.host_bytes_per_s > 0:
            raise ConfigError(f"CostModel.host_bytes_per_s must be positive bytes/s or None, got {self.host_bytes_per_s}")

    def __hash__(self) -> int:  # the generated hash would fail on the dict field; hash its items instead
        return hash((self.world_size, self.flops_per_s, self.bytes_per_s, self.op_overhead_s,
                     tuple(sorted(self.collectives.items())), self.host_bytes_per_s))

    def resized(self, world_size: int) -> "CostModel":
        """This model for a group of ``world_size`` ranks on the same links: alpha kept, beta scaled
        by the ring factor ``(M-1)/M`` over ``(N-1)/N`` (the same bus bandwidth, nccl-tests'
        convention). Itself when the size is its own.

        Raises:
            ConfigError: this model has one rank, so its collectives say nothing about a link.
        """
        if world_size == self.world_size:
            return self
        if self.world_size == 1:
            raise ConfigError(f"a one-rank cost model cannot price collectives over {world_size} ranks: give a "
                              f"model calibrated or described at two ranks or more")
        scale = ((world_size - 1) / world_size) / ((self.world_size - 1) / self.world_size)
        return dataclasses.replace(self, world_size=world_size, collectives={
            kind: (alpha, beta * scale) for kind, (alpha, beta) in self.collectives.items()})

    def collective_time(self, kind: str, full_bytes: int) -> float:
        """Seconds for one collective of ``kind`` over a full (unsharded) buffer of ``full_bytes``.

        0 at world size 1, where every collective degenerates to a local op.

        Raises:
            ConfigError: ``kind`` has no (alpha, beta) in this model.
        """
        if self.world_size == 1:
            return 0.0
        if kind not in self.collectives:
            raise ConfigError(f"cost model has no {kind!r} collective; it knows {sorted(self.collectives)}")
        alpha, beta = self.collectives[kind]
        return alpha + beta * full_bytes

    def node_time(self, node: fx.Node) -> float:
        """Seconds the compute stream spends on one FX node, from its ``meta["val"]`` shapes.

        Roofline: ``max(flops / flops_per_s, bytes / bytes_per_s) + op_overhead_s``. Placeholders,
        outputs, views, ``getitem``, symbolic-int ops and ``wait_tensor`` cost 0; a collective costs
        ``op_overhead_s`` here (its launch; the transfer itself is ``collective_time``).
        """
        if node.op != "call_function" or node.target is WAIT or not isinstance(node.target, torch._ops.OpOverload):
            return 0.0  # operator.getitem and other Python callables only unpack or compute sizes
        if node.target in COLLECTIVE_OPS:
            return self.op_overhead_s
        if is_view(node) or not _tensors(node.meta.get("val")):
            return 0.0
        roofline = max(node_flops(node) / self.flops_per_s, node_bytes(node) / self.bytes_per_s)
        return roofline + self.op_overhead_s

    def to_dict(self) -> dict:
        """A JSON-able description (plain floats and lists); ``from_dict`` reads it back."""
        return {
            "world_size": self.world_size,
            "flops_per_s": self.flops_per_s,
            "bytes_per_s": self.bytes_per_s,
            "op_overhead_s": self.op_overhead_s,
            "collectives": {kind: [alpha, beta] for kind, (alpha, beta) in self.collectives.items()},
            "host_bytes_per_s": self.host_bytes_per_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        """Build a model from ``to_dict``'s layout (e.g. a cluster described in a JSON file).

        Raises:
            ConfigError: a field is missing or out of range.
        """
        missing = {"world_size", "flops_per_s", "bytes_per_s", "op_overhead_s", "collectives"} - set(d)
        if missing:
            raise ConfigError(f"cost model description lacks {sorted(missing)}")
        host = d.get("host_bytes_per_s")
        return cls(world_size=int(d["world_size"]), flops_per_s=float(d["flops_per_s"]),
                   bytes_per_s=float(d["bytes_per_s"]), op_overhead_s=float(d["op_overhead_s"]),
                   collectives={k: (float(a), float(b)) for k, (a, b) in d["collectives"].items()},
                   host_bytes_per_s=None if host is None else float(host))


# ---------------------------------------------------------------------------------------------
# clusters described in a table (clusters.json): the one place hardware rates are written

CLUSTERS_FILE = Path(__file__).parent / "clusters.json"
# the entry whose rates price a decision when no cost model is given (ActivationPolicy.cost_model)
NOMINAL_CLUSTER = "8xH100-nvlink"


def load_cluster_table(path: str | os.PathLike) -> dict[str, dict]:
    """The clusters of a JSON table (keys starting with ``_`` are comments). Raises ``ConfigError``."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the cluster table {path}: {exc}") from exc
    if not isinstance(table, dict) or not all(isinstance(e, dict) for n, e in table.items() if not n.startswith("_")):
        raise ConfigError(f"the cluster table {path} must be a JSON object of cluster name -> object of figures "
                          "(see the packaged clusters.json)")
    return {name: entry for name, entry in table.items() if not name.startswith("_")}


def cluster_figure(entry: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """A number of a cluster entry. Raises ``ConfigError`` naming the field when it is missing
    (without ``default``), not a JSON number (a string or a boolean is refused), or not finite."""
    value = entry.get(key, default)
    if value is None:
        raise ConfigError(f"cluster entry has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"cluster entry's {key!r} must be a finite number, got {value!r}")
    return float(value)


def cluster_rank_count(entry: Mapping[str, Any], key: str) -> int:
    """``nodes`` or ``devices_per_node`` of a cluster entry: a whole number >= 1."""
    value = cluster_figure(entry, key)
    if value < 1 or value != int(value):
        raise ConfigError(f"cluster entry's {key!r} must be a whole number >= 1, got {entry[key]!r}")
    return int(value)


def cluster_bandwidth(entry: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """A bandwidth of a cluster entry, > 0 bytes/s."""
    value = cluster_figure(entry, key, default)
    if value <= 0:
        raise ConfigError(f"cluster entry's {key!r} must be > 0 bytes/s, got {value!r}")
    return value


def ring_collectives(n: int, busbw: float, latency: float) -> dict[str, tuple[float, float]]:
    """``CostModel.collectives`` of a ring of ``n`` ranks at bus bandwidth ``busbw`` (bytes/s)
    and ``latency`` (s), with nccl-tests' factors: (N-1)/N for all-gather and reduce-scatter,
    2(N-1)/N for all-reduce."""
    ring = (n - 1) / n
    return {"all_gather": (latency, ring / busbw), "reduce_scatter": (latency, ring / busbw),
            "all_reduce": (latency, 2 * ring / busbw)}


def cluster_cost_model(entry: Mapping[str, Any]) -> CostModel:
    """``CostModel`` of a cluster entry: alpha = ``latency_s``, beta from the bus bandwidth with
    nccl-tests' factors ((N-1)/N for all-gather and reduce-scatter, 2(N-1)/N for all-reduce), for
    a collective over every rank; ``host_bytes_per_s`` from ``host_link_bytes_per_s`` when the
    entry has it. Raises ``ConfigError`` for an incomplete or invalid entry."""
    n = cluster_rank_count(entry, "nodes") * cluster_rank_count(entry, "devices_per_node")
    busbw = cluster_bandwidth(entry, "bus_bandwidth_bytes_per_s")
    host = cluster_bandwidth(entry, "host_link_bytes_per_s") if "host_link_bytes_per_s" in entry else None
    return CostModel(world_size=n, flops_per_s=cluster_figure(entry, "flops_per_s"),
                     bytes_per_s=cluster_figure(entry, "memory_bytes_per_s"),
                     op_overhead_s=cluster_figure(entry, "op_overhead_s"),
                     collectives=ring_collectives(n, busbw, cluster_figure(entry, "latency_s")), host_bytes_per_s=host)


@functools.lru_cache(maxsize=1)
def nominal_cost_model() -> CostModel:
    """The packaged table's ``NOMINAL_CLUSTER`` entry as a ``CostModel``: the rates a decision is
    priced at when no model is given (every rank must decide alike, so nothing is measured)."""
    return cluster_cost_model(load_cluster_table(CLUSTERS_FILE)[NOMINAL_CLUSTER])


# ---------------------------------------------------------------------------------------------
# what one node does: FLOPs, bytes, collective volume


def is_view(node: fx.Node) -> bool:
    """True when the node's op returns an alias of an input (its schema says ``Tensor(a)``)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def node_flops(node: fx.Node) -> int:
    """FLOPs of one ``call_function`` node (0 for ops without a formula, e.g. elementwise ones).

    Uses the formulas registered in ``torch.utils.flop_counter`` (what ``FlopCounterMode``
    counts: 2 per multiply-add), evaluated on the node's fake input/output values.
    """
    target = node.target
    formula = flop_registry.get(getattr(target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return _as_int(formula(*args, out_val=node.meta.get("val"), **kwargs))


def node_bytes(node: fx.Node) -> int:
    """Bytes one node reads and writes: its tensor inputs plus its outputs (an in-place op's
    output, which aliases its input, is counted once)."""
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    total = sum(tensor_bytes(t) for t in _tensors(inputs))
    schema = getattr(node.target, "_schema", None)
    aliases_input = schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None
    if not aliases_input:
        total += sum(tensor_bytes(t) for t in _tensors(node.meta.get("val")))
    return total


def collective_bytes(node: fx.Node) -> int:
    """Full (unsharded) bytes a collective node moves: the output of an all-gather, the input of a
    reduce-scatter or all-reduce (as ``passes.manager.collective_volume`` counts them)."""
    return tensor_bytes(full_buffer(node))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (a symbolic size counts at its size hint; no guard is added)."""
    return _as_int(t.numel()) * t.element_size()


def _as_int(x: Any) -> int:
    """A concrete int from an int or a SymInt (its size hint; no guard is added)."""
    return optimization_hint(x, fallback=0) if isinstance(x, torch.SymInt) else int(x)


# ---------------------------------------------------------------------------------------------
# calibration on the machine at hand

_MATMUL_N = {"cpu": 256, "cuda": 4096}  # elements per side of the timed square matmul (2 n^3 FLOPs)
_OVERHEAD_OPS = 100      # tiny ops per timing of the per-op overhead
_COLLECTIVE_SIZES = 5    # message sizes per collective kind, geometric from max_bytes / 4096


def calibrate(group: dist.ProcessGroup | None = None, *, max_bytes: int = 4 << 20, repeats: int = 5) -> CostModel:
    """Measure this machine: matmul FLOP/s, copy bandwidth, per-op overhead, collectives.

    Each quantity is the median of ``repeats`` timings after one warm-up: a float32 square matmul,
    a copy of ``max_bytes`` (bandwidth = bytes read + written per second), a loop of 1-element
    ``aten.add`` calls (the overhead of one op called the way the lowered FX graphs call them).
    Collectives are the functional ones the graphs run (``_c10d_functional`` + ``wait_tensor``),
    timed back to back on ``group`` at ``_COLLECTIVE_SIZES`` full sizes up to ``max_bytes``
    (float32); ``fit_alpha_beta`` fits one line per kind. With a group, every rank must call this;
    the timings are agreed by an all-reduce MAX (the slowest rank's) before fitting, so every rank
    returns the same model. ``group=None`` or a one-rank group gives zero-cost collectives. The
    device is CUDA for an NCCL group, else the CPU.

    Source: Inductor decides comm/compute overlap from estimates agreed across ranks
    (``torch/_inductor/comms.py``); the alpha-beta model follows Thakur et al. 2005.

    Raises:
        ConfigError: ``max_bytes`` below 4 KiB or ``repeats`` < 1.
    """
    if max_bytes < 4096 or repeats < 1:
        raise ConfigError(f"calibrate needs max_bytes >= 4096 bytes and repeats >= 1, got {max_bytes}, {repeats}")
    world_size = 1 if group is None else dist.get_world_size(group)
    device = _device_of(group)
    sizes = _message_sizes(max_bytes, world_size)
    n = _MATMUL_N.get(device.type, _MATMUL_N["cpu"])
    timings = [_time_matmul(n, device, repeats), _time_copy(max_bytes, device, repeats),
               _time_op_overhead(device, repeats)]
    if world_size > 1:
        for kind in COLLECTIVE_KINDS:
            timings += [_time_collective(kind, size, group, device, repeats) for size in sizes]
        agreed = torch.tensor(timings, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        timings = agreed.tolist()
    matmul_s, copy_s, overhead_s = timings[:3]
    collectives = {kind: (0.0, 0.0) for kind in COLLECTIVE_KINDS}
    for i, kind in enumerate(COLLECTIVE_KINDS if world_size > 1 else ()):
        seconds = timings[3 + i * len(sizes): 3 + (i + 1) * len(sizes)]
        collectives[kind] = fit_alpha_beta(sizes, seconds)
    return CostModel(world_size=world_size, flops_per_s=2 * n ** 3 / matmul_s,
                     bytes_per_s=2 * max_bytes / copy_s, op_overhead_s=overhead_s, collectives=collectives)


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``seconds ~ alpha + beta * bytes`` with ``alpha, beta >= 0``.

    Residuals are relative (``numpy.polyfit`` weighted by ``1 / seconds``): timing noise grows
    with the time, and an absolute fit would let the largest message decide the latency. A
    negative intercept refits through the origin, a negative slope keeps the mean as alpha.
    Returns ``(alpha_s, beta_s_per_byte)``.
    """
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    w = 1.0 / np.maximum(t, t[t > 0].min(initial=1.0))  # a zero or negative time (noise) weighs as the smallest one
    beta, alpha = np.polyfit(x, t, 1, w=w)
    if beta < 0:
        return float(t.mean()), 0.0
    if alpha < 0:
        xw, tw = x * w, t * w  # through the origin, same relative weighting
        return 0.0, float(xw @ tw / (xw @ xw))
    return float(alpha), float(beta)


def _message_sizes(max_bytes: int, world_size: int) -> list[int]:
    """Full sizes in bytes, geometric up to ``max_bytes``, each divisible into float32 shards."""
    quantum = 4 * world_size
    sizes = np.geomspace(max_bytes / 4096, max_bytes, _COLLECTIVE_SIZES)
    return [max(quantum, int(s) // quantum * quantum) for s in sizes]


def _device_of(group: dist.ProcessGroup | None) -> torch.device:
    """The device a group's collectives run on: CUDA for NCCL, else the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one untimed warm-up run."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # kernels finish before the clock stops
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def _time_matmul(n: int, device: torch.device, repeats: int) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    return _median_time(lambda: torch.mm(a, b, out=out), device, repeats)


def _time_copy(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=device)  # float32
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), device, repeats)


def _time_op_overhead(device: torch.device, repeats: int) -> float:
    x = torch.zeros(1, device=device)
    add = torch.ops.aten.add.Tensor  # an OpOverload, called as the lowered FX graphs call their ops

    def tiny_ops() -> None:
        for _ in range(_OVERHEAD_OPS):
            add(x, x)

    return _median_time(tiny_ops, device, repeats) / _OVERHEAD_OPS


def _time_collective(kind: str, full_bytes: int, group: dist.ProcessGroup, device: torch.device, repeats: int) -> float:
    world_size = dist.get_world_size(group)
    name = group.group_name
    full = torch.ones(full_bytes // 4, device=device)             # (full,) float32
    shard = torch.ones(full.numel() // world_size, device=device)  # (full // world,)
    c10d = torch.ops._c10d_functional
    run = {
        "all_gather": lambda: c10d.all_gather_into_tensor(shard, world_size, name),
        "reduce_scatter": lambda: c10d.reduce_scatter_tensor(full, "sum", world_size, name),
        "all_reduce": lambda: c10d.all_reduce(full, "sum", name),
    }[kind]
    # one barrier, then back-to-back timings: after the untimed warm-up collective the ranks run in
    # lockstep, as in a training step, so no timing includes waiting for a late peer (a barrier
    # before each timing would time the peers' thread wake-ups too)
    dist.barrier(group=group)
    return _median_time(lambda: c10d.wait_tensor(run()), device, repeats)


__all__ = ["CLUSTERS_FILE", "COLLECTIVE_KINDS", "COLLECTIVE_OPS", "NOMINAL_CLUSTER", "CostModel", "calibrate",
           "cluster_cost_model", "collective_bytes", "fit_alpha_beta", "is_view", "load_cluster_table",
           "nominal_cost_model", "node_bytes", "node_flops", "ring_collectives"]
