"""Models zerograph was not written against, for the bench and ``zerograph memory``: Hugging Face
``transformers``' GPT-2 and Llama built from small configs (no download), used unchanged, and the
torchtitan-shaped Llama 3 of ``zerograph.models.titan_llama``.

Each is a ``RealModel``: how to build it at a size, which modules FSDP2 wraps one by one (the ones
zerograph finds as its units), how the trainer computes the loss outside the model (the HF models
as their users call them, ``model(input_ids=..., labels=...).loss``; the torchtitan one as its
trainer does, cross-entropy of the logits), and how a meta-built model is initialised one module at
a time (``zerograph.init_weights``'s ``fn``; FSDP2 walks the same modules after ``to_empty``).
The HF models keep their default dropout (GPT-2's 0.1, Llama's 0.0) and their default attention
(SDPA); ``use_cache=False``, as for training.

Source: ``transformers.GPT2LMHeadModel`` / ``LlamaForCausalLM`` and their ``_init_weights``;
torchtitan's ``Transformer.init_weights`` and ``cross_entropy_loss``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

ModuleInit = Callable[[nn.Module], None]


@dataclasses.dataclass(frozen=True)
class RealModel:
    """One model family.

    Attributes:
        name: as the bench's ``--model`` and ``zerograph memory``'s ``--models`` spell it.
        description: one line for reports.
        build: ``(dim, layers, heads, vocab, seq) -> nn.Module`` on the current default device
            (``torch.device("meta")`` gives a shapes-only model).
        blocks: the modules FSDP2 wraps one by one.
        loss: ``(model, tokens, targets) -> scalar`` mean loss; ``tokens``, ``targets`` ``(B, T)`` int64,
            ``targets`` the next tokens of ``tokens``.
        init_module: ``model -> fn``, ``fn(module)`` initialising that module's own parameters and
            buffers, called for every module in ``named_modules()`` order.
    """

    name: str
    description: str
    build: Callable[[int, int, int, int, int], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    init_module: Callable[[nn.Module], ModuleInit]

    def init(self, model: nn.Module) -> None:
        """Initialise a plain (or FSDP2-sharded) model that has storage, e.g. after ``to_empty``."""
        fn = self.init_module(model)
        with torch.no_grad():
            for module in model.modules():
                fn(module)


# --------------------------------------------------------------------------- Hugging Face GPT-2


def _hf_gpt2(dim: int, layers: int, heads: int, vocab: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads, use_cache=False)
    return GPT2LMHeadModel(config)


def _hf_llama(dim: int, layers: int, heads: int, vocab: int, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 256 * -(-int(8 * dim / 3) // 256)  # SwiGLU's 8/3 width, rounded up as Llama's sizes are
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=seq, use_cache=False)
    return LlamaForCausalLM(config)


def _hf_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """HF shifts ``labels`` itself: the labels of ``tokens`` are ``tokens``; ``targets`` (the shifted
    ones) is unused, so every family sees the same batch."""
    return model(input_ids=tokens, labels=tokens).loss


def _hf_init(model: nn.Module) -> ModuleInit:
    return model._init_weights


# --------------------------------------------------------------------------- torchtitan-shaped Llama 3


def _titan_llama(dim: int, layers: int, heads: int, vocab: int, seq: int) -> nn.Module:
    from ..models.titan_llama import LlamaConfig, Transformer

    return Transformer(LlamaConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=max(1, heads // 2),
                                   vocab_size=vocab, max_seq_len=seq))


def _titan_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from ..models.titan_llama import cross_entropy_loss

    return cross_entropy_loss(model(tokens), targets)


def _titan_init(model: nn.Module) -> ModuleInit:
    """``Transformer.init_weights`` split by module: the root's share (the re-assigned RoPE buffer and
    the embedding) when the walk reaches the root, then each block's, the norm's and the output's."""
    shares = {id(model): model.init_root, id(model.norm): model.norm.reset_parameters, id(model.output): model.init_output,
              **{id(layer): layer.init_weights for layer in model.layers.values()}}

    def init(module: nn.Module) -> None:
        if id(module) in shares:
            shares[id(module)]()

    return init


REAL_MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel("hf-gpt2", "transformers GPT2LMHeadModel from a GPT2Config, blocks in transformer.h",
              _hf_gpt2, lambda model: list(model.transformer.h), _hf_loss, _hf_init),
    RealModel("hf-llama", "transformers LlamaForCausalLM from a LlamaConfig, blocks in model.layers",
              _hf_llama, lambda model: list(model.model.layers), _hf_loss, _hf_init),
    RealModel("titan-llama", "zerograph.models.titan_llama (torchtitan's shape: ModuleDict layers called with "
              "keywords, freqs_cis re-assigned by init_weights), loss outside the model",
              _titan_llama, lambda model: list(model.layers.values()), _titan_loss, _titan_init),
)}
