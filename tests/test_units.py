"""Default unit discovery (``zerograph/shard/units.py``): the blocks of every stack of
repeated blocks are units (``ModuleDict`` layers, an encoder-decoder's two stacks, a two-tower
model's towers), the project's models keep their units, and ``compile`` warns at stage 3 when a
unit holding more than a quarter of the parameters holds repeated blocks. In process: discovery
reads module trees only; the compiles run as rank 0 of a fake world (no step is run).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zerograph
from zerograph.models.gpt import GPT
from zerograph.models.llama import Llama, LlamaConfig, TransformerBlock
from zerograph.runtime.state import state_of
from zerograph.shard.units import find_units, unit_shares

from .distributed import fake_rank
from .models import DEEP_GPT, TINY_GPT, UnevenMLP

LLAMA = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)


def names(model: nn.Module, unit_classes=None) -> list[str]:
    return [name for name, _ in find_units(model, unit_classes)]


class Block(nn.Module):
    """A pre-norm MLP block: a block class (a module whose children own parameters)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


class DecoderBlock(Block):
    def __init__(self, width: int = 16) -> None:
        super().__init__(width)
        self.cross = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.cross(memory))


class EncoderDecoder(nn.Module):
    """Two stacks under two submodules (BART / Whisper): encoder blocks and decoder blocks of
    another class, a shared embedding in the root."""

    def __init__(self, layers: int = 3, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(DecoderBlock(width) for _ in range(layers))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.embed(src)
        for layer in self.encoder.layers:
            memory = layer(memory)
        x = self.embed(tgt)
        for layer in self.decoder.layers:
            x = layer(x, memory)
        return (x @ self.embed.weight.T).logsumexp(-1).mean()


class Tower(nn.Module):
    def __init__(self, layers: int, width: int, stack: type[nn.Module]) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = stack(*[Block(width) for _ in range(layers)]) if stack is nn.Sequential \
            else stack(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TwoTowers(nn.Module):
    """CLIP-like: a text tower (blocks in a ModuleList) and a wider image tower (an nn.Sequential
    of blocks), a learned 0-d temperature in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.text = Tower(2, 16, nn.ModuleList)
        self.image = Tower(3, 24, nn.Sequential)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        logits = self.logit_scale * self.text(text) @ self.image(image).T
        return logits.logsumexp(-1).mean()


class UnlistedBlocks(nn.Module):
    """Blocks registered as plain attributes, in no container: discovery cannot see them."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        for i in range(layers):
            setattr(self, f"block{i}", Block())
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.layers):
            x = getattr(self, f"block{i}")(x)
        return x.square().mean()


# -- discovery --------------------------------------------------------------------------------------
def test_llama_layers_in_a_module_dict_are_units() -> None:
    with torch.device("meta"):
        model = Llama(LLAMA)
    assert names(model) == [f"layers.{i}" for i in range(LLAMA.n_layers)]
    shares = dict(unit_shares(model, find_units(model, None)))
    total = sum(shares.values())
    assert all(size < total / 4 for size in shares.values())  # no unit, the root included, holds a quarter
    assert [name for name, _ in zerograph.plan(model, 3, 8).units] == ["<root>", *names(model)]  # plan agrees


def test_encoder_decoder_stacks_of_two_block_classes_are_both_units() -> None:
    assert names(EncoderDecoder()) == [f"encoder.layers.{i}" for i in range(3)] + [f"decoder.layers.{i}" for i in range(3)]
    torch_transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=3, num_decoder_layers=2,
                                       dim_feedforward=32)
    assert names(torch_transformer) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2",
                                        "decoder.layers.0", "decoder.layers.1"]


def test_stacks_of_one_block_class_are_all_units_however_small() -> None:
    """A T5's encoder and decoder, a ResNet's stages: every stack of a block class already taken."""
    model = nn.Module()
    model.big = nn.ModuleList(Block(32) for _ in range(4))
    model.small = nn.Sequential(Block(4), Block(4))  # far smaller than one big block: taken for its class
    assert names(model) == [*(f"big.{i}" for i in range(4)), "small.0", "small.1"]


def test_two_towers_each_with_its_own_stack_are_units() -> None:
    model = TwoTowers()
    units = names(model)
    assert units == ["text.blocks.0", "text.blocks.1", "image.blocks.0", "image.blocks.1", "image.blocks.2"]
    with fake_rank(2):
        compiled = zerograph.compile(model, stage=3)
        runtime = state_of(compiled).runtime
        assert [u.name for u in runtime.units] == ["<root>", *units]
        root = {runtime.layouts[k].fqn for k in runtime.units[0].keys}
        assert root == {"text.stem.weight", "text.stem.bias", "text.head.weight", "text.head.bias",
                        "image.stem.weight", "image.stem.bias", "image.head.weight", "image.head.bias", "logit_scale"}


