"""User-facing knobs of ``zerograph.compile``: ``Config`` and, for the settings that belong
together, the four policies of ``zerograph.policies`` (FSDP2's ``MixedPrecisionPolicy`` style).

Every setting has one spelling: a field of ``Config`` or of one of its policies
(``Config(schedule=SchedulePolicy(prefetch_depth=2))``, read as ``config.schedule.prefetch_depth``).
The flat keywords of earlier releases (``Config(prefetch_depth=2)``, ``config.prefetch_depth``)
still work for this release with a ``DeprecationWarning`` that names the new spelling
(``DEPRECATED_KEYWORDS``); an unknown keyword is a ``TypeError`` listing the fields.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any, Literal

import torch
from torch import nn

from .errors import ConfigError
from .graph.costmodel import CostModel, nominal_cost_model
from .kernels.quantize import QUANTIZATIONS
from .policies import ActivationPolicy, MemoryPolicy, MixedPrecisionPolicy, SchedulePolicy, check_module_classes

STAGES = (0, 1, 2, 3)
LOWERINGS = ("auto", "eager", "inductor")
# the passes that only reorder (no effect on what is computed or moved); disable both for the
# "scheduling off" baseline: every collective's wait right after its start
OVERLAP_PASSES = ("prefetch", "schedule_overlap")

# the flat keyword of earlier releases -> (the Config field holding the policy, the policy's field):
# accepted, and read, with a DeprecationWarning naming the policy's field, for one release
DEPRECATED_KEYWORDS: dict[str, tuple[str, str]] = {
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
POLICIES = {"mixed_precision": MixedPrecisionPolicy, "schedule": SchedulePolicy, "memory": MemoryPolicy,
            "activations": ActivationPolicy}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How ``zerograph.compile`` shards, schedules and lowers a model.

    Each field below says what it does, its unit, default and valid values; the settings that
    belong together are policies (``mixed_precision``, ``schedule``, ``memory``, ``activations``).
    The pages of docs/ tell the story: stages.md (units, templates, lowering), mixed-precision.md,
    memory.md (budgets, activations, the comm buffer pool), hybrid-zeropp.md (hpZ, qwZ, qgZ).

    Raises:
        ConfigError: a field of the wrong type or range, options that do not combine, a policy
            given both whole and by a deprecated flat keyword, or ``disabled_passes`` naming an
            unknown or required pass.
        TypeError: an unknown keyword (the message lists the fields).
    """

    unit_classes: tuple[type[nn.Module], ...] | None = None
    """Module classes whose instances become sharding units (the outermost match wins). ``None``
    (default) finds the model's stacks of repeated blocks (``nn.ModuleList``, ``nn.ModuleDict``,
    ``nn.Sequential``; several stacks, as an encoder-decoder's or a two-tower model's) and makes
    each block a unit, as FSDP2 users wrap ``fully_shard`` per block (the rule:
    ``zerograph.shard.units``). Parameters outside every unit form the root unit. A single class
    is refused: write a tuple."""

    lowering: Literal["auto", "eager", "inductor"] = "auto"
    """How the transformed FX graphs run. ``"eager"``: op by op (fast to compile). ``"inductor"``:
    compiled with Inductor (C++ on CPU, Triton on GPU). ``"auto"`` (default): Inductor on CUDA,
    where its fused Triton kernels are the point of a compiler (SimpleFSDP and DeepCompile report
    their gains from it), and eager on CPU, where Inductor's C++ code was no faster on this
    project's GPT and its cold C++ compiles are slow (figures: docs/benchmarks.md, "Compile time")."""

    timeout_s: float = 300.0
    """Seconds a collective may wait for its peers before the process group raises (passed to
    ``init_process_group`` when zerograph creates the group). Positive; default 300."""

    dump_dir: str | None = None
    """Directory to write every graph to, before and after every pass (docs/inspection.md).
    ``None`` (default) reads the ``ZEROGRAPH_DUMP`` environment variable; an empty value turns
    dumping off."""

    disabled_passes: tuple[str, ...] = ()
    """Exact names of passes to skip, for debugging a pipeline, or ``OVERLAP_PASSES`` for the
    no-overlap baseline. A pass that a later pass or the pipeline's end requires
    (``insert_allgather``, ``insert_reduce_scatter``) cannot be disabled; disabling
    ``bucketing`` leaves one collective per parameter. Default ``()``: every pass runs."""

    mixed_precision: MixedPrecisionPolicy = MixedPrecisionPolicy()
    """Dtypes of the gathered parameters, the gradient reductions and the forward inputs
    (``MixedPrecisionPolicy``: ``param_dtype``, ``reduce_dtype``, ``full_precision_classes``,
    ``cast_forward_inputs``). Default: every parameter's own dtype (no mixed precision)."""

    schedule: SchedulePolicy = SchedulePolicy()
    """When collectives run (``SchedulePolicy``: ``bucket_bytes``, ``prefetch_depth``,
    ``max_inflight_bytes``). Default: one collective per unit, gathered one unit ahead."""

    memory: MemoryPolicy = MemoryPolicy()
    """Which gathered parameters stay alive, the step's memory budget and the comm buffer pool
    (``MemoryPolicy``: ``unshard_budget_bytes``, ``reshard_root_after_forward``, ``budget_bytes``,
    ``pool_comm_buffers``). Default: ZeRO-3 proper, no budget, no pool."""

    activations: ActivationPolicy = ActivationPolicy()
    """Saved activations beyond a budget: recompute, offload, partition (``ActivationPolicy``:
    ``budget_bytes``, ``offload``, ``group``, ``cost_model``). Default: no budget. Given a budget
    without a cost model, ``Config`` fills in clusters.json's nominal one."""

    gather_quantization: str | None = None
    """``None`` (default) all-gathers parameters in ``param_dtype``. ``"int8"`` sends each rank's
    shards as block-wise int8 values plus one fp32 scale per 256 elements and dequantizes them
    into ``param_dtype`` after the gather (ZeRO++'s qwZ, arXiv 2306.10209 section 3.1): about a
    quarter of the bytes of fp32, half of bf16. A forward approximation: gradients are reduced at
    full precision and the master shards stay exact. Shards of fewer than 256 elements (norms,
    biases) and parameters that are not fp32/bf16/fp16 are gathered unquantized
    (``zerograph.kernels.quantize``). Stages 1-3: ``zerograph.compile`` refuses it at stage 0."""

    reduce_quantization: str | None = None
    """``None`` (default) reduce-scatters gradients in ``reduce_dtype``. ``"int8"`` (ZeRO++'s qgZ,
    section 3.3, in one hop): each rank quantizes every other rank's chunk of its full gradients
    by blocks (int8 + one fp32 scale per 256 elements), one all-to-all exchanges them, and each
    rank dequantizes the N chunks of its own shard and sums them in fp32: about a quarter of the
    bytes of an fp32 reduce-scatter. Small shards and non-float gradients as for
    ``gather_quantization``. Stages 1-3: ``zerograph.compile`` refuses it at stage 0."""

    unit_templates: bool | None = None
    """``True`` traces, partitions and lowers each kind of unit once (units of one structure: a
    transformer's identical blocks) and makes each unit one call of that template in the model
    graph (``zerograph.templates.kinds``); the passes still place every unit's all-gather,
    reduce-scatter, prefetch and release. At every stage (without hpZ or quantized collectives)
    each such unit's shards also live in one flat buffer, one graph input and one all-gather
    marker per unit (``zerograph.shard.flat``), so compile time grows much more slowly with depth
    (figures: docs/benchmarks.md, "Compile time"). Calls take their template with keyword
    arguments, constants and containers of tensors, under autocast; where a unit cannot, it runs
    inline and says so (``strict_templates``). ``False``: the per-parameter build, every unit's
    body traced into the graph (one input and marker per parameter). ``None`` (default): ``True``,
    unless ``activations.budget_bytes`` is set (the activation plan moves a unit's activations
    op by op; a template is one op), then ``False``; the field holds the resolved bool. ``True``
    with ``activations.budget_bytes`` raises ``ConfigError``."""

    strict_templates: bool = False
    """``True`` makes every exit of a templated unit from the fast path (a call it runs inline, a
    kind that falls back to inline or to islands, a trace with dynamic shapes) raise
    ``TemplateFallbackError`` naming the kind and the reason, for CI that must keep the fast path.
    ``False`` (default): each reason is logged once per kind and counted (``zerograph.explain``:
    "Unit paths"; ``zerograph.stats``)."""

    secondary_partition_size: int | None = None
    """hpZ (ZeRO++, arXiv 2306.10209 section 3.2; DeepSpeed's ``zero_hpz_partition_size``): M, the
    ranks of a node, at least 2. Stage 3 then keeps, from forward to backward, each rank's 1/M of
    every unit it re-gathers (groups of M consecutive ranks of the model's group), and backward
    all-gathers the unit over those M ranks instead of all N: more memory (1/M of each unit in
    ``param_dtype``, not 0), backward's parameter traffic inside the node. ``None`` (default):
    plain stage 3. Must divide the world size; stage 3 only; not with a 2-D ``mesh`` nor with
    ``activations.budget_bytes`` (``compile`` raises ``ConfigError``)."""

    inductor_islands: bool = False
    """Under the Inductor lowering with templated units, also lower the compute between the
    units' calls (the root's embedding, final norm and loss, their gradients, gradients'
    pre-divides) with Inductor, each distinct island once (``zerograph.capture.islands``).
    ``False`` (default): Inductor lowers the templated bodies, what repeats, and the rest runs op
    by op as ATen, as FSDP2 + ``torch.compile`` per block (torchtitan) leaves the root uncompiled;
    each distinct island costs a cold C++ compile on CPU, a large share of the first step on the
    GPT (figures: docs/benchmarks.md, "Compile time"). Without templates Inductor lowers the
    whole graph either way. ``True`` with ``lowering="eager"`` raises ``ConfigError``; under
    ``"auto"`` it takes effect where the lowering resolves to Inductor (CUDA)."""

    def __post_init__(self) -> None:
        for policy, cls in POLICIES.items():
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
            raise ConfigError("Config.unit_templates with activations.budget_bytes is not supported yet: the "
                              "activation plan prices and moves a unit's activations op by op, and a templated "
                              "unit is one op, so the budget would not hold; use one or the other")
        if self.lowering not in LOWERINGS:
            raise ConfigError(f"Config.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.inductor_islands and self.lowering == "eager":
            raise ConfigError("Config.inductor_islands asks Inductor to lower the compute between units, but "
                              "lowering='eager' runs no Inductor; use lowering='inductor' or 'auto'")
        if self.memory.pool_comm_buffers and self.lowering == "inductor":
            raise ConfigError("Config.memory.pool_comm_buffers pools the eager lowering's comm buffers, but "
                              "lowering='inductor' plans its own buffers; use lowering='eager' or leave the pool off")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ConfigError(f"Config.timeout_s must be positive seconds, got {self.timeout_s!r}")
        cost_model = self.activations.cost_model
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ConfigError(f"Config.activations.cost_model must be a zerograph.graph.costmodel.CostModel or None, "
                              f"got {cost_model!r}")
        if self.unit_classes is not None:
            object.__setattr__(self, "unit_classes", check_module_classes("Config", "unit_classes", self.unit_classes))
        self._check_disabled_passes()

    def _check_disabled_passes(self) -> None:
        names = self.disabled_passes
        if isinstance(names, str) or not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"Config.disabled_passes must be a tuple of pass names, got {names!r}")
        object.__setattr__(self, "disabled_passes", tuple(names))
        if self.disabled_passes:
            # the pass manager (and with it every pass) loads only when a pass is named: Config
            # itself sits below the passes and needs none of them to be built
            from .passes.manager import check_disabled_passes

            check_disabled_passes(self.disabled_passes)

    def resolved_lowering(self, device: torch.device) -> Literal["eager", "inductor"]:
        """The lowering for parameters on ``device``: ``lowering`` itself, or for ``"auto"``
        Inductor on CUDA and eager elsewhere."""
        if self.lowering != "auto":
            return self.lowering
        return "inductor" if torch.device(device).type == "cuda" else "eager"

    def resolved_dump_dir(self) -> str | None:
        """``dump_dir``, or the ``ZEROGRAPH_DUMP`` environment variable's value when it is ``None``
        (an empty value: ``None``, no dump)."""
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
        raise ConfigError("Config.activations.cost_model has one rank, so it cannot price P_a's all-gather over "
                          "activations.group: give a model of two ranks or more, or leave it None")
    return policy if cost is policy.cost_model else dataclasses.replace(policy, cost_model=cost)


