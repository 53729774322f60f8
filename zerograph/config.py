"""User-facing knobs of ``zerograph.compile``.

``Config`` groups them by concern into the policies of ``zerograph.policies`` (FSDP2's
``MixedPrecisionPolicy`` style): ``mixed_precision``, ``schedule``, ``memory``, ``activations``.
The flat keywords of earlier releases (``Config(bucket_bytes=..., param_dtype=...)``) keep working
as a shorthand that fills the policies, with no deprecation warning: they are what most scripts
and the docs use, one line shorter, and they cannot drift from the policies: they are neither
stored nor defaulted anywhere else (``FLAT_KEYWORDS`` maps each to its policy field, and the
constructor turns them into that policy before the dataclass's own ``__init__`` runs).

Config sits above the passes: it checks ``disabled_passes`` against the passes' contracts when
it is built, so a pipeline that cannot work is refused here, not at the first forward.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Literal

import torch
from torch import nn

from .errors import ConfigError
from .graph.costmodel import CostModel, nominal_cost_model
from .kernels.quantize import QUANTIZATIONS
from .passes.manager import check_disabled_passes
from .policies import ActivationPolicy, MemoryPolicy, MixedPrecisionPolicy, SchedulePolicy, check_module_classes

STAGES = (0, 1, 2, 3)
LOWERINGS = ("auto", "eager", "inductor")
# the passes that only reorder (no effect on what is computed or moved); disable both for the
# "scheduling off" baseline: every collective's wait right after its start
OVERLAP_PASSES = ("prefetch", "schedule_overlap")

# flat keyword -> (Config field holding the policy, the policy's field)
FLAT_KEYWORDS: dict[str, tuple[str, str]] = {
    "param_dtype": ("mixed_precision", "param_dtype"),
    "reduce_dtype": ("mixed_precision", "reduce_dtype"),
    "full_precision_classes": ("mixed_precision", "full_precision_classes"),
    "cast_forward_inputs": ("mixed_precision", "cast_forward_inputs"),
    "bucket_bytes": ("schedule", "bucket_bytes"),
    "prefetch_depth": ("schedule", "prefetch_depth"),
    "max_inflight_bytes": ("schedule", "max_inflight_bytes"),
    "unshard_budget_bytes": ("memory", "unshard_budget_bytes"),
    "reshard_root_after_forward": ("memory", "reshard_root_after_forward"),
    "memory_budget_bytes": ("memory", "budget_bytes"),
    "pool_comm_buffers": ("memory", "pool_comm_buffers"),
    "activation_budget_bytes": ("activations", "budget_bytes"),
    "activation_offload": ("activations", "offload"),
    "activation_group": ("activations", "group"),
    "activation_cost_model": ("activations", "cost_model"),
}
_POLICIES = {"mixed_precision": MixedPrecisionPolicy, "schedule": SchedulePolicy, "memory": MemoryPolicy,
             "activations": ActivationPolicy}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How a model is sharded, scheduled and lowered.

    Build it with policies (``Config(schedule=SchedulePolicy(prefetch_depth=2))``) or with the flat
    keywords of ``FLAT_KEYWORDS`` (``Config(prefetch_depth=2)``); not both for the same policy.

    Attributes:
        unit_classes: module classes whose instances become sharding units (the outermost match
            wins). ``None`` finds the model's stacks of repeated blocks (``nn.ModuleList``,
            ``nn.ModuleDict``, ``nn.Sequential``; several stacks, as an encoder-decoder's or a
            two-tower model's) and makes each block a unit, as FSDP2 users wrap ``fully_shard``
            per block (the rule: ``zerograph.shard.units``). Parameters outside every unit form the root unit.
        lowering: ``"eager"`` runs the transformed FX graphs op by op (fast to compile);
            ``"inductor"`` compiles them with Inductor (C++ on CPU, Triton on GPU). ``"auto"`` (the
            default) is Inductor on CUDA, where its fused Triton kernels are the point of a compiler
            (SimpleFSDP and DeepCompile report their gains from it), and eager on CPU, where
            Inductor's C++ code was no faster on this project's GPT and its cold C++ compiles
            are slow (figures: docs/benchmarks.md, "Compile time").
        timeout_s: seconds a collective may wait for its peers before the process group raises
            (passed to ``init_process_group`` when zerograph creates the group).
        dump_dir: directory to write every graph before and after every pass; ``None`` reads the
            ``ZEROGRAPH_DUMP`` environment variable, and an empty value turns dumping off.
        disabled_passes: exact pass names to skip (for debugging a pipeline, or ``OVERLAP_PASSES``
            for the no-overlap baseline). A pass that a later pass or the pipeline's end requires
            (``insert_allgather``, ``insert_reduce_scatter``) cannot be disabled. Disabling
            ``bucketing`` leaves one collective per parameter.
        mixed_precision: ``MixedPrecisionPolicy`` (param_dtype, reduce_dtype, full_precision_classes).
        schedule: ``SchedulePolicy`` (bucket_bytes, prefetch_depth, max_inflight_bytes).
        memory: ``MemoryPolicy`` (unshard_budget_bytes, reshard_root_after_forward).
        activations: ``ActivationPolicy`` (budget_bytes, offload, group, cost_model).
        gather_quantization: ``None`` (default) all-gathers parameters in ``param_dtype``;
            ``"int8"`` sends each rank's shards as block-wise int8 values plus one fp32 scale per
            256 elements and dequantizes them into ``param_dtype`` after the gather (ZeRO++'s qwZ,
            arXiv 2306.10209 section 3.1): about a quarter of the bytes of fp32, half of bf16.
            A forward approximation: gradients are reduced at full precision and the master
            shards stay exact. Shards of fewer than 256 elements (norms, biases) and parameters
            that are not fp32/bf16/fp16 are gathered unquantized (``zerograph.kernels.quantize``).
        reduce_quantization: ``None`` (default) reduce-scatters gradients in ``reduce_dtype``;
            ``"int8"`` (ZeRO++'s qgZ, section 3.3, in one hop): each rank quantizes every other
            rank's chunk of its full gradients by blocks (int8 + one fp32 scale per 256
            elements), one all-to-all exchanges them, and each rank dequantizes the N chunks of
            its own shard and sums them in fp32. About a quarter of the bytes of an fp32
            reduce-scatter. Small shards and non-float gradients as for ``gather_quantization``.
            Both options are for stages 1-3: ``zerograph.compile`` refuses them at stage 0.
        secondary_partition_size: hpZ (ZeRO++, arXiv 2306.10209 section 3.2; DeepSpeed's
            ``zero_hpz_partition_size``): M, the ranks of a node. Stage 3 then keeps, from
            forward to backward, each rank's 1/M of every unit it re-gathers (groups of M
            consecutive ranks of the model's group), and backward all-gathers the unit over those
            M ranks instead of all N: more memory (1/M of each unit in ``param_dtype``, not 0),
            backward's parameter traffic inside the node. ``None`` (default): plain stage 3.
            Must divide the world size; stage 3 only; not with a 2-D ``mesh`` (``compile``
            raises ``ConfigError``).
        unit_templates: ``True`` traces, partitions and lowers each kind of unit once (units of
            one structure: a transformer's identical blocks) and makes each unit one call of that
            template in the model graph (``zerograph.templates.kinds``); the passes still place every
            unit's all-gather, reduce-scatter, prefetch and release. At every stage (without hpZ or
            quantized collectives) each such unit's shards also live in one flat buffer, one graph
            input and one all-gather marker per unit (``zerograph.shard.flat``), so compile time grows
            much more slowly with depth (figures: docs/benchmarks.md, "Compile time"). Calls take their
            template with keyword arguments, constants and containers of tensors, under autocast;
            where a unit cannot, it runs inline and says so (``strict_templates``). ``False``: the
            per-parameter build, every unit's body traced into the graph (one input and marker per parameter). ``None`` (default):
            ``True``, unless ``activation_budget_bytes`` is set (the activation plan moves a
            unit's activations op by op; a template is one op), then ``False``; the field holds
            the resolved value. ``True`` with ``activation_budget_bytes`` raises ``ConfigError``.
        strict_templates: ``True`` makes every exit of a templated unit from the fast path (a
            call it runs inline, a kind that falls back to inline or to islands, a trace with
            dynamic shapes) raise ``TemplateFallbackError`` naming the kind and the reason, for
            CI that must keep the fast path. ``False`` (default): each reason is logged once per
            kind and counted (``zerograph.explain``: "Unit paths"; ``zerograph.stats``).
        inductor_islands: under the Inductor lowering with templated units, also lower the
            compute between the units' calls (the root's embedding, final norm and loss, their
            gradients, gradients' pre-divides) with Inductor, each distinct island once
            (``zerograph.capture.islands``). ``False`` (default): Inductor lowers the templated bodies,
            what repeats, and the rest runs op by op as ATen, as FSDP2 + ``torch.compile`` per
            block (torchtitan) leaves the root uncompiled; each distinct island costs a cold C++
            compile on CPU, a large share of the first step on the GPT (figures:
            docs/benchmarks.md, "Compile time"). Without templates Inductor lowers the whole
            graph either way. ``True`` with ``lowering="eager"`` raises ``ConfigError``; under
            ``"auto"`` it takes effect where the lowering resolves to Inductor (CUDA).

    Raises:
        ConfigError: a field of the wrong type or range, an unknown keyword, a policy given both
            whole and by a flat keyword, or ``disabled_passes`` naming an unknown or required pass.
    """

    unit_classes: tuple[type[nn.Module], ...] | None = None
    lowering: Literal["auto", "eager", "inductor"] = "auto"
    timeout_s: float = 300.0
    dump_dir: str | None = None
    disabled_passes: tuple[str, ...] = ()
    mixed_precision: MixedPrecisionPolicy = MixedPrecisionPolicy()
    schedule: SchedulePolicy = SchedulePolicy()
    memory: MemoryPolicy = MemoryPolicy()
    activations: ActivationPolicy = ActivationPolicy()
    gather_quantization: str | None = None
    reduce_quantization: str | None = None
    unit_templates: bool | None = None  # resolved by __post_init__: the field then holds a bool
    strict_templates: bool = False
    secondary_partition_size: int | None = None
    inductor_islands: bool = False

    def __post_init__(self) -> None:
        for policy, cls in _POLICIES.items():
            value = getattr(self, policy)
            if not isinstance(value, cls):
                raise ConfigError(f"Config.{policy} must be a zerograph.{cls.__name__}, got {value!r}")
        if self.unit_templates is None:  # the default: templates, except where the activation plan needs ops
            object.__setattr__(self, "unit_templates", self.activations.budget_bytes is None)
        self._check()
        object.__setattr__(self, "activations", _priced(self.activations))

    def _check(self) -> None:
        for field in ("gather_quantization", "reduce_quantization"):
            value = getattr(self, field)
            if value is not None and value not in QUANTIZATIONS:
                raise ConfigError(f"Config.{field} must be one of {(None, *QUANTIZATIONS)}, got {value!r}")
        size = self.secondary_partition_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
            raise ConfigError(f"Config.secondary_partition_size must be None or the ranks of a node, at least 2, "
                              f"got {size!r}")
        for field in ("unit_templates", "inductor_islands", "strict_templates"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"Config.{field} must be True or False, got {getattr(self, field)!r}")
        if self.unit_templates and self.activations.budget_bytes is not None:
            # a template's activations are the outputs of one op: the plan can neither count nor move them
            raise ConfigError("Config.unit_templates with activation_budget_bytes is not supported yet: the "
                              "activation plan prices and moves a unit's activations op by op, and a templated "
                              "unit is one op, so the budget would not hold; use one or the other")
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"Config.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.inductor_islands and self.lowering == "eager":
            raise ConfigError("Config.inductor_islands asks Inductor to lower the compute between units, but "
                              "lowering='eager' runs no Inductor; use lowering='inductor' or 'auto'")
        if self.memory.pool_comm_buffers and self.lowering == "inductor":
            raise ConfigError("Config.pool_comm_buffers pools the eager lowering's comm buffers, but "
                              "lowering='inductor' plans its own buffers; use lowering='eager' or leave the pool off")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ConfigError(f"Config.timeout_s must be positive seconds, got {self.timeout_s!r}")
        cost_model = self.activations.cost_model
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ConfigError(f"Config.activation_cost_model must be a zerograph.graph.costmodel.CostModel or None, "
                              f"got {cost_model!r}")
        if self.unit_classes is not None:
            object.__setattr__(self, "unit_classes", check_module_classes("Config", "unit_classes", self.unit_classes))
        names = self.disabled_passes
        if isinstance(names, str) or not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"Config.disabled_passes must be a tuple of pass names, got {names!r}")
        object.__setattr__(self, "disabled_passes", tuple(names))
        check_disabled_passes(self.disabled_passes)

    def __getattr__(self, name: str) -> Any:
        """Read a flat keyword (``config.bucket_bytes``) from its policy (``config.schedule.bucket_bytes``)."""
        if name in FLAT_KEYWORDS:
            policy, field = FLAT_KEYWORDS[name]
            return getattr(object.__getattribute__(self, policy), field)
        raise AttributeError(f"'Config' object has no attribute {name!r}")

    def resolved_lowering(self, device: torch.device) -> Literal["eager", "inductor"]:
        """The lowering for parameters on ``device``: ``lowering`` itself, or for ``"auto"``
        Inductor on CUDA and eager elsewhere."""
        if self.lowering != "auto":
            return self.lowering
        return "inductor" if torch.device(device).type == "cuda" else "eager"

    def resolved_dump_dir(self) -> str | None:
        return self.dump_dir if self.dump_dir is not None else (os.environ.get("ZEROGRAPH_DUMP") or None)


