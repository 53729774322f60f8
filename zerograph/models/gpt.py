"""A GPT-2-style decoder, small enough to read in a few minutes (after nanoGPT).

Token + position embedding, ``n_layer`` pre-norm blocks (causal self-attention, then an MLP), a
final LayerNorm and an LM head whose weight is the token embedding's (weight tying, as in GPT-2).
Source: Radford et al. 2019 (GPT-2); Karpathy's nanoGPT.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256   # bytes
    block_size: int = 64    # longest context, tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128       # model width; n_embd % n_head == 0
    dropout: float = 0.0    # 0 keeps runs bitwise comparable across ranks and stages


SIZES = {  # named sizes for examples, tests and benchmarks
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=128, n_layer=6, n_head=6, n_embd=384),
    "gpt2-124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)                                   # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))                  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def init_passes(self) -> list[Callable[[nn.Module], None]]:
        """``__init__``'s random stream as per-module passes, for ``zerograph.init_weights`` on a
        model built on the meta device: each layer's own ``reset_parameters`` (what its constructor
        ran), then ``_init_weights`` (``self.apply``'s visits), then GPT-2's scaled init of the
        residual projections. With the same seed the gathered model is bitwise an ordinary build."""
        projections = {id(m) for name, m in self.named_modules() if name.endswith("proj")}
        n_layer = self.cfg.n_layer

        def reset_parameters(module: nn.Module) -> None:
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

        def scaled_projection(module: nn.Module) -> None:
            if id(module) in projections:
                nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        return [reset_parameters, GPT._init_weights, scaled_projection]

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``, ``targets``: (B, T) int64 token ids, T <= block_size. Returns the mean
        cross-entropy loss (scalar) when ``targets`` is given, else logits (B, T, vocab_size)."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)                                # (T,)
        x = self.wte(idx) + self.wpe(pos)                                       # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                                     # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