def _new_spelling(name: str) -> str:
    policy, field = DEPRECATED_KEYWORDS[name]
    return f"Config({policy}=zerograph.{POLICIES[policy].__name__}({field}=...)), read as config.{policy}.{field}"


def _deprecated(name: str, stacklevel: int) -> None:
    """Warn that ``name`` is deprecated; ``stacklevel`` (``warnings.warn``'s) points at the user's line."""
    warnings.warn(f"Config's flat keyword {name!r} is deprecated and will be removed in the next release: "
                  f"write {_new_spelling(name)}", DeprecationWarning, stacklevel=stacklevel + 1)


def _policies_from_deprecated(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (``Config``'s keywords) with the deprecated flat keywords turned into the
    policies they belong to, warning once per keyword.

    Raises:
        TypeError: a keyword that is neither a field nor a deprecated flat keyword.
        ConfigError: a policy given both whole and by a flat keyword.
    """
    fields = [f.name for f in dataclasses.fields(Config)]
    for name in settings:
        if name not in fields and name not in DEPRECATED_KEYWORDS:
            raise TypeError(f"Config got an unexpected keyword argument {name!r}; its fields: {', '.join(fields)}")
    flat = {name: settings.pop(name) for name in list(settings) if name in DEPRECATED_KEYWORDS}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        _deprecated(name, stacklevel=3)  # this function, Config's __init__, the caller
        policy, field = DEPRECATED_KEYWORDS[name]
        if policy in settings:
            raise ConfigError(f"Config got both {policy}= and the deprecated {name}=; write {_new_spelling(name)}")
        grouped.setdefault(policy, {})[field] = value
    return {**settings, **{policy: POLICIES[policy](**values) for policy, values in grouped.items()}}


_DATACLASS_INIT = Config.__init__


@functools.wraps(_DATACLASS_INIT)
def _init(self: Config, **settings: Any) -> None:
    """``Config``'s constructor: the dataclass's own, after ``_policies_from_deprecated``."""
    _DATACLASS_INIT(self, **_policies_from_deprecated(settings))


def _deprecated_read(name: str) -> property:
    """A read-only ``config.<name>`` that warns and returns the policy's field."""
    policy, field = DEPRECATED_KEYWORDS[name]

    def read(self: Config) -> Any:
        _deprecated(name, stacklevel=2)  # the property, the caller
        return getattr(getattr(self, policy), field)

    return property(read, doc=f"Deprecated: ``{policy}.{field}``.")


Config.__init__ = _init  # type: ignore[method-assign]
for _name in DEPRECATED_KEYWORDS:
    setattr(Config, _name, _deprecated_read(_name))
del _name


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
        raise ConfigError("Config.secondary_partition_size (hpZ) with activations.budget_bytes is not supported yet: "
                          "a unit recomputed in backward would read the gathered parameters hpZ releases after "
                          "forward; use one or the other")


def check_stage(stage: object) -> int:
    """Return ``stage`` as an int, or raise ``ConfigError`` naming the valid stages."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(
            f"stage must be one of {STAGES} (0 = DDP, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p), got {stage!r}"
        )
    return stage