def _priced(policy: ActivationPolicy) -> ActivationPolicy:
    """``policy`` with a cost model that can price every option it allows: the given model, or
    clusters.json's nominal cluster (``costmodel.nominal_cost_model``) when none is given; a given
    model without a host link rate takes the nominal one's when ``offload`` is on. No budget: as it is.

    Raises:
        ConfigError: an activation group of several ranks with a one-rank model (no link to price).
    """
    if policy.budget_bytes is None:
        return policy
    nominal = nominal_cost_model()
    cost = policy.cost_model if policy.cost_model is not None else nominal
    if policy.offload and cost.host_bytes_per_s is None:
        cost = dataclasses.replace(cost, host_bytes_per_s=nominal.host_bytes_per_s)
    if policy.group is not None and policy.group.size() > 1 and cost.world_size == 1:
        raise ConfigError("Config.activation_cost_model has one rank, so it cannot price P_a's all-gather over "
                          "activation_group: give a model of two ranks or more, or leave it None")
    return policy if cost is policy.cost_model else dataclasses.replace(policy, cost_model=cost)


def _policy_from_flat(policy: str, cls: type, flat: dict[str, Any]) -> Any:
    """Build ``policy`` from the flat keywords that belong to it; its errors name the flat keywords."""
    renames = {f"{cls.__name__}.{field}": f"Config.{name}"
               for name, (owner, field) in FLAT_KEYWORDS.items() if owner == policy}
    fields = {FLAT_KEYWORDS[name][1]: value for name, value in flat.items() if FLAT_KEYWORDS[name][0] == policy}
    try:
        return cls(**fields)
    except ConfigError as exc:
        message = str(exc)
        for old, new in sorted(renames.items(), key=lambda item: -len(item[0])):
            message = message.replace(old, new)
        raise ConfigError(message) from None


