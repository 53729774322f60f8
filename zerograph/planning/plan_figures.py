"""The figures of a ``zerograph.Plan``: ZeRO's per-rank memory, communication and step peak, from
the units' element counts.

Plain arithmetic on numbers, nothing read from a model: ``plan.py`` checks the arguments, finds the
units and their parameters' shapes, and calls these in turn. The formulas and their sources (the
ZeRO paper, arXiv 1910.02054, sections 5 and 7) are in plan.py's module docstring; what each figure
means, in ``Plan``'s. ``N`` is the shard group's size, ``P`` the bytes of one parameter or gradient,
``K`` those of one parameter's optimizer state.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class UnitSizes:
    """Elements per unit, the root unit first.

    Attributes:
        numel: each unit's parameters' elements.
        padded: the same as sharded on ``N`` ranks: each parameter's rows padded to a multiple of
            ``N`` (``Shard(0)`` in chunks of ``ceil(rows / N)``); ``numel`` where not padded.
        pad_elements: ``sum(padded) - sum(numel)``.
    """

    numel: list[int]
    padded: list[int]
    pad_elements: int

    @property
    def psi(self) -> int:
        """Ψ, every unit's parameters' elements."""
        return sum(self.numel)


def unit_sizes(n_units: int, params: Sequence[tuple[int, tuple[int, ...]]], n: int, pad: bool) -> UnitSizes:
    """Sum ``(unit index, shape)`` per parameter into ``n_units`` units, padding rows to ``n`` when ``pad``."""
    numel, padded, pad_elements = [0] * n_units, [0] * n_units, 0
    for unit, shape in params:
        rows, row_numel = shape[0], math.prod(shape[1:])
        full = rows * row_numel
        sharded = n * -(-rows // n) * row_numel if pad else full
        numel[unit] += full
        padded[unit] += sharded
        pad_elements += sharded - full
    return UnitSizes(numel, padded, pad_elements)


def optimizer_bytes_per_param(param_dtype: torch.dtype, master_dtype: torch.dtype, n_buffers: int) -> int:
    """K: a master copy when ``master_dtype`` differs from ``param_dtype``, and ``n_buffers`` buffers, in ``master_dtype``."""
    master_bytes = master_dtype.itemsize
    return (master_bytes if master_dtype != param_dtype else 0) + n_buffers * master_bytes


def model_state_bytes(stage: int, n: int, psi: int, p_bytes: int, k_bytes: int) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer states (section 5), each sharded term rounded up."""

    def share(per_param: int, sharded: bool) -> int:
        return -(-per_param * psi // n) if sharded else per_param * psi

    memory = {"params": share(p_bytes, stage >= 3), "grads": share(p_bytes, stage >= 2),
              "optimizer_states": share(k_bytes, stage >= 1)}
    memory["total"] = sum(memory.values())
    return memory


def comm_elements(stage: int, n: int, replicas: int, psi: int) -> dict[str, int]:
    """Elements of the full tensor moved per step, per collective kind (section 7)."""
    comm = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if stage == 0:
        comm["all_reduce"] = 2 * psi
    else:
        comm["reduce_scatter"] = psi
        comm["all_gather"] = (2 if stage == 3 else 1) * psi
    if replicas > 1:  # each rank's reduced gradient shard, all-reduced across the replicas
        comm["all_reduce"] = 2 * -(-psi // n)
    comm["total"] = sum(comm.values())
    return comm


def comm_bytes_per_dim(stage: int, shards: int, replicas: int, unit_padded: list[int], itemsize: int,
                       secondary_partition_size: int | None = None) -> dict[str, dict[str, int]]:
    """Bytes one rank sends per step per mesh dim, one collective per unit (``Plan.comm_bytes_per_dim``)."""

    def ring(numel: int, group: int) -> int:  # one all-gather / reduce-scatter of a full buffer
        return numel * itemsize * (group - 1) // group

    units = [u for u in unit_padded if u]
    shard = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if stage == 0:
        shard["all_reduce"] = sum(ring(2 * u, shards) for u in units)
    else:
        shard["all_gather"] = (2 if stage == 3 else 1) * sum(ring(u, shards) for u in units)
        shard["reduce_scatter"] = sum(ring(u, shards) for u in units)
    out = {"shard": shard}
    if replicas > 1:
        out["replicate"] = {"all_gather": 0, "reduce_scatter": 0,
                            "all_reduce": sum(ring(2 * (u // shards), replicas) for u in units)}
    if secondary_partition_size:  # hpZ: backward re-gathers inside the node
        shard["all_gather"] -= sum(ring(u, shards) for u in units)
        out["secondary"] = {"all_gather": sum(ring(u, secondary_partition_size) for u in units),
                            "reduce_scatter": 0, "all_reduce": 0}
    return out


def overhead_bytes(stage: int, n: int, sizes: UnitSizes, p_bytes: int, k_bytes: int, params_bytes: int,
                   prefetch_depth: int, bucket_bytes: int | None,
                   secondary_partition_size: int | None) -> dict[str, int]:
    """What the paper's formulas leave out, bytes per rank: ``"padding"`` (uneven shards, once per
    sharded state), ``"inflight_gather"``, ``"bucket"`` and hpZ's ``"secondary_partition"``, as
    ``Plan``'s fields of those names say. ``params_bytes``: the model states' ``"params"``."""
    sharded_bytes = {0: 0, 1: k_bytes, 2: p_bytes + k_bytes, 3: 2 * p_bytes + k_bytes}[stage]
    largest_first = sorted(sizes.padded, reverse=True)
    if stage == 3:
        inflight = sum(largest_first[: prefetch_depth + 1]) * p_bytes
    else:
        inflight = params_bytes if stage in (1, 2) else 0
    bucket = 0
    if stage >= 2:
        bucket = bucket_bytes if bucket_bytes is not None else (largest_first[0] if largest_first else 0) * p_bytes
    secondary = -(-sum(sizes.padded) * p_bytes // secondary_partition_size) if secondary_partition_size else 0
    return {"padding": -(-sizes.pad_elements * sharded_bytes // n), "inflight_gather": inflight, "bucket": bucket,
            "secondary_partition": secondary}


PEAK_PHASES = ("forward", "backward_start", "backward")
"""The phases of a training step whose live bytes ``step_peak_phases`` sums, in step order."""


def step_peak_phases(stage: int, sizes: UnitSizes, p_bytes: int, prefetch_depth: int, bucket_bytes: int | None,
                     model_states: int, activations: int | None) -> dict[str, dict[str, int]]:
    """``Plan.step_peak_phases``: per phase of ``PEAK_PHASES``, the bytes alive on one rank by part:
    ``model_states`` as given (held all step), ``gathered_params`` and ``full_gradients`` (full,
    unsharded, padded, ``p_bytes`` each) as the stage's schedule holds them then, and the saved
    ``activations`` (0 when unknown; all of them alive at each phase's start).

    The schedule (``passes/prefetch``, ``insert_reduce_scatter``, the releases after last use):
    forward gathers the root (used first and last) and runs the blocks with ``prefetch_depth``
    units gathered ahead; backward gathers the root again, unpacks it (the rank-major gathered
    buffer and its parameter-major copy alive together) and starts with the head, whose gradient
    is the root's, reduce-scattered only after the embedding's at backward's end; then each unit
    runs with ``prefetch_depth`` units gathered ahead, its gradient one flat buffer filled in place
    as each parameter's is computed (``unit_flat_grad``) and reduce-scattered as it is; with a
    ``bucket_bytes`` given, also the bucket the gradients are copied into (both alive at the copy).
    """
    root = sizes.padded[0] * p_bytes
    blocks = sorted((b * p_bytes for b in sizes.padded[1:]), reverse=True)
    inflight = sum(blocks[: prefetch_depth + 1])  # the unit computing and those prefetched
    largest = blocks[0] if blocks else 0
    bucket = bucket_bytes or 0
    sharded_params, sharded_grads = stage == 3, stage >= 2  # below, the full copies are model states

    def phase(gathered: int, grads: int) -> dict[str, int]:
        return {"model_states": model_states, "gathered_params": gathered if sharded_params else 0,
                "full_gradients": grads if sharded_grads else 0, "activations": activations or 0}

    return {"forward": phase(root + inflight, 0),
            "backward_start": phase(2 * root, root),
            "backward": phase(inflight, root + largest + bucket)}
