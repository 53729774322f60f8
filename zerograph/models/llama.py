"""A Llama 3 built the way torchtitan builds it (``torchtitan/models/llama3/model/model.py``), small
enough to read in a few minutes, for tests and benchmarks of models whose blocks are not one
``nn.ModuleList``.

What makes it torchtitan's, not Hugging Face's: the layers sit in an ``nn.ModuleDict`` keyed
``"0"`` .. ``"n-1"`` (so that pipeline stages can delete some and keep the names of the others);
the RoPE table ``freqs_cis`` is a non-persistent complex buffer on the root; the constructor
initialises nothing random: a model is built on the meta device, given storage, then
``init_weights()`` fills it, and re-assigns ``freqs_cis`` rather than writing into it.
Source: Dubey et al. 2024 (Llama 3); torchtitan (``TransformerModelArgs``, ``Transformer``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    dim: int = 256                  # model width
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None   # grouped-query attention: heads of k and v (None: n_heads)
    vocab_size: int = 256           # bytes
    multiple_of: int = 32           # the FFN's hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 128          # longest context, tokens (the RoPE table holds twice that, as torchtitan's)
    depth_init: bool = True         # output projections' init std shrinks with the layer's depth


SIZES = {  # named sizes for tests and benchmarks
    "tiny": LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16),
    "small": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4),
}


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """The rotations of RoPE, ``(end, dim // 2)`` complex64: position ``t``, pair ``i`` turns by
    ``t * theta ** (-2i / dim)``. Source: Su et al. 2021 (RoFormer); torchtitan's function of this name."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))  # (dim // 2,)
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()                                         # (end, dim // 2)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key ``(B, T, heads, head_dim)`` by ``freqs_cis[:T]``."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))       # (B, T, h, hd // 2)
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])     # (1, T, 1, hd // 2)
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)                   # (B, T, nh, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)                # (B, T, nkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        repeat = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))              # (B, T, nh, hd)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))                      # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hidden = int(2 * 4 * cfg.dim / 3)
        if cfg.ffn_dim_multiplier is not None:
            hidden = int(cfg.ffn_dim_multiplier * hidden)
        hidden = cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))                         # SwiGLU


class TransformerBlock(nn.Module):
    attention_class: type[nn.Module] = Attention  # a subclass's blocks may call their attention another way

    def __init__(self, layer_id: int, cfg: LlamaConfig):
        super().__init__()
        self.attention = self.attention_class(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        depth = layer_id + 1 if cfg.depth_init else cfg.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len * 2, self.cfg.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's init of the whole model (after ``to_empty``). Note the buffer: re-assigned."""
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        self._init_output()

    def _init_output(self) -> None:
        std, cutoff = self.cfg.dim ** -0.5, 3
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)

    def init_module(self, module: nn.Module) -> None:
        """``init_weights`` as one module's share, for ``zerograph.init_weights(model,
        model.init_module)`` on a compiled, meta-built model: each piece runs when the walk reaches
        its module, in the same order, so the same seed gives bitwise ``init_weights``'s values.
        (``init_weights`` itself, given for the root, would write the blocks, which are other units.)"""
        if module is self:
            with torch.device(self.freqs_cis.device):
                self.freqs_cis = self._precompute_freqs_cis()  # re-assigned, as torchtitan does
            nn.init.normal_(self.tok_embeddings.weight)
        elif isinstance(module, TransformerBlock):
            module.init_weights()
        elif module is self.norm:
            module.reset_parameters()
        elif module is self.output:
            self._init_output()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens``, ``targets``: (B, T) int64, T <= max_seq_len. Returns the mean cross-entropy
        loss (scalar) when ``targets`` is given, else logits (B, T, vocab_size)."""
        h = self.tok_embeddings(tokens)                                          # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        logits = self.output(self.norm(h))                                       # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