_DATACLASS_INIT = Config.__init__


@functools.wraps(_DATACLASS_INIT)
def _init_with_flat_keywords(self: Config, **settings: Any) -> None:
    """``Config``'s constructor: the dataclass's own, after the flat keywords of ``FLAT_KEYWORDS``
    have been turned into the policies they belong to. Every default is the dataclass field's (or
    the policy field's): the flat keywords have none of their own."""
    fields = {f.name for f in dataclasses.fields(Config)}
    for name in settings:
        if name not in fields and name not in FLAT_KEYWORDS:
            raise ConfigError(f"Config got an unknown keyword {name!r}; fields: {sorted(fields | set(FLAT_KEYWORDS))}")
    flat = {name: settings.pop(name) for name in list(settings) if name in FLAT_KEYWORDS}
    for policy in dict.fromkeys(FLAT_KEYWORDS[name][0] for name in flat):
        if policy in settings:
            name = next(n for n in flat if FLAT_KEYWORDS[n][0] == policy)
            raise ConfigError(f"Config got both {policy}= and {name}=; set {name} inside the {policy} policy")
        settings[policy] = _policy_from_flat(policy, _POLICIES[policy], flat)
    _DATACLASS_INIT(self, **settings)


Config.__init__ = _init_with_flat_keywords  # type: ignore[method-assign]


