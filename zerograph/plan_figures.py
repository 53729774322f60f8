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


def step_peak_breakdown(stage: int, sizes: UnitSizes, p_bytes: int, prefetch_depth: int, bucket_bytes: int | None,
                        model_states: int, activations: int | None) -> dict[str, int]:
    """``Plan.step_peak_breakdown``: ``model_states`` as given (totals, padding and hpZ's partition),
    the gathered parameters alive at once, the gradient buckets and the activations (0 when unknown)."""
    others_first = sorted(sizes.padded[1:], reverse=True)
    gathered = 0  # stages 1-2: the compute copy is in the model states; stage 0 holds nothing else
    if stage == 3:  # the root unit, and the one computing with those prefetched
        gathered = (sizes.padded[0] + sum(others_first[: prefetch_depth + 1])) * p_bytes
    buckets = 0
    if stage >= 2:  # the unit producing its gradients and the one being reduce-scattered
        largest_first = sorted(sizes.padded, reverse=True)
        buckets = 2 * bucket_bytes if bucket_bytes is not None else sum(largest_first[:2]) * p_bytes
    return {"model_states": model_states, "gathered_params": gathered, "gradient_buckets": buckets,
            "activations": activations or 0}
