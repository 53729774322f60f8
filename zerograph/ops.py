"""The two graph markers capture leaves for the passes to expand.

``zerograph::unshard(shard, key)`` stands for "the full parameter ``key``"; its autograd backward is
``zerograph::reduce_grad(grad, key)``, "this rank's shard of the gradient averaged over ranks". In a
captured graph the stage's passes replace them by functional collectives (or by nothing at stage 0
/ world size 1); in a frame that runs eagerly (a graph break) their real implementations run the
collective directly, so results are right either way. Neither output aliases its input.
"""
from __future__ import annotations

import torch

from . import runtime


@torch.library.custom_op("zerograph::unshard", mutates_args=())
def unshard(shard: torch.Tensor, key: int) -> torch.Tensor:
    """Full parameter from this rank's shard. ``shard``: (local_rows, *rest) -> ``layout.shape``."""
    return runtime.runtime_of(key).unshard_eager(shard, key)


@unshard.register_fake
def _unshard_fake(shard: torch.Tensor, key: int) -> torch.Tensor:
    return shard.new_empty(runtime.layout_of(key).shape)


@torch.library.custom_op("zerograph::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, key: int) -> torch.Tensor:
    """This rank's shard of the rank-averaged gradient. ``grad``: full shape -> (local_rows, *rest)."""
    return runtime.runtime_of(key).reduce_grad_eager(grad, key)


@reduce_grad.register_fake
def _reduce_grad_fake(grad: torch.Tensor, key: int) -> torch.Tensor:
    return grad.new_empty(runtime.runtime_of(key).local_shape(key))


def _unshard_backward(ctx, grad: torch.Tensor):
    return reduce_grad(grad.contiguous(), ctx.key), None


def _unshard_setup(ctx, inputs, output) -> None:
    ctx.key = inputs[1]


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)

UNSHARD = torch.ops.zerograph.unshard.default
REDUCE_GRAD = torch.ops.zerograph.reduce_grad.default
