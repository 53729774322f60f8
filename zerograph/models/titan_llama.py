"""A Llama 3 whose code has the shape of torchtitan's (``torchtitan/models/llama3/model/model.py``):
the calling conventions a compiler meets on a real torchtitan model, in a file of our own.

What it keeps of torchtitan, beside ``zerograph.models.llama`` (the same layers, called the simple way):
  - the blocks are called with keywords, ``layer(h, self.freqs_cis, attention_masks=..., positions=...)``,
    each block passing ``attention_masks`` and ``positions`` on to its attention;
  - ``forward(tokens, attention_masks=None, positions=None)`` returns logits ``(B, T, vocab)``: the loss
    is the trainer's (``cross_entropy_loss``), outside the model;
  - ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` (a pipeline stage that lacks them passes
    its input through), and the layers sit in an ``nn.ModuleDict`` keyed ``"0"`` .. ``"n-1"``;
  - ``init_weights(buffer_device)`` on the root re-assigns the non-persistent RoPE buffer ``freqs_cis``
    and calls every block's ``init_weights(buffer_device)``; the constructor draws no random numbers.
The feed-forward layer, the RoPE table and the config are ``zerograph.models.llama``'s.

Source: Dubey et al. 2024 (Llama 3); torchtitan's ``Transformer`` / ``TransformerBlock`` / ``Attention``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import llama
from .llama import LlamaConfig, precompute_freqs_cis

__all__ = ["Attention", "LlamaConfig", "Transformer", "TransformerBlock", "apply_rotary_emb", "cross_entropy_loss"]


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key ``(B, T, heads, head_dim)`` by RoPE: token ``t`` by ``freqs_cis[t]``, or by
    ``freqs_cis[positions[b, t]]`` when ``positions`` ``(B, T)`` int64 is given (packed documents)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))       # (B, T, h, hd // 2)
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    if positions is None:
        freqs = freqs_cis[: xq.shape[1]].unsqueeze(0)                           # (1, T, hd // 2)
    else:
        freqs = freqs_cis[positions]                                            # (B, T, hd // 2)
    freqs = freqs.unsqueeze(2)                                                  # (B | 1, T, 1, hd // 2)
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(llama.Attention):
    """Grouped-query attention with RoPE (``zerograph.models.llama.Attention``'s layers and init),
    called as torchtitan calls it: ``attention_masks`` ``None`` is causal, else a boolean
    ``(B | 1, 1, T, T)`` mask for ``scaled_dot_product_attention`` (True: may attend)."""

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)                   # (B, T, nh, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)                # (B, T, nkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis, positions)
        repeat = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))              # (B, T, nh, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                         # (B, nh, T, hd)
        if attention_masks is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))                      # (B, T, dim)


class TransformerBlock(llama.TransformerBlock):
    """``zerograph.models.llama.TransformerBlock``'s layers and init; torchtitan's calls."""

    attention_class = Attention

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """``buffer_device``: unused (a block holds no buffer); torchtitan's blocks take it too."""
        super().init_weights()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, attention_masks: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: ``tokens`` ``(B, T)`` int64 -> logits ``(B, T, vocab_size)`` (fp32 for fp32 weights).

    Build it on ``torch.device("meta")``, give it storage (``to_empty``), then call ``init_weights``.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.model_args = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        cfg = self.model_args
        return precompute_freqs_cis(cfg.dim // cfg.n_heads, cfg.max_seq_len * 2, cfg.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter, and re-assign (not write into) ``freqs_cis`` on ``buffer_device``
        (default: where the buffer is)."""
        self.init_root(buffer_device)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights(buffer_device=buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        self.init_output()

    def init_root(self, buffer_device: torch.device | None = None) -> None:
        """``init_weights``' first share: ``freqs_cis`` re-assigned, the embedding drawn."""
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self._precompute_freqs_cis()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)

    def init_output(self) -> None:
        """``init_weights``' last share: the output projection, truncated normal of std ``dim ** -0.5``."""
        if self.output is not None:
            std, cutoff = self.model_args.dim ** -0.5, 3
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)

    def forward(self, tokens: torch.Tensor, attention_masks: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens   # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks=attention_masks, positions=positions)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h                          # (B, T, vocab)


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: mean cross-entropy of logits ``(B, T, V)`` against ``labels`` ``(B, T)``
    int64, computed in fp32 (torchtitan's ``cross_entropy_loss``)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
