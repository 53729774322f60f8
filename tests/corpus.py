"""A generated corpus of block bodies for differential tests of the unit-template fast path.

Each body is a class of its own (``body_class``) whose ``forward`` runs a few fragments of the
op catalogue (``FRAGMENTS``) on a ``(B, T, W)`` activation, in one of the call and return shapes
of ``SHAPES`` (one tensor, a tuple, a dict, keyword arguments). ``model(body)`` puts ``N_BLOCKS``
identical blocks of it (one template kind) between an embedding stem and a linear head with a
cross-entropy loss. The corpus is the catalogue's fragments one by one plus seeded random
compositions (``corpus()``): the same names, bodies and initial weights in every process.

``Body.expects`` says which path the default build should take for the body's units: ``"template"``
(any call and return shape, random draws included) or ``"inline"`` (a body that writes a buffer in
place runs inline, ``templates/kinds.py``).
"""
from __future__ import annotations

import dataclasses
import math
import random

import torch
import torch.nn.functional as F
from torch import nn

B, T, W, VOCAB = 4, 8, 8, 16  # batch (divisible by 2 ranks), sequence, width, vocabulary
N_BLOCKS = 2
MODES = 3  # Fourier modes the spectral fragments mix (of T // 2 + 1)


class Fragment(nn.Module):
    """One op pattern of the catalogue: ``(B, T, W)`` float32 in, the same out."""