def check_stage_options(config: Config, stage: int, *, hybrid: bool = False) -> None:
    """Refuse, with no model or process group at hand, what ``zerograph.compile`` refuses of
    ``config`` at ``stage`` (``hybrid``: with a 2-D mesh): quantized collectives at stage 0, hpZ
    outside stage 3, with a 2-D mesh or with an activation budget, and a 2-D mesh at stage 0.

    Raises:
        ConfigError: naming the option and what to do.
    """
    if stage == 0 and (config.gather_quantization or config.reduce_quantization):
        raise ConfigError("Config.gather_quantization and reduce_quantization need stage 1-3: they quantize the "
                          "all-gathers and reduce-scatters of stages 1-3, and stage 0 (DDP) all-reduces full "
                          "gradients and gathers nothing; leave them None at stage 0")
    if hybrid and stage == 0:
        raise ConfigError("a 2-D mesh (hybrid sharding) needs stage 1-3: stage 0 (DDP) replicates every parameter, "
                          "so the shard dim has nothing to shard; pass process_group= (or a 1-D mesh) for DDP over "
                          "all ranks")
    if config.secondary_partition_size is None:
        return
    if stage != 3:
        raise ConfigError(f"Config.secondary_partition_size (hpZ) needs stage 3, whose backward re-gathers "
                          f"parameters; stage {stage} keeps them gathered or never gathers them: leave it None")
    if hybrid:
        raise ConfigError("Config.secondary_partition_size (hpZ) and a 2-D mesh (hybrid sharding) do not combine: "
                          "hybrid sharding already keeps every all-gather inside the shard group; use one or the other")
    if config.activations.budget_bytes is not None:
        raise ConfigError("Config.secondary_partition_size (hpZ) with activation_budget_bytes is not supported yet: "
                          "a unit recomputed in backward would read the gathered parameters hpZ releases after "
                          "forward; use one or the other")


def check_stage(stage: object) -> int:
    """Return ``stage`` as an int, or raise ``ConfigError`` naming the valid stages."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(
            f"stage must be one of {STAGES} (0 = DDP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p), got {stage!r}"
        )
    return stage
