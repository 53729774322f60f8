"""Fused AdamW step over a flat fp32 shard, with a torch reference of the same signature.

The update is torch.optim.AdamW's (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
ICLR 2019; Kingma & Ba, "Adam", ICLR 2015), in the operation order of torch's single-tensor
implementation, so the reference is bit-identical to ``torch.optim.AdamW(foreach=False)`` on CPU and
the Triton kernel agrees to about one fp32 ulp::

    g  = grad / grad_scale                        (if grad_scale is given)
    p  = p * (1 - lr * weight_decay)              (decoupled decay of the old parameter)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    p  = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

The Triton kernel reads param, grad, exp_avg, exp_avg_sq once and writes param, exp_avg,
exp_avg_sq (and optionally a low-precision copy of the new param) once: 28 bytes per element for
fp32 grads, 30 with a bf16 copy, versus several passes for the unfused reference.
"""
from __future__ import annotations

import torch

from ._common import check_launchable, same_device, triton_kernels, want_triton

__all__ = ["adamw_step", "adamw_step_reference"]


def _check_args(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step,
                param_bf16_out) -> None:
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape:
            raise ValueError(f"adamw_step: {name} has shape {tuple(t.shape)}, param has {tuple(param.shape)}")
    if param_bf16_out is not None and param_bf16_out.numel() != param.numel():
        raise ValueError(f"adamw_step: param_bf16_out has {param_bf16_out.numel()} elements, "
                         f"param has {param.numel()}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adamw_step: step must be an int >= 1 (the count including this update), got {step!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"adamw_step: betas must lie in [0, 1), got ({beta1}, {beta2})")
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
        raise ValueError(f"adamw_step: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")


def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float | torch.Tensor | None = None,
    param_bf16_out: torch.Tensor | None = None,
) -> None:
    """Plain-torch AdamW step, in place; same arguments and results as :func:`adamw_step`.

    Mirrors ``torch.optim.adamw``'s single-tensor path op for op, so on CPU it is bit-identical to
    ``torch.optim.AdamW``. Works for any float dtype and layout (the ops run in ``param.dtype``).
    """
    _check_args(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, param_bf16_out)
    g = grad if grad.dtype == exp_avg.dtype else grad.to(exp_avg.dtype)
    if grad_scale is not None:
        g = g / grad_scale
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if param_bf16_out is not None:
        param_bf16_out.copy_(param.reshape(param_bf16_out.shape))


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float | torch.Tensor | None = None,
    param_bf16_out: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> None:
    """One AdamW update of a parameter shard, in place (torch.optim.AdamW semantics).

    Args:
        param: parameter shard, updated in place. The Triton kernel takes fp32, contiguous, any shape
            (treated as 1-D of ``n`` elements).
        grad: its gradient, same shape; fp32, bf16 or fp16 (upcast to fp32 in registers). Not modified.
        exp_avg: AdamW's first moment, same shape as ``param`` (fp32 for the kernel), updated in place.
        exp_avg_sq: AdamW's second moment, likewise.
        lr: learning rate (step size in parameter units per unit of normalized gradient).
        beta1: the first moment's decay rate, in [0, 1).
        beta2: the second moment's decay rate, in [0, 1).
        eps: added to the bias-corrected ``sqrt(exp_avg_sq)``.
        weight_decay: decoupled decay coefficient; the parameter is scaled by ``1 - lr*weight_decay``
            before the Adam update, as in torch.optim.AdamW.
        step: the optimizer step count including this update (1 on the first), for bias correction.
        grad_scale: optional loss scale; gradients are divided by it. A Python number or a
            1-element tensor (read on the device, so no host synchronization).
        param_bf16_out: optional tensor of ``n`` elements (any float dtype, typically bf16) that
            receives the updated parameter, cast with round-to-nearest-even, in the same pass.
        use_triton: ``None`` = Triton for CUDA tensors or under ``TRITON_INTERPRET=1`` when the
            dtypes/layouts above hold, else the reference; ``True`` = force Triton; ``False`` = force
            :func:`adamw_step_reference`.

    Raises:
        ValueError: mismatched shapes/sizes, tensors on several devices, ``step < 1``, betas outside
            [0, 1), or negative lr/eps/weight_decay.
        TypeError: ``use_triton=True`` with dtypes or non-contiguous tensors the kernel cannot take.
        RuntimeError: Triton forced on CPU tensors without the Triton interpreter.
    """
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([param_bf16_out] if param_bf16_out is not None else [])
    scale_tensor = grad_scale if isinstance(grad_scale, torch.Tensor) else None
    eligible = (
        param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32
        and grad.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (param_bf16_out is None or param_bf16_out.dtype in (torch.float32, torch.bfloat16, torch.float16))
        and all(t.is_contiguous() for t in tensors)
        and (scale_tensor is None or scale_tensor.numel() == 1)
    )
    why_not = ("param/exp_avg/exp_avg_sq must be contiguous fp32, grad and param_bf16_out contiguous "
               "fp32/bf16/fp16, grad_scale a number or a 1-element tensor")
    if not want_triton(tensors, use_triton, eligible, why_not):
        adamw_step_reference(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                             param_bf16_out=param_bf16_out)
        return
    _check_args(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, param_bf16_out)
    device = same_device(tensors, "adamw_step")
    scale_value = None
    if scale_tensor is not None:
        if scale_tensor.device != device:
            # A host scalar costs nothing to read; a device scalar elsewhere would need a copy.
            scale_value = float(scale_tensor.item())
            scale_tensor = None
    elif grad_scale is not None:
        scale_value = float(grad_scale)
    kernels = triton_kernels()
    check_launchable(kernels._adamw_kernel, tensors)
    # Scalars are computed in float64 on the host and rounded once to fp32 at launch, as torch
    # rounds its Python-scalar operands.
    kernels.launch_adamw(
        param, grad, exp_avg, exp_avg_sq, param_bf16_out, scale_tensor, scale_value,
        decay=1.0 - lr * weight_decay, lerp_w=1.0 - beta1, beta2=beta2,
        neg_step_size=-(lr / (1.0 - beta1**step)), bc2_sqrt=(1.0 - beta2**step) ** 0.5, eps=eps,
    )
