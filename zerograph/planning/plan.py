"""``zerograph.plan``: how much memory and communication a ZeRO stage costs, before running anything.

The figures follow the ZeRO paper (Rajbhandari et al., arXiv 1910.02054). Model-state memory per
rank (section 5 / Figure 1 / Table 1), with ``Ψ`` parameters, ``N`` ranks, ``P`` bytes per
parameter and per gradient and ``K`` bytes of optimizer state per parameter (12 for mixed-precision
Adam)::

      stage 0 (DDP)        (P + P + K) Ψ
      stage 1 (P_os)       P Ψ + P Ψ + K Ψ / N
      stage 2 (P_os+g)     P Ψ + (P + K) Ψ / N
      stage 3 (P_os+g+p)   (P + P + K) Ψ / N

Communication per step and per rank (section 7), in elements of the full tensor: 2Ψ at stages
0-2 (an all-reduce, or a reduce-scatter and an all-gather), 3Ψ at stage 3 (the all-gather twice).
As separate fields, what the formulas leave out: the padding of uneven shards, the gathered
parameters alive at once under stage 3, the full-size gradient bucket a unit reduce-scatters from.
Nothing is allocated: only parameter shapes are read (never dtypes or values), so a model built
under ``torch.device("meta")`` works. docs/memory.md, section "Planning ahead", has the step peak.

Entry point: ``plan(model, stage, world_size, ...)``, or ``plan(None, stage, world_size, psi=...)``
to reproduce the paper's figures for models too large to build even on ``meta``.
"""
from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..config import STAGES
from ..errors import ConfigError
from ..shard.sharding import ROOT_UNIT, find_units
from .plan_activations import compiled_saved_activation_bytes, saved_activation_bytes  # noqa: F401 (re-exported)
from .plan_figures import (
    UnitSizes,
    comm_bytes_per_dim,
    comm_elements,
    model_state_bytes,
    optimizer_bytes_per_param,
    overhead_bytes,
    step_peak_phases,
    unit_sizes,
)

GB = 10**9
"""The paper's gigabyte (Table 1, Figure 1): 1e9 bytes."""

