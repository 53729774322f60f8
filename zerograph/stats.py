"""``zerograph.stats``: bytes moved and bytes held by one rank in the last completed step."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zerograph.passes.liveness import GRAD_ROLES, PARAM_ROLES

from .api import state_of


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
            buffer per all-gather or reduce-scatter, twice that per all-reduce).
        resident_bytes: ``"params"``, ``"grads"``, ``"optimizer_states"``: the most bytes of each
            held at once during the step. Params: this rank's shards plus the gathered full
            parameters alive at once (liveness over the compiled graphs); grads: unreduced full
            gradients plus reduced shards alive at once in backward (or the ``.grad`` shards, if
            more); optimizer states: tensors in ``optimizer.state`` for these parameters (the
            0-d step counters excluded); present only when the optimizer is passed.
        formula_bytes: the same keys by the paper's section-5 formulas with this run's dtypes
            (see ``formula_bytes``).
        transient_bytes: the part of ``resident_bytes`` the formulas leave out or hold only for
            part of the step: ``"params"``, gathered full parameters alive at once (all of them
            at stages 1-2, the units in flight at stage 3); ``"grads"``, full gradients and
            buckets beyond the reduced shards.
    """

    stage: int
    world_size: int
    num_params: int
    comm_elements: dict[str, int]
    comm_bytes: dict[str, int]
    resident_bytes: dict[str, int]
    formula_bytes: dict[str, float]
    transient_bytes: dict[str, int]


def formula_bytes(stage: int, world_size: int, num_params: int, param_bytes: int, grad_bytes: int,
                  optimizer_bytes: int | None) -> dict[str, float]:
    """Per-rank model-state bytes by the ZeRO paper's formulas (arXiv 1910.02054, section 5).

    ``param_bytes`` / ``grad_bytes`` / ``optimizer_bytes``: bytes per element (fp32 Adam: 4, 4, 8).
    Stages 1-2 keep the compute copy of every parameter (p·Ψ) and, when N > 1, the shard the
    optimizer updates (p·Ψ/N): in the paper's mixed precision that shard is the fp32 master inside K;
    in fp32 training it is a separate copy too, as in DeepSpeed's ZeRO-1/2.
    """
    psi, n = num_params, world_size
    params = {0: param_bytes * psi, 1: param_bytes * psi, 2: param_bytes * psi, 3: param_bytes * psi / n}[stage]
    if stage in (1, 2) and n > 1:
        params += param_bytes * psi / n
    grads = grad_bytes * psi if stage <= 1 else grad_bytes * psi / n
    out = {"params": params, "grads": grads}
    if optimizer_bytes is not None:
        out["optimizer_states"] = optimizer_bytes * psi / (n if stage >= 1 else 1)
    return out


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
    gathered = sum(max((m[k].peak(PARAM_ROLES) for k in m), default=0) for m in rt.graph_memory)
    grads_peak = sum(m["backward"].peak(GRAD_ROLES) for m in rt.graph_memory if "backward" in m)
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
    first = next(iter(rt.layouts.values()))
    itemsize = torch.empty((), dtype=first.dtype).element_size()
    step = rt.finished_step()
    return Stats(rt.stage, rt.world_size, num_params, dict(step.elements), dict(step.bytes), resident,
                 formula_bytes(rt.stage, rt.world_size, num_params, itemsize, itemsize, opt_bytes_per_elem),
                 transient)