def test_the_project_models_keep_their_units() -> None:
    """The units the earlier rule chose (the children of the largest ModuleList / Sequential) still hold."""
    assert names(GPT(TINY_GPT)) == ["blocks.0", "blocks.1"]
    assert names(GPT(DEEP_GPT)) == [f"blocks.{i}" for i in range(DEEP_GPT.n_layer)]
    assert names(UnevenMLP()) == ["layers.0", "layers.1", "layers.2"]  # Tanh too: a unit with no parameters
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 5))
    assert names(plain) == ["0", "1", "2", "3"]  # the model itself is the stack
    linears = nn.Module()
    linears.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
    linears.head = nn.Linear(6, 2)
    assert names(linears) == ["blocks.0", "blocks.1", "blocks.2"]
    mixed = nn.Module()  # no stack of one class: the largest stack, as before
    mixed.layers = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))
    assert names(mixed) == ["layers.0", "layers.1", "layers.2", "layers.3"]


def test_a_module_dict_of_unrelated_parts_is_no_stack() -> None:
    """nanoGPT's ``transformer`` dict (wte, wpe, h, ln_f) holds the blocks' list: its parts are not units."""
    model = nn.Module()
    model.transformer = nn.ModuleDict({"wte": nn.Embedding(64, 16), "wpe": nn.Embedding(16, 16),
                                       "h": nn.ModuleList(Block() for _ in range(3)), "ln_f": nn.LayerNorm(16)})
    assert names(model) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_edge_cases_single_block_shared_blocks_and_tied_parameters() -> None:
    single = nn.Module()
    single.layers = nn.ModuleList([Block()])
    assert names(single) == []  # one block: no stack, the root holds it (as before)
    shared = nn.Module()  # one block object in both stacks: one unit, under its first name
    block = Block()
    shared.encoder = nn.ModuleList([block, Block()])
    shared.decoder = nn.ModuleList([block, Block()])
    assert names(shared) == ["encoder.0", "encoder.1", "decoder.1"]
    tied = EncoderDecoder()
    tied.decoder.layers[0].fc.weight = tied.encoder.layers[0].fc.weight  # one parameter in two units
    units = find_units(tied, None)
    shares = unit_shares(tied, units)
    assert sum(size for _, size in shares) == sum(p.numel() for p in tied.parameters())  # counted once
    cross = tied.decoder.layers[0].cross
    fc = tied.encoder.layers[0].fc.weight
    assert shares[4][1] == shares[1][1] - fc.numel() + cross.weight.numel() + cross.bias.numel()  # counted in encoder.layers.0


def test_unit_classes_overrides_discovery() -> None:
    model = EncoderDecoder()
    assert names(model, (DecoderBlock,)) == [f"decoder.layers.{i}" for i in range(3)]
    with torch.device("meta"):
        llama = Llama(LLAMA)
    assert names(llama, (nn.Linear,)) == [n for n, m in llama.named_modules() if isinstance(m, nn.Linear)]


# -- the warning ------------------------------------------------------------------------------------
def _compile_warnings(model: nn.Module, stage: int, config: zerograph.Config | None = None) -> list[str]:
    with fake_rank(2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerograph.compile(model, stage=stage, config=config)
    return [str(w.message) for w in caught if issubclass(w.category, zerograph.UnitSizeWarning)]


def test_compile_warns_when_a_large_unit_holds_repeated_blocks_naming_the_fix() -> None:
    with pytest.warns(zerograph.UnitSizeWarning, match=r"root unit .* holds 100%.*4 Block blocks.*"
                      r"Config\(unit_classes=\(Block,\)\)"):
        with fake_rank(2):
            zerograph.compile(UnlistedBlocks(), stage=3)
    assert _compile_warnings(UnlistedBlocks(), 3, zerograph.Config(unit_classes=(Block,))) == []  # the fix
    assert _compile_warnings(UnlistedBlocks(), 2) == []  # stages 0-2 gather no parameters per unit
    with torch.device("meta"):  # a unit too large: each of two towers, listed as one stack of two
        towers = nn.Sequential(Tower(3, 16, nn.ModuleList), Tower(3, 16, nn.ModuleList))
    assert len(found := _compile_warnings(towers, 3)) == 2 and "unit '0' holds 50%" in found[0], found
    with torch.device("meta"):
        llama = Llama(LLAMA)
    found = _compile_warnings(llama, 3, zerograph.Config(unit_classes=(nn.Embedding,)))
    assert len(found) == 1 and f"unit_classes=({TransformerBlock.__name__},)" in found[0]


def test_no_warning_where_no_split_exists_or_discovery_found_the_blocks() -> None:
    """A tiny GPT's root (embeddings: single layers, no blocks) and either of its two blocks hold
    more than a quarter each, but nothing inside them would split them: silent, as across the suite."""
    assert _compile_warnings(GPT(TINY_GPT), 3) == []
    assert _compile_warnings(UnevenMLP(), 3) == []
    with torch.device("meta"):
        assert _compile_warnings(Llama(LLAMA), 3) == []
        assert _compile_warnings(EncoderDecoder(), 3) == []


def test_explain_shows_each_units_share_of_the_parameters() -> None:
    with fake_rank(2):
        with torch.device("meta"):
            model = zerograph.compile(Llama(LLAMA), stage=3, device="cpu")
        summary = zerograph.explain(model)
    with torch.device("meta"):
        reference = Llama(LLAMA)
    shares = dict(unit_shares(reference, find_units(reference, None)))
    total = sum(shares.values())
    assert "| share of Ψ |" in summary
    for name, size in shares.items():
        assert f"| {name} |" in summary and f"| {size:,} | {size / total:.1%} |" in summary, name