OPTIMIZER_BUFFERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
"""Optimizer name -> per-parameter state buffers kept in ``master_dtype`` (Adam: ``m`` and ``v``)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-rank model-state memory and per-step communication of one ZeRO configuration.

    Every ``*_bytes`` figure is bytes on one rank; communication is in elements of the full tensor
    (the paper's accounting, section 7). Dict-valued fields are read-only mappings.

    Attributes:
        stage: ZeRO stage, 0 (DDP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p).
        world_size: N, the number of data-parallel ranks.
        psi: Ψ, the number of parameters (tied parameters counted once).
        optimizer: optimizer name the state size was derived from.
        param_dtype: dtype of the compute parameters and of the gradients.
        master_dtype: dtype of the master weights and optimizer buffers.
        param_bytes_per_element: bytes of one parameter (and of one gradient) in ``param_dtype``.
        optimizer_bytes_per_param: K, bytes of optimizer state per parameter (master copy when
            ``master_dtype != param_dtype``, plus the optimizer's buffers in ``master_dtype``).
        prefetch_depth: units gathered ahead of the one computing (stage 3).
        bytes_per_rank: ``"params"``, ``"grads"``, ``"optimizer_states"`` and ``"total"``, bytes per
            rank by the paper's formulas (section 5). A sharded term ``x Ψ / N`` is rounded up to a
            whole byte.
        comm_elements_per_step: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` and
            ``"total"``, elements moved per step (section 7; an all-reduce counts 2Ψ, as a
            reduce-scatter plus an all-gather).
        padding_bytes: bytes per rank that uneven shards add to the sharded states. Each parameter
            is sharded on dim 0 in chunks of ``c = ceil(rows / N)`` rows (``torch.chunk`` /
            ``Shard(0)``), and every rank allocates the padded chunk of ``c * row_numel``
            elements, where the formula charges ``numel / N``. Summed over parameters, the excess
            on one rank is ``(N * c * row_numel - numel) / N`` elements, counted once per sharded
            state in that state's bytes: ``K`` at stage 1, ``P + K`` at stage 2, ``P + P + K`` at
            stage 3 (rounded up to a whole byte). 0 at stage 0 and when built from ``psi``.
        inflight_gather_bytes: stage 3: bytes of the gathered (padded, ``param_dtype``)
            parameters of the ``prefetch_depth + 1`` largest units, the most alive at once.
            Stages 1-2: the full gathered compute copy of all parameters, held for the step;
            it equals ``bytes_per_rank["params"]``, which already counts it, so it is not added
            to ``total_with_overheads``. Stage 0: 0.
        bucket_bytes: stages 2-3: bytes of the largest unit's full (padded, ``param_dtype``)
            gradient, the bucket it reduce-scatters from, or the ``bucket_bytes`` argument when
            given. Stages 0-1: 0 (full gradients are kept and already counted in ``"grads"``).
        total_with_overheads: ``bytes_per_rank["total"] + padding_bytes + bucket_bytes``, plus
            ``inflight_gather_bytes`` at stage 3 and ``secondary_partition_bytes`` with hpZ.
        units: ``(name, parameter count)`` per unit, the root unit (``"<root>"``, parameters
            outside every unit) first, then the units in module order, as ``zerograph.compile``
            groups them.
        replicas: R, the replicate dim of a 2-D mesh (hybrid sharding); 1 without one. Then
            ``world_size`` is the shard dim's S: memory is sharded over S, gradients averaged
            over R x S ranks.
        comm_bytes_per_dim: ``{"shard": {kind: bytes}, "replicate": {kind: bytes}}``, bytes one
            rank sends per step over each mesh dim with ring algorithms, as ``zerograph.stats``
            counts them (``(n-1)/n`` of the full padded buffer per all-gather or reduce-scatter
            over a group of n, twice that per all-reduce; one collective per unit, each rounded
            down to a byte), in ``param_dtype``. Shard dim: stage 0, all-reduce 2Ψ; stages 1-2,
            all-gather Ψ + reduce-scatter Ψ; stage 3, all-gather 2Ψ + reduce-scatter Ψ (Ψ
            padded to S rows each, in bytes of ``param_dtype``, times ``(S-1)/S``). Replicate
            dim (R > 1): all-reduce of this rank's reduced gradient shard, 2 (Ψ/S) (R-1)/R.
            With hpZ, backward's all-gather Ψ moves to a ``"secondary"`` dim: (M-1)/M of it.
        secondary_partition_size: hpZ's M (``Config.secondary_partition_size``), or ``None``.
        secondary_partition_bytes: hpZ: the secondary partition each rank holds from forward to
            backward, 1/M of every unit's padded parameters in ``param_dtype`` (rounded up);
            counted in ``total_with_overheads``. 0 without hpZ.
        activation_bytes: saved activations of one step's compiled forward, estimated from
            ``example_inputs`` (``plan_activations.compiled_saved_activation_bytes``: the min-cut
            partition of the model's joint graph); ``None`` when none were given.
        step_peak_bytes: the predicted peak of bytes alive on one rank during a training step: the
            largest phase of ``step_peak_phases``, the sum of ``step_peak_breakdown``.
        step_peak_phase: the phase of ``step_peak_phases`` the peak falls in.
        step_peak_phases: ``{phase: {part: bytes}}``, the bytes alive at each phase of a step as
            the stage's schedule holds them (``plan_figures.step_peak_phases``), in step order:
            ``"forward"`` (its last units: the root gathered, the ``prefetch_depth + 1`` largest
            units gathered, every activation saved), ``"backward_start"`` (the head: the root
            gathered again and unpacked, two copies, and its gradient, every activation still
            saved) and ``"backward"`` (a unit's backward: ``prefetch_depth + 1`` units gathered;
            the root's gradient, kept until the embedding's joins it at backward's end, and the
            largest unit's, one flat buffer filled in place and reduce-scattered as it is, plus
            the bucket it is copied into when a ``bucket_bytes`` argument is given; the
            activations, at most all). Parts: ``"model_states"`` (``bytes_per_rank["total"] + padding_bytes``,
            plus hpZ's secondary partition: every gradient shard counted, as under gradient
            accumulation), ``"gathered_params"`` (stage 3: full, padded, in ``param_dtype``),
            ``"full_gradients"`` (stages 2-3: unreduced gradients, full, padded; stages 0-1 keep
            full gradients in the model states) and ``"activations"`` (``activation_bytes``, 0
            when unknown). Model states at stages 0-2 already hold the full compute copy.
        step_peak_breakdown: the parts of ``step_peak_phases[step_peak_phase]``.
        peak_notes: what the step peak leaves out, one sentence each (e.g. the activations when
            no ``example_inputs`` were given; the gradients of activations in backward always).
    """

    stage: int
    world_size: int
    psi: int
    optimizer: str
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    param_bytes_per_element: int
    optimizer_bytes_per_param: int
    prefetch_depth: int
    bytes_per_rank: Mapping[str, int]
    comm_elements_per_step: Mapping[str, int]
    padding_bytes: int
    inflight_gather_bytes: int
    bucket_bytes: int
    total_with_overheads: int
    units: tuple[tuple[str, int], ...]
    replicas: int = 1
    comm_bytes_per_dim: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    secondary_partition_size: int | None = None
    secondary_partition_bytes: int = 0
    activation_bytes: int | None = None
    step_peak_bytes: int = 0
    step_peak_breakdown: Mapping[str, int] = dataclasses.field(default_factory=dict)
    step_peak_phase: str = ""
    step_peak_phases: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    peak_notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        psi = self.psi
        rows: list[tuple[str, str]] = [
            ("stage", str(self.stage)),
            ("N (world size)", str(self.world_size) if self.replicas == 1 else
             f"{self.world_size * self.replicas} = {self.replicas} replicas x {self.world_size} shards"),
            ("Ψ (parameters)", f"{psi:,}" + (f" ({_sig3(psi / 1e9)}B)" if psi >= 10**8 else "")),
            ("optimizer", f"{self.optimizer}, K = {self.optimizer_bytes_per_param} B/param"),
            ("dtypes", f"param/grad {_dtype_name(self.param_dtype)}, master {_dtype_name(self.master_dtype)}"),
            ("units", str(len(self.units))),
        ]
        for key in ("params", "grads", "optimizer_states", "total"):
            rows.append((f"{key} [GB/rank]", _gb(self.bytes_per_rank[key])))
        rows += [
            ("padding [GB/rank]", _gb(self.padding_bytes)),
            ("in-flight gather [GB/rank]", _gb(self.inflight_gather_bytes)
             + (" (counted in params)" if self.stage in (1, 2) else "")),
            ("gradient bucket [GB/rank]", _gb(self.bucket_bytes)),
        ]
        if self.secondary_partition_size:
            rows.append((f"hpZ secondary partition, 1/{self.secondary_partition_size} [GB/rank]",
                         _gb(self.secondary_partition_bytes)))
        rows += [
            ("total with overheads [GB/rank]", _gb(self.total_with_overheads)),
        ]
        for phase, parts in self.step_peak_phases.items():
            rows.append((f"step at {phase.replace('_', ' ')} [GB/rank]", _gb(sum(parts.values()))))
        for key, value in self.step_peak_breakdown.items():
            rows.append((f"step peak: {key.replace('_', ' ')} [GB/rank]", _gb(value)))
        rows.append((f"step peak, at {self.step_peak_phase.replace('_', ' ')} [GB/rank]", _gb(self.step_peak_bytes)))
        for key in ("all_gather", "reduce_scatter", "all_reduce", "total"):
            rows.append((f"comm {key} [elements]", _in_psi(self.comm_elements_per_step[key], psi)))
        for dim, counts in self.comm_bytes_per_dim.items():
            rows.append((f"comm over {dim} dim [bytes/rank]", f"{sum(counts.values()):,}"))
        width = max(len(name) for name, _ in rows)
        lines = ["zerograph plan (ZeRO, arXiv 1910.02054; GB = 1e9 bytes)"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        lines += [f"  note: {note}" for note in self.peak_notes]
        return "\n".join(lines)


def plan(
    model: nn.Module | None,
    stage: int,
    world_size: int,
    *,
    optimizer: str = "adamw",
    param_dtype: torch.dtype = torch.bfloat16,
    master_dtype: torch.dtype = torch.float32,
    prefetch_depth: int = 1,
    bucket_bytes: int | None = None,
    psi: int | None = None,
    unit_numels: Sequence[int] | None = None,
    unit_classes: tuple[type[nn.Module], ...] | None = None,
    replicas: int = 1,
    secondary_partition_size: int | None = None,
    example_inputs: Sequence[object] | None = None,
) -> Plan:
    """Plan the per-rank memory and per-step communication of ZeRO stage ``stage`` on ``world_size`` ranks.

    Args:
        model: the model, on any device including ``meta`` (only parameter shapes are read; each
            parameter is counted once however often it is tied). ``None`` with ``psi``.
        stage: 0 (DDP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p), paper section 5.
        world_size: N, data-parallel ranks, >= 1.
        optimizer: ``"adamw"`` / ``"adam"`` (two buffers, ``m`` and ``v``), ``"sgd"`` (none) or
            ``"sgd_momentum"`` (one), each in ``master_dtype``.
        param_dtype: dtype of the parameters used in compute and of the gradients (the paper's
            fp16; bf16 by default). The model's own dtypes are ignored.
        master_dtype: dtype of the master weights and optimizer buffers. A master copy is counted
            only when it differs from ``param_dtype`` (fp32 training keeps no second copy).
        prefetch_depth: units gathered ahead of the computing one at stage 3, >= 0.
        bucket_bytes: gradient bucket size in bytes for stages 2-3, overriding the largest unit's
            full gradient; >= 0.
        psi: Ψ, the parameter count, instead of a model, to reproduce the paper's figures
            (``plan(None, 3, 1024, psi=10**12)``). Padding is then 0, since no shapes are known.
        unit_numels: with ``psi`` only: parameter counts of the units (e.g. ``[psi // L] * L``
            for ``L`` equal blocks); the rest of ``psi`` is the root unit. Default: one root unit
            holding all Ψ (a model with no units, gathered whole at stage 3).
        unit_classes: with a model only: module classes whose outermost instances are the units,
            as ``zerograph.Config.unit_classes``; default the blocks of the model's stacks of
            repeated blocks, as ``zerograph.compile`` finds them (``zerograph.shard.units.find_units``).
        replicas: R, the replicate dim of hybrid sharding (``compile(mesh=2-D mesh)``), >= 1;
            ``world_size`` is then the shard dim S. Stages 1-3 only when R > 1.
        secondary_partition_size: hpZ's M (ZeRO++ section 3.2): stage 3 only, a divisor of
            ``world_size`` smaller than it, not with ``replicas`` > 1 (as ``zerograph.compile``).

    Returns:
        A frozen ``Plan``; ``str(plan)`` is a readable table.

    Raises:
        ValueError (``zerograph.ConfigError``): stage not in 0-3, world_size < 1, an unknown
            optimizer, a non-floating dtype, prefetch_depth or bucket_bytes negative, both or
            neither of ``model`` and ``psi``, ``psi`` < 1, ``unit_numels`` / ``unit_classes``
            given for the other mode or summing above ``psi``, or ``example_inputs`` without a
            model or not a sequence.
    """
    stage, world_size, replicas = _check_world(stage, world_size, replicas, secondary_partition_size)
    optimizer, n_buffers = _check_optimizer(optimizer)
    param_dtype, master_dtype = _check_dtype("param_dtype", param_dtype), _check_dtype("master_dtype", master_dtype)
    prefetch_depth = _check_count("prefetch_depth", prefetch_depth, minimum=0)
    if bucket_bytes is not None:
        bucket_bytes = _check_count("bucket_bytes", bucket_bytes, minimum=0)
    unit_names, params = _units(model, psi, unit_numels, unit_classes, example_inputs)
    sizes = unit_sizes(len(unit_names), params, world_size, pad=stage >= 1 and model is not None)
    activations = None
    if example_inputs is not None:
        activations = compiled_saved_activation_bytes(model, example_inputs, param_dtype)
    settings = dict(stage=stage, world_size=world_size, optimizer=optimizer, param_dtype=param_dtype,
                    master_dtype=master_dtype, prefetch_depth=prefetch_depth, replicas=replicas,
                    secondary_partition_size=secondary_partition_size)
    return _plan_of(settings, n_buffers, bucket_bytes, unit_names, sizes, activations)


def _check_world(stage: object, world_size: object, replicas: object,
                 secondary_partition_size: object) -> tuple[int, int, int]:
    """``stage``, ``world_size`` and ``replicas`` checked, and hpZ's M against them (``plan``'s Raises)."""
    stage, world_size = _check_stage(stage), _check_count("world_size", world_size, minimum=1)
    replicas = _check_count("replicas", replicas, minimum=1)
    if replicas > 1 and stage == 0:
        raise ConfigError("replicas > 1 (hybrid sharding) needs stage 1-3: stage 0 replicates everything "
                          "(plan it with world_size = every rank)")
    if secondary_partition_size is not None:
        m = _check_count("secondary_partition_size", secondary_partition_size, minimum=2)
        if stage != 3 or replicas > 1 or world_size % m or m >= world_size:
            raise ConfigError(f"secondary_partition_size (hpZ) needs stage 3, no replicas, and a divisor of "
                              f"world_size {world_size} smaller than it; got {m} at stage {stage} with {replicas} "
                              "replicas")
    return stage, world_size, replicas


def _units(model: nn.Module | None, psi: int | None, unit_numels: Sequence[int] | None,
           unit_classes: tuple[type[nn.Module], ...] | None,
           example_inputs: Sequence[object] | None) -> tuple[list[str], list[tuple[int, tuple[int, ...]]]]:
    """Unit names (root first) and ``(unit index, shape)`` per unique parameter, from the model or,
    without one, from ``psi`` (one flat pseudo-parameter per unit); refuses the other mode's arguments."""
    if model is not None:
        if psi is not None:
            raise ConfigError("give either a model or psi=, not both")
        if unit_numels is not None:
            raise ConfigError("unit_numels= goes with psi=; with a model the units come from its modules")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be an nn.Module or None, got {type(model).__name__}")
        return _model_params(model, unit_classes)
    if psi is None:
        raise ConfigError("give a model, or model=None with psi= (the parameter count)")
    if unit_classes is not None:
        raise ConfigError("unit_classes= needs a model; with psi= give unit_numels=")
    if example_inputs is not None:
        raise ConfigError("example_inputs= needs a model (the activations come from running its forward on fake tensors)")
    return _psi_params(_check_count("psi", psi, minimum=1), unit_numels)


def _plan_of(settings: dict, n_buffers: int, bucket_bytes: int | None, unit_names: list[str], sizes: UnitSizes,
             activations: int | None) -> Plan:
    """The ``Plan`` of checked ``settings`` (``Plan``'s fields of those names) for units of ``sizes``."""
    stage, n, prefetch_depth = settings["stage"], settings["world_size"], settings["prefetch_depth"]
    secondary_partition_size = settings["secondary_partition_size"]
    p_bytes = settings["param_dtype"].itemsize
    k_bytes = optimizer_bytes_per_param(settings["param_dtype"], settings["master_dtype"], n_buffers)
    memory = model_state_bytes(stage, n, sizes.psi, p_bytes, k_bytes)
    comm = comm_elements(stage, n, settings["replicas"], sizes.psi)
    comm_bytes = comm_bytes_per_dim(stage, n, settings["replicas"], sizes.padded, p_bytes, secondary_partition_size)
    extra = overhead_bytes(stage, n, sizes, p_bytes, k_bytes, memory["params"], prefetch_depth, bucket_bytes,
                           secondary_partition_size)
    total_with = (memory["total"] + extra["padding"] + extra["bucket"] + extra["secondary_partition"]
                  + (extra["inflight_gather"] if stage == 3 else 0))
    model_states = memory["total"] + extra["padding"] + extra["secondary_partition"]
    phases = step_peak_phases(stage, sizes, p_bytes, prefetch_depth, bucket_bytes, model_states, activations)
    peak_phase = max(phases, key=lambda name: sum(phases[name].values()))  # the first of equal ones
    notes = [] if activations is not None else [
        "saved activations left out: give example_inputs= (one rank's model inputs, meta tensors will do) "
        "to estimate them"]
    notes.append("left out: the gradients of activations and the temporaries of the op running, a reduce-scatter's "
                 "send buffer a real process group still holds when the next unit's gradients are produced, the "
                 "allocator's slack and the framework's own memory (compiled code, caches)")
    return Plan(
        **settings, psi=sizes.psi, param_bytes_per_element=p_bytes, optimizer_bytes_per_param=k_bytes,
        bytes_per_rank=types.MappingProxyType(memory), comm_elements_per_step=types.MappingProxyType(comm),
        padding_bytes=extra["padding"], inflight_gather_bytes=extra["inflight_gather"], bucket_bytes=extra["bucket"],
        total_with_overheads=total_with, units=tuple(zip(unit_names, sizes.numel)),
        comm_bytes_per_dim=types.MappingProxyType({d: types.MappingProxyType(c) for d, c in comm_bytes.items()}),
        secondary_partition_bytes=extra["secondary_partition"], activation_bytes=activations,
        step_peak_bytes=sum(phases[peak_phase].values()), step_peak_phase=peak_phase,
        step_peak_breakdown=types.MappingProxyType(phases[peak_phase]),
        step_peak_phases=types.MappingProxyType({k: types.MappingProxyType(v) for k, v in phases.items()}),
        peak_notes=tuple(notes))


# ----------------------------------------------------------------------------- parameter discovery


def _model_params(model: nn.Module, unit_classes) -> tuple[list[str], list[tuple[int, tuple[int, ...]]]]:
    """Unit names (root first) and ``(unit index, shape)`` per unique parameter.

    Mirrors ``sharding.shard_module_``: a parameter belongs to the unit of the first module (in
    ``named_modules`` order) that owns it, and modules outside every unit form the root unit.
    A 0-d parameter counts as shape ``(1,)`` (``compile`` asks for that reshape anyway).
    """
    try:
        units = find_units(model, unit_classes)
    except TypeError as exc:  # e.g. unit_classes not a tuple of classes
        raise ConfigError(f"unit_classes must be a tuple of nn.Module subclasses: {exc}") from exc
    owner: dict[int, int] = {}
    for index, (_, unit_mod) in enumerate(units, start=1):
        for mod in unit_mod.modules():
            owner.setdefault(id(mod), index)
    seen: set[int] = set()
    params: list[tuple[int, tuple[int, ...]]] = []
    for _, mod in model.named_modules():
        for param in mod._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            params.append((owner.get(id(mod), 0), tuple(param.shape) or (1,)))
    return [ROOT_UNIT] + [name for name, _ in units], params


def _psi_params(psi: int, unit_numels: Sequence[int] | None) -> tuple[list[str], list[tuple[int, tuple[int, ...]]]]:
    """Units for a bare parameter count: each unit one flat "parameter" (never padded)."""
    if unit_numels is not None and (isinstance(unit_numels, (str, bytes)) or not isinstance(unit_numels, Sequence)):
        raise ConfigError(f"unit_numels must be a sequence of ints, got {type(unit_numels).__name__}")
    counts = [] if unit_numels is None else [_check_count("unit_numels[]", c, minimum=0) for c in unit_numels]
    if sum(counts) > psi:
        raise ConfigError(f"unit_numels sum to {sum(counts):,}, more than psi = {psi:,}")
    all_counts = [psi - sum(counts)] + counts
    return [ROOT_UNIT] + [f"unit{i}" for i in range(1, len(counts) + 1)], [
        (i, (c,)) for i, c in enumerate(all_counts)
    ]


# ----------------------------------------------------------------------------- validation, formatting


def _check_stage(stage: object) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(
            f"stage must be one of {STAGES} (0 = DDP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p), got {stage!r}"
        )
    return stage


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_optimizer(optimizer: object) -> tuple[str, int]:
    if not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZER_BUFFERS:
        raise ConfigError(f"optimizer must be one of {tuple(OPTIMIZER_BUFFERS)}, got {optimizer!r}")
    name = optimizer.lower()
    return name, OPTIMIZER_BUFFERS[name]


def _check_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sig3(value: float) -> str:
    """``value`` to 3 significant digits, without exponent notation (``120``, ``31.4``, ``1.88``)."""
    if value == 0:
        return "0"
    rounded = float(f"{value:.3g}")
    decimals = 2 - math.floor(math.log10(abs(rounded)))
    return f"{rounded:.{max(decimals, 0)}f}"


def _gb(nbytes: int) -> str:
    """GB (1e9 bytes) to 3 significant digits, and the exact byte count."""
    return f"{_sig3(nbytes / GB):<8} ({nbytes:,} bytes)"


def _in_psi(elements: int, psi: int) -> str:
    if elements == 0:
        return "0"
    return f"{elements / psi:g}Ψ" if psi else f"{elements:,}"

