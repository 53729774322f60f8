"""Dispatch helpers shared by the kernel wrappers (Triton vs. plain-torch reference)."""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch

# Element types the Triton kernels load and store. Other dtypes go to the torch reference.
TRITON_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_TRUE = {"1", "true", "yes", "on", "y"}


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the Triton interpreter (Triton's own truthy spellings)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def want_triton(tensors: Iterable[torch.Tensor], use_triton: bool | None, eligible: bool, why_not: str) -> bool:
    """Decide the implementation for one call.

    ``use_triton=None`` picks Triton for CUDA tensors or when the interpreter is requested, and only
    if the call is ``eligible`` (dtypes/layout the kernel supports); otherwise the reference.
    ``use_triton=True`` forces Triton and raises ``TypeError`` with ``why_not`` if not eligible.
    Tensor subclasses are never eligible.
    """
    tensors = list(tensors)
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        # Subclasses (DTensor, AsyncCollectiveTensor, ...) do not expose their storage to kernels.
        eligible, why_not = False, "pass plain tensors (DTensor: .to_local())"
    if use_triton is None:
        return eligible and (any(t.is_cuda for t in tensors) or interpreter_requested())
    if use_triton and not eligible:
        raise TypeError(f"use_triton=True but the Triton kernel cannot run this call: {why_not}")
    return bool(use_triton)


def same_device(tensors: Iterable[torch.Tensor], what: str) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def triton_kernels():
    """Import the Triton kernels on first use.

    Importing lazily keeps the reference path free of Triton. ``triton.jit`` decides at decoration
    time whether a kernel is interpreted, so ``TRITON_INTERPRET`` must be set before this first call.
    """
    from . import _triton_kernels

    return _triton_kernels


def check_launchable(kernel, tensors: Iterable[torch.Tensor]) -> None:
    """Raise ``RuntimeError`` instead of letting a compiled kernel dereference host pointers."""
    on_cpu = [t for t in tensors if t.device.type == "cpu"]
    if not on_cpu:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or the Triton interpreter for CPU tensors: set "
            "TRITON_INTERPRET=1 before zerograph's Triton kernels are first used (before the first "
            "Triton dispatch in this process)"
        )
