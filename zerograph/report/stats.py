"""``zerograph.stats``: bytes moved and bytes held by one rank in the last completed step."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zerograph.passes.liveness import GRAD_ROLES, PARAM_ROLES

from ..runtime.runtime import Runtime
from ..runtime.state import state_of
from ..shard.sharding import ParamLayout


@dataclasses.dataclass(frozen=True)
class Stats:
    """Accounting of the last completed step (forward + backward) on this rank.

    Attributes:
        stage, world_size: as compiled.
        num_params: Ψ, elements of the unique parameters (unsharded, unpadded).
        comm_elements: per collective kind (``"all_gather"``, ``"reduce_scatter"``,
            ``"all_reduce"``), elements of the full tensors moved, padding included; an
            all-reduce counts twice its size (ZeRO paper section 7). Ideal: 2Ψ at stages 0-2, 3Ψ at 3.
        comm_bytes: the same collectives in bytes this rank sent (ring algorithms: (N-1)/N of the
            buffer per all-gather or reduce-scatter, twice that per all-reduce), in the dtype each
            moves: ``MixedPrecisionPolicy.param_dtype`` for all-gathers, its ``reduce_dtype`` for reductions.
            With ``Config.gather_quantization`` an all-gather of quantized parameters moves a
            byte buffer (int8 values, fp32 scales, small shards raw), and with
            ``Config.reduce_quantization`` a reduce-scatter is an all-to-all of such buffers
            (counted under ``"reduce_scatter"``): both counts are then of those bytes, exactly
            what went on the wire.
        resident_bytes: ``"params"``, ``"grads"``, ``"optimizer_states"``: the most bytes of each
            held at once during the step. Params: this rank's shards plus the gathered full
            parameters alive at once (liveness over the compiled graphs); grads: unreduced full
            gradients plus reduced shards alive at once in backward, plus the full gradients
            kept while gradient sync is off (or the ``.grad`` shards, if more); optimizer
            states: tensors in ``optimizer.state`` for these parameters (the 0-d step counters
            excluded); present only when the optimizer is passed.
        formula_bytes: the same keys by the paper's section-5 formulas with this run's dtypes
            (see ``formula_bytes``): ``param_dtype`` for full parameters and gradients, the
            parameters' own (master) dtype for shards and ``.grad``.
        transient_bytes: the part of ``resident_bytes`` the formulas leave out or hold only for
            part of the step: ``"params"``, gathered full parameters alive at once (all of them
            at stages 1-2, the units in flight at stage 3); ``"grads"``, full gradients and
            buckets beyond the reduced shards.
        saved_activation_bytes: bytes of the activations the step's forward graphs handed to
            backward, measured when each ran (its last call): the tensors AOTAutograd's forward
            returns past the user outputs, each storage once, without graph inputs (parameters,
            shards, the batch) and gathered parameters. All of them are alive at once between
            forward and backward, so this is their peak. What ``ActivationPolicy.budget_bytes``
            bounds (per graph). Offloaded activations are not counted here.
        offloaded_activation_bytes: bytes of saved activations the step's forward graphs handed
            to backward in host memory instead (``ActivationPolicy.offload``), measured alike.
        secondary_partition_bytes: bytes of hpZ's secondary partitions the step's forward graphs
            handed to backward (``Config.secondary_partition_size=M``: this rank's 1/M of every
            unit backward re-gathers, in ``param_dtype``), measured alike and not counted in
            ``saved_activation_bytes``; ``zerograph.plan`` predicts it as
            ``Plan.secondary_partition_bytes``. 0 without hpZ.
        comm_elements_per_dim, comm_bytes_per_dim: ``comm_elements`` and ``comm_bytes`` split
            by the mesh dim each collective ran over: ``{"shard": {kind: n}, "replicate": {kind:
            n}}`` (hybrid sharding, ``compile(mesh=2-D mesh)``: gathers and reduce-scatters
            within the shard group of S ranks, the gradient all-reduce of the reduced shards
            across the R replicas, bytes at ``(R-1)/R`` of it twice); a 1-D group has only
            ``"shard"``, and hpZ adds ``"secondary"`` (backward's re-gathers over the node group of
            ``Config.secondary_partition_size`` ranks). Summed over the dims they are
            ``comm_elements`` / ``comm_bytes``.
        replicas: R, the replicate dim's size (1 without a 2-D mesh); ``world_size`` is the
            shard dim's S, so gradients are averaged over ``world_size * replicas`` ranks.
        template_exits: ``"<kind>: <reason>"`` -> traces (or eager calls) in which units of that
            kind left the template fast path for that reason, since compile (``zerograph.explain``'s
            "Unit paths"); empty while every unit runs its template.
        fake_world: the step ran as one rank of a fake world (``zerograph.fake_world``): bytes
            and counts are this rank's real ones, but no collective moved data, so the values
            the step computed were meaningless. ``str()`` says so on its first line.
    """

    stage: int
    world_size: int
    num_params: int
    comm_elements: dict[str, int]
    comm_bytes: dict[str, int]
    resident_bytes: dict[str, int]
    formula_bytes: dict[str, float]
    transient_bytes: dict[str, int]
    saved_activation_bytes: int = 0
    offloaded_activation_bytes: int = 0
    fake_world: bool = False
    secondary_partition_bytes: int = 0
    comm_elements_per_dim: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    comm_bytes_per_dim: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    replicas: int = 1
    template_exits: dict[str, int] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        if not self.fake_world:
            return repr(self)
        return (f"[fake world: rank of {self.world_size} with no peers; collectives moved no data, "
                f"bytes and counts are real, the values computed are not]\n{self!r}")


def formula_bytes(stage: int, world_size: int, num_params: int, param_bytes: float, grad_bytes: float,
                  optimizer_bytes: int | None, *, master_bytes: float | None = None,
                  grad_shard_bytes: float | None = None) -> dict[str, float]:
    """Per-rank model-state bytes by the ZeRO paper's formulas (arXiv 1910.02054, section 5).

    Bytes per element: ``param_bytes``, of the full parameters compute uses (``param_dtype``: the
    paper's fp16, 2); ``grad_bytes``, of the full gradients (the same dtype); ``optimizer_bytes``,
    of the optimizer's own states (Adam's m and v in fp32: 8; ``None`` leaves the key out);
    ``master_bytes``, of the shards the optimizer updates (the fp32 master weights: 4; default
    ``param_bytes``); ``grad_shard_bytes``, of the reduced gradient shards in ``.grad`` (the
    master's dtype; default ``grad_bytes``). fp32 training: 4, 4, 8, 4, 4.

    Params: the master shard (m·Ψ at stage 0, m·Ψ/N above) plus, at stages 0-2, the compute copy
    (p·Ψ) where it is a separate tensor: always at stages 1-2 when N > 1 (the gathered parameters,
    kept from forward to the end of backward, as in DeepSpeed's ZeRO-1/2), and whenever
    ``master_bytes != param_bytes`` (mixed precision casts). The paper counts the fp32 master in K;
    zerograph's master is the parameter itself, so it is counted here and ``optimizer_states`` holds
    only the optimizer's buffers. Stage 3's gathered units are transient and left out.
    Grads: full gradients (g·Ψ) at stages 0-1, reduced shards (g_shard·Ψ/N) at stages 2-3.
    Floats, since Ψ/N need not be whole.
    """
    psi, n = num_params, world_size
    master = param_bytes if master_bytes is None else master_bytes
    grad_shard = grad_bytes if grad_shard_bytes is None else grad_shard_bytes
    separate_copy = master != param_bytes or (stage in (1, 2) and n > 1)
    params = master * psi / (n if stage >= 1 else 1)
    if stage <= 2 and separate_copy:
        params += param_bytes * psi
    grads = grad_bytes * psi if stage <= 1 else grad_shard * psi / n
    out = {"params": params, "grads": grads}
    if optimizer_bytes is not None:
        out["optimizer_states"] = optimizer_bytes * psi / (n if stage >= 1 else 1)
    return out


def _bytes_per_element(rt: Runtime, dtype_of: Callable[[ParamLayout], torch.dtype]) -> float:
    """Parameter-weighted bytes per element of one dtype role over all layouts (exact for a model
    of one dtype, the right average for a mix, e.g. fp32 batch norms beside bf16 weights)."""
    total = sum(layout.numel for layout in rt.layouts.values())
    return sum(layout.numel * dtype_of(layout).itemsize for layout in rt.layouts.values()) / total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def stats(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Stats:
    """Return ``Stats`` for the last completed step of ``model`` on this rank.

    Raises ``ShardingError`` when ``model`` was not compiled by ``zerograph.compile``.
    """
    state = state_of(model)
    rt = state.runtime
    params = list(model.parameters())
    shard_bytes = sum(_local(p).numel() * _local(p).element_size() for p in params)
    grad_shard_bytes = sum(_local(p.grad).numel() * _local(p.grad).element_size() for p in params if p.grad is not None)
    # the frames of the last step: graphs that ran in it (not an eval-only graph, nor the other
    # variant of a recompiled or no-sync graph)
    step = rt.accounting.finished_step()
    ran = [m for graph_id, m in enumerate(rt.accounting.graph_memory) if graph_id in step.graphs]
    gathered = sum(max((m[k].peak(PARAM_ROLES) for k in ("forward", "backward") if k in m), default=0)
                   for m in ran)
    grads_peak = sum(m["backward"].peak(GRAD_ROLES) for m in ran if "backward" in m)
    # full gradients the runtime holds while gradient sync is off (set_requires_gradient_sync)
    grads_peak += rt.grad_buffers.unsynced_bytes()
    resident = {"params": shard_bytes + gathered, "grads": max(grads_peak, grad_shard_bytes)}
    transient = {"params": gathered, "grads": resident["grads"] - grad_shard_bytes}
    opt_bytes_per_elem = None
    if optimizer is not None:
        own = {id(p) for p in params}
        held = 0
        for p, st in optimizer.state.items():
            if id(p) in own:
                held += sum(_local(v).numel() * _local(v).element_size()
                            for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        resident["optimizer_states"] = held
        opt_bytes_per_elem = sum(
            v.element_size() for st in list(optimizer.state.values())[:1]
            for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    num_params = sum(layout.numel for layout in rt.layouts.values())
    compute = _bytes_per_element(rt, lambda layout: layout.param_dtype)  # full params and full grads
    master = _bytes_per_element(rt, lambda layout: layout.dtype)  # shards and their .grad
    formula = formula_bytes(rt.stage, rt.topology.world_size, num_params, compute, compute, opt_bytes_per_elem,
                            master_bytes=master, grad_shard_bytes=master)
    saved, offloaded, secondary = (sum(per_graph.get(graph_id, 0) for graph_id in step.graphs) for per_graph in (
        state.captured.saved_activation_bytes, state.captured.offloaded_activation_bytes,
        state.captured.secondary_partition_bytes))
    return Stats(rt.stage, rt.topology.world_size, num_params, dict(step.elements), dict(step.bytes), resident,
                 formula, transient, saved, offloaded, fake_world=rt.topology.fake_world,
                 comm_elements_per_dim={d: dict(c) for d, c in step.dim_elements.items()},
                 comm_bytes_per_dim={d: dict(c) for d, c in step.dim_bytes.items()},
                 replicas=rt.topology.replicate_size, secondary_partition_bytes=secondary,
                 template_exits={f"{kind.name}: {reason}": count for kind in state.unit_kinds
                                 for reason, count in kind.exits.items()})
