"""What the bench trains: the package's GPT at a named size on random tokens, or a user's
``module:factory`` (docs/bench.md has the factory's contract), and the parameter
counts (Ψ, padded Ψ) the communication volumes are divided by.

Source: ``zerograph.models.gpt``; ``torch.distributed.tensor``'s ``Shard(0)`` padding for padded Ψ.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..shard.sharding import find_units
from .real_models import REAL_MODELS

# the real models' size when --n-embd / --n-layer / --seq-len are not given, and their vocabulary
# (the size of zerograph's own example models': the comparison is of the blocks, not of a large embedding)
REAL_MODEL_SIZE = {"n_embd": 512, "n_layer": 4, "seq_len": 128}
REAL_VOCAB = 256
HEAD_DIM = 64


@dataclasses.dataclass
class Workload:
    """A model factory and its data.

    ``build()``: a fresh CPU model (the caller seeds); ``batch(step, rank, world_size)``: this
    rank's inputs of step ``step``; ``blocks(model)``: the modules FSDP2 wraps one by one;
    ``loss(model, *batch)``: the step's scalar loss, computed by the trainer outside the (wrapped)
    model; ``None``: ``model(*batch)`` returns it.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int, int], tuple[torch.Tensor, ...]]
    blocks: Callable[[nn.Module], list[nn.Module]]
    description: dict
    loss: Callable[..., torch.Tensor] | None = None


def load_workload(model: str, batch_size: int, seq_len: int | None, seed: int, n_layer: int | None = None,
                  n_embd: int | None = None) -> Workload:
    """The GPT example at a named size (``seq_len``, ``n_layer``, ``n_embd`` replace its
    block_size, blocks and width when given), a real model of ``REAL_MODELS`` (``seq_len``,
    ``n_layer``, ``n_embd`` default to ``REAL_MODEL_SIZE``'s), or a user's ``module:factory``.
    Raises ``ConfigError``."""
    if ":" in model:
        if n_layer is not None or n_embd is not None:
            raise ConfigError("--n-layer / --n-embd change the GPT example's size; a module:factory builds its own")
        return _factory_workload(model)
    if model in REAL_MODELS:
        return _real_workload(model, batch_size, seq_len, seed, n_layer, n_embd)
    return _gpt_workload(model, batch_size, seq_len, seed, n_layer, n_embd)


def token_batches(vocab: int, seq_len: int, batch_size: int, seed: int) -> Callable[[int, int, int], tuple]:
    """``batch(step, rank, world_size)``: this rank's ``(tokens, targets)``, each (B/N, T) int64,
    of a global batch of ``batch_size`` random sequences that depends on ``seed`` and ``step`` only."""
    def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size % world_size:
            raise ConfigError(f"--batch-size {batch_size} must be divisible by the world size {world_size}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # same global batch on every rank
        tokens = torch.randint(vocab, (batch_size, seq_len + 1), generator=gen)                # (B, T+1)
        per_rank = batch_size // world_size
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]                                   # (B/N, T+1)
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()                               # 2 x (B/N, T)

    return batch


def real_model_size(n_embd: int | None, n_layer: int | None, seq_len: int | None) -> tuple[int, int, int, int]:
    """``(dim, layers, heads, seq)`` of a real model: ``REAL_MODEL_SIZE`` where not given, heads of
    ``HEAD_DIM`` channels. Raises ``ConfigError`` for a width that is not a multiple of ``HEAD_DIM``."""
    dim, layers, seq = (n_embd or REAL_MODEL_SIZE["n_embd"], n_layer or REAL_MODEL_SIZE["n_layer"],
                        seq_len or REAL_MODEL_SIZE["seq_len"])
    if dim % HEAD_DIM:
        raise ConfigError(f"--n-embd {dim}: a real model's width must be a multiple of its {HEAD_DIM}-wide heads")
    return dim, layers, dim // HEAD_DIM, seq


