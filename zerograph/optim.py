"""AdamW for zerograph's sharded parameters, state-compatible with ``torch.optim.AdamW``.

Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019), with the update rule,
hyperparameter names and ``state_dict`` format of ``torch.optim.AdamW``. Each rank updates only
its own shard: for ``DTensor`` parameters (``Shard(0)``) the step runs on ``to_local()`` views, so it
needs no communication. CUDA fp32 shards take the fused Triton kernel
(:func:`zerograph.kernels.adamw_step`); everything else takes the torch reference, which matches
``torch.optim.AdamW`` bit for bit on CPU.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from .kernels import adamw_step

__all__ = ["AdamW"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind ``t``: its shard for a DTensor, ``t`` itself otherwise."""
    if isinstance(t, DTensor):
        t = t.to_local()
    # Gradients produced by functional collectives may still be in flight; a kernel reading raw
    # pointers must wait for them (torch ops on the wrapper would wait implicitly).
    if isinstance(t, AsyncCollectiveTensor):
        t = t.wait()
    return t


class AdamW(torch.optim.Optimizer):
    """AdamW over plain or ``DTensor`` parameters, a drop-in for ``torch.optim.AdamW``.

    Args:
        params: iterable of parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
        lr: learning rate (float, or a 1-element tensor read with ``float()`` each step).
        betas: ``(beta1, beta2)`` moment decay rates in [0, 1).
        eps: added to the bias-corrected root of the second moment.
        weight_decay: decoupled weight decay; each step first scales parameters by
            ``1 - lr * weight_decay``.
        amsgrad: must be False (``NotImplementedError`` otherwise); kept so the constructor and
            ``param_groups`` match torch's.
        maximize: as ``amsgrad``.
        capturable: as ``amsgrad``.
        differentiable: as ``amsgrad``.
        foreach: accepted and stored for ``state_dict`` compatibility; ignored (the
            implementation is chosen per tensor as described in the module docstring).
        fused: as ``foreach``.
        use_triton: passed to :func:`zerograph.kernels.adamw_step` (``None`` = automatic).

    State per parameter, as in torch.optim.AdamW: ``step`` (float32 scalar tensor on the CPU),
    ``exp_avg`` and ``exp_avg_sq`` (like the parameter: a DTensor for a DTensor parameter), so
    ``state_dict()`` / ``load_state_dict()`` interoperate with ``torch.optim.AdamW`` both ways.

    Raises:
        ValueError: invalid hyperparameters (same checks as torch).
        NotImplementedError: amsgrad, maximize, capturable or differentiable requested, at
            construction or through a loaded param group.
        RuntimeError: sparse gradients.
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        use_triton: bool | None = None,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        _reject_unsupported(amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                            differentiable=differentiable)
        defaults = {
            "lr": lr,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": True,
        }
        self._use_triton = use_triton
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # Groups saved by older torch versions may lack keys torch.optim.AdamW now writes.
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group["decoupled_weight_decay"] = True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One AdamW update of every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _reject_unsupported(amsgrad=group["amsgrad"], maximize=group["maximize"],
                                capturable=group["capturable"], differentiable=group["differentiable"])
            beta1, beta2 = (float(b) for b in group["betas"])
            lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("zerograph.optim.AdamW does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    # Same initial state as torch.optim.AdamW (non-capturable, non-fused).
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_step(
                    _local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                    lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    step=int(state["step"].item()), use_triton=self._use_triton,
                )
        return loss


def _reject_unsupported(**flags: bool) -> None:
    on = [name for name, value in flags.items() if value]
    if on:
        raise NotImplementedError(
            f"zerograph.optim.AdamW does not implement {', '.join(on)}; use torch.optim.AdamW for that"
        )