class Linear(Fragment):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class SpectralCat(Fragment):
    """A complex64 weight mixing the lowest Fourier modes along T (an FNO layer): rfft, the modes
    times the weight, the rest zeros (``cat``), irfft."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(W, MODES, dtype=torch.complex64) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(x, dim=1)
        modes = torch.einsum("bmc,cm->bmc", f[:, :MODES], self.w)
        mixed = torch.cat([modes, torch.zeros_like(f[:, MODES:])], dim=1)
        return x + torch.fft.irfft(mixed, n=T, dim=1)


class SpectralIndexPut(Fragment):
    """As ``SpectralCat``, the modes written into a zero spectrum in place (``out[:, :m] = ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(MODES, W, dtype=torch.complex64) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(x, dim=1)
        out = torch.zeros_like(f)
        out[:, :MODES] = f[:, :MODES] * self.w
        return x + torch.fft.irfft(out, n=T, dim=1)


class Rope(Fragment):
    """A complex RoPE table as a buffer: pairs of features as complex numbers, rotated by position."""

    def __init__(self) -> None:
        super().__init__()
        freqs = 1.0 / (100 ** (torch.arange(0, W, 2).float() / W))
        angles = torch.outer(torch.arange(T).float(), freqs)
        self.register_buffer("table", torch.polar(torch.ones_like(angles), angles))
        self.fc = nn.Linear(W, W, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(self.fc(x).unflatten(-1, (W // 2, 2)))
        return x + torch.view_as_real(pairs * self.table).flatten(-2)


class ComplexGain(Fragment):
    """A complex parameter applied through ``view_as_complex`` / ``view_as_real``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(W // 2, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.unflatten(-1, (W // 2, 2)).contiguous())
        return torch.view_as_real(pairs * self.gain).flatten(-2)


class Einsum(Fragment):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(W, W) / math.sqrt(W))
        self.time = nn.Parameter(torch.eye(T) + torch.randn(T, T) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btw,wv,st->bsv", x, self.mix, self.time)


class InplaceMul(Fragment):
    """In-place ops on activations: ``mul_`` and ``add_`` of a layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.mul_(self.scale)
        y.add_(x)
        return y


class SliceAdd(Fragment):
    """``y[..., :k] += ...``: a write into a slice of an activation, then the whole read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)  # addmm saves its inputs, not its output: the write is eager-legal
        y[..., : W // 2] += x[..., W // 2:]
        return torch.tanh(y)


class ViewWrite(Fragment):
    """A write through views (transpose, reshape, narrow) of an activation; the base read after."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).transpose(1, 2).contiguous()  # (B, W, T)
        y.reshape(-1, T).narrow(1, 0, T // 2).mul_(2.0)
        y.narrow(1, 1, 2).sub_(x.transpose(1, 2)[:, :2])
        return y.transpose(1, 2)


class Casts(Fragment):
    """Round trips through float64 and bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.w64 = nn.Parameter(torch.randn(W, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = (self.fc(x).double() * self.w64).sin()
        return x + wide.float() + x.to(torch.bfloat16).float() * 0.25


class RunningStat(Fragment):
    """A running-mean buffer updated in place under ``no_grad`` (batch norm's statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.register_buffer("running", torch.zeros(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(y.mean((0, 1)), alpha=0.1)
        return y - self.running


class Dropout(Fragment):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(self.fc(x), 0.25, self.training)


class Unused(Fragment):
    """A layer the body never calls (its gradient stays ``None``) beside one it does."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.used(x)


class Nested(Fragment):
    """Parameters in nested containers: a dict of lists of layers and a parameter list."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleDict({"a": nn.ModuleList([nn.Linear(W, W), nn.Linear(W, W)]),
                                       "b": nn.ModuleList([nn.Linear(W, W)])})
        self.gates = nn.ParameterList([nn.Parameter(torch.full((W,), 0.5)), nn.Parameter(torch.full((W,), 0.25))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branches["a"][1](torch.tanh(self.branches["a"][0](x)))
        return x + a * self.gates[0] + self.branches["b"][0](x) * self.gates[1]


class MaskBuffer(Fragment):
    """A bool buffer (a causal mask) and an integer buffer read, never written."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).tril())
        self.register_buffer("order", torch.arange(T - 1, -1, -1))
        # no bias: softmax is shift-invariant along the keys, so a bias's exact gradient is 0 and
        # AdamW turns its rounding noise into lr-sized steps of either sign, different per build
        self.fc = nn.Linear(W, W, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ self.fc(x).transpose(1, 2)).masked_fill(~self.mask, float("-inf")).softmax(-1)
        return x + (scores @ x)[:, self.order]


FRAGMENTS: dict[str, type[Fragment]] = {cls.__name__: cls for cls in Fragment.__subclasses__()}
# fragments whose units run inline whatever the call shape (a write to a buffer)
INLINE_FRAGMENTS = frozenset({"RunningStat"})
SHAPES = ("tensor", "tuple", "dict", "kwargs")  # how a block is called and what it returns


class Block(nn.Module):
    """A block of the corpus: its fragments in order; ``shape`` its call and return shape."""

    fragments: tuple[str, ...] = ()
    shape: str = "tensor"

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList(FRAGMENTS[name]() for name in self.fragments)

    def forward(self, x, *, scale=None, skip=None):
        for part in self.parts:
            x = part(x)
        if scale is not None:
            x = x * scale
        if skip is not None:
            x = x + skip
        if self.shape == "tuple":
            return x, x.square().mean()
        if self.shape == "dict":
            return {"x": x, "aux": x.abs().mean()}
        return x


@dataclasses.dataclass(frozen=True)
class Body:
    name: str
    fragments: tuple[str, ...]
    shape: str = "tensor"

    @property
    def expects(self) -> str:
        """The path the default build should take: ``"template"`` or ``"inline"``."""
        return "inline" if INLINE_FRAGMENTS & set(self.fragments) else "template"


def body_class(body: Body) -> type[Block]:
    """A class of its own per body, so no two bodies share a template kind."""
    return type(f"Body_{body.name}", (Block,), {"fragments": body.fragments, "shape": body.shape})


class Model(nn.Module):
    """Embedding stem, ``N_BLOCKS`` blocks of one body, linear head, cross-entropy (+ the blocks'
    auxiliary outputs, for the tuple and dict shapes)."""

    def __init__(self, block: type[Block]) -> None:
        super().__init__()
        self.stem = nn.Embedding(VOCAB, W)
        self.blocks = nn.ModuleList(block() for _ in range(N_BLOCKS))
        self.head = nn.Linear(W, VOCAB)
        self.kwargs = block.shape == "kwargs"

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = stem = self.stem(tokens)
        aux = x.new_zeros(())
        for i, block in enumerate(self.blocks):
            if not self.kwargs:
                out = block(x)
            else:  # a float that differs by unit, a tensor, a None
                out = block(x, scale=0.5, skip=None) if i % 2 == 0 else block(x, scale=1.5, skip=stem)
            if isinstance(out, tuple):
                out, extra = out
                aux = aux + extra
            elif isinstance(out, dict):
                out, aux = out["x"], aux + out["aux"]
            x = out
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten()) + 0.1 * aux


def model(body: Body, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(body_class(body))


def batch(step: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch of tokens and targets, ``(B, T)`` int64 each (``rows``: a rank's)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens, targets = torch.randint(0, VOCAB, (2, B, T), generator=g)
    return tokens[rows], targets[rows]


def corpus(compositions: int = 6, seed: int = 0) -> list[Body]:
    """Every fragment alone (one tensor in and out), each call shape once on a linear body, and
    ``compositions`` seeded random bodies of two or three fragments in a random shape."""
    bodies = [Body(name, (name,)) for name in FRAGMENTS]
    bodies += [Body(f"Linear_{shape}", ("Linear",), shape) for shape in SHAPES[1:]]
    rng = random.Random(seed)
    names = sorted(FRAGMENTS)
    for i in range(compositions):
        parts = tuple(rng.sample(names, rng.choice((2, 3))))
        shape = rng.choice(SHAPES)
        bodies.append(Body(f"mix{i}_{'_'.join(parts)}_{shape}", parts, shape))
    return bodies