def _real_workload(name: str, batch_size: int, seq_len: int | None, seed: int, n_layer: int | None,
                   n_embd: int | None) -> Workload:
    real = REAL_MODELS[name]
    dim, layers, heads, seq = real_model_size(n_embd, n_layer, seq_len)
    return Workload(name, lambda: real.build(dim, layers, heads, REAL_VOCAB, seq),
                    token_batches(REAL_VOCAB, seq, batch_size, seed), real.blocks,
                    {"kind": real.description, "n_embd": dim, "n_layer": layers, "n_head": heads,
                     "vocab_size": REAL_VOCAB, "block_size": seq, "global_batch": batch_size}, loss=real.loss)


def example_gpt() -> Any:
    """The package's GPT (``zerograph.models.gpt``)."""
    from ..models import gpt  # on use: --model module:factory does not need it

    return gpt


def _gpt_workload(size: str, batch_size: int, seq_len: int | None, seed: int, n_layer: int | None,
                  n_embd: int | None) -> Workload:
    gpt = example_gpt()
    if size not in gpt.SIZES:
        raise ConfigError(f"unknown GPT size {size!r}; known: {sorted(gpt.SIZES)} (or module:factory)")
    changes = {k: v for k, v in (("block_size", seq_len), ("n_layer", n_layer), ("n_embd", n_embd)) if v is not None}
    cfg = dataclasses.replace(gpt.SIZES[size], **changes)
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be a multiple of the {size} GPT's {cfg.n_head} heads")
    batch = token_batches(cfg.vocab_size, cfg.block_size, batch_size, seed)
    return Workload(f"gpt-{size}", lambda: gpt.GPT(cfg), batch, lambda model: list(model.blocks),
                    {"kind": "GPT (zerograph.models.gpt), random tokens", "size": size,
                     **dataclasses.asdict(cfg), "global_batch": batch_size})


def load_factory(spec: str) -> Callable[[], tuple[nn.Module, Callable]]:
    """The ``factory`` named by ``--model module:factory``, imported (in the calling process, so the
    launcher can refuse a bad name before any rank starts). Raises ``ConfigError`` naming the flag
    and the cause (chained)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--model {spec!r}: expected module:factory (e.g. mypackage.models:build)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module's own code raised while importing
        first_line = (str(exc).splitlines() or [""])[0]
        raise ConfigError(f"--model {spec}: cannot import {module_name!r}: {type(exc).__name__}: {first_line}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"--model {spec}: module {module_name!r} has no callable {attr!r}")
    return factory


def _factory_workload(spec: str) -> Workload:
    factory = load_factory(spec)
    batch_fns: list[Callable] = []

    def build() -> nn.Module:
        model, batch_fn = factory()
        if not batch_fns:  # every call returns the same data; keep the first batch_fn
            batch_fns.append(batch_fn)
        return model

    def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
        if not batch_fns:
            build()
        return tuple(batch_fns[0](step, rank, world_size))

    def blocks(model: nn.Module) -> list[nn.Module]:
        return [module for _, module in find_units(model, None)]

    return Workload(spec, build, batch, blocks, {"kind": "user factory", "factory": spec})


def unique_params(model: nn.Module) -> int:
    """Ψ: elements of the model's parameters, each tied parameter counted once."""
    return sum(p.numel() for p in model.parameters())


def padded_params(model: nn.Module, world_size: int) -> int:
    """Ψ with every parameter padded to ``world_size`` equal row chunks (``Shard(0)``'s layout):
    the most a sharded collective can move per Ψ."""
    total = 0
    for p in model.parameters():
        if p.dim() == 0:
            total += 1
            continue
        rows = p.shape[0]
        total += -(-rows // world_size) * world_size * (p.numel() // rows)
    return total


def shapes_only(workload: Workload) -> nn.Module:
    """The workload's model on the meta device (shapes, no memory), or on the CPU when its
    factory cannot build there."""
    try:
        with torch.device("meta"):
            return workload.build()
    except Exception:  # a user factory that materialises values (e.g. loads weights)
        return workload.build()


def tokens_per_step(workload: Workload, world_size: int) -> int:
    return sum(workload.batch(0, r, world_size)[0].numel() for r in range(world_size))
