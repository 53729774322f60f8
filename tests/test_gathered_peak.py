"""Gathered parameters alive at once, counted in bytes, not timed.

Rank 0 of a fake world of ``WORLD`` in this process; one stage-3 step; the peak of the gathered
parameters alive at once is read from the liveness of the graphs that ran
(``zerograph.stats(...).transient_bytes["params"]``, per graph ``Timeline.peak``). With the default
``prefetch_depth=1`` the schedule holds the unit in use and the one in flight: no graph may hold more
than its two largest units gathered plus the root (the parameters used outside blocks), plus the
copy-in send buffers of the gathers in flight (each a unit's 1/N, this rank's shards). Before the
fix, a unit's copy-out (``unpack_gathered``: rank-major buffer and unpacked copy both alive) ran
after the next unit's gather had started, so three units were alive there.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import zerograph
from zerograph.models.gpt import GPT
from zerograph.models.gpt import SIZES as GPT_SIZES
from zerograph.models.llama import SIZES as LLAMA_SIZES
from zerograph.models.llama import Llama
from zerograph.passes.liveness import PARAM_ROLES, storage_root
from zerograph.runtime.state import state_of
from zerograph.shard.sharding import ROOT_INDEX

from .distributed import fake_rank

WORLD = 8
# the "small" sizes with 3 blocks instead of 4: a root and three blocks, the fewest in which a
# third unit alive at once would show (``_check``)
GPT_CONFIG = dataclasses.replace(GPT_SIZES["small"], n_layer=3)
LLAMA_CONFIG = dataclasses.replace(LLAMA_SIZES["small"], n_layers=3)


def _step(model: torch.nn.Module, vocab: int, seq: int) -> zerograph.Stats:
    x = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x[:, :-1], x[:, 1:]).backward()
    return zerograph.stats(model, opt)


def _bound(model: torch.nn.Module) -> tuple[int, dict]:
    """Two largest non-root units gathered + the root + two units' send buffers (shards), bytes."""
    rt = state_of(model).runtime
    gathered = [sum(rt.marker_layouts[k].padded_numel * rt.marker_layouts[k].param_dtype.itemsize
                    for k in unit.keys) for unit in rt.units]
    blocks = sorted((b for i, b in enumerate(gathered) if i != ROOT_INDEX), reverse=True)
    sends = 2 * -(-blocks[0] // WORLD)
    return sum(blocks[:2]) + gathered[ROOT_INDEX] + sends, {"units": gathered, "sends": sends}


def _check(model: torch.nn.Module, stats: zerograph.Stats) -> None:
    bound, parts = _bound(model)
    assert len(parts["units"]) >= 4  # a root and three blocks at least: a third unit would show
    peaks = {kind: t.peak(PARAM_ROLES) for mem in state_of(model).runtime.accounting.graph_memory for kind, t in mem.items()}
    assert peaks and all(peak <= bound for peak in peaks.values()), (peaks, bound, parts)
    assert stats.transient_bytes["params"] <= bound, (stats.transient_bytes, bound, parts)


@pytest.mark.parametrize("templates", [True, False], ids=["templates", "per-parameter"])
def test_llama_holds_at_most_two_units_and_the_root(templates: bool) -> None:
    """torchtitan's Llama (layers in a ModuleDict, each handed the root's complex RoPE table): with
    unit templates its blocks are templated on flat shards (viewed, not unpacked), the three
    layers calling one trace (their ``weight_init_std`` differs, which ``forward`` never reads);
    without, per-parameter buckets, unpacked (``unpack_gathered``), the path that held three units."""
    cfg = LLAMA_CONFIG
    with fake_rank(WORLD):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Llama(cfg)
        model = zerograph.compile(model, stage=3, device="cpu", config=zerograph.Config(unit_templates=templates))
        zerograph.init_weights(model, model.init_module)
        stats = _step(model, cfg.vocab_size, 32)
        assert bool(state_of(model).runtime.flat_shards) == templates
        if templates:
            kinds = state_of(model).unit_kinds
            assert [k.inline_reason for k in kinds] == [None] * cfg.n_layers
            traced = [t for k in kinds for t in k.templates.values() if t.reused_from is None]
            assert len(traced) <= 1  # none when an earlier test in this process traced the same block
        _check(model, stats)


def _gpt_step(templates: bool) -> tuple[torch.nn.Module, zerograph.Stats]:
    """The small GPT at stage 3, one step as rank 0 of a fake world of ``WORLD``, with unit
    templates (the default build) or without."""
    cfg = GPT_CONFIG
    with fake_rank(WORLD):
        torch.manual_seed(0)
        model = zerograph.compile(GPT(cfg), stage=3, config=zerograph.Config(unit_templates=templates))
        return model, _step(model, cfg.vocab_size, cfg.block_size)


@pytest.fixture(scope="module")
def gpt_step():
    """``_gpt_step``, each build once for this file's tests (the default build's for two)."""
    return functools.lru_cache(maxsize=None)(_gpt_step)


@pytest.mark.parametrize("templates", [True, False], ids=["templates", "per-parameter"])
def test_gpt_holds_at_most_two_units_and_the_root(gpt_step, templates: bool) -> None:
    """The GPT (blocks in a ModuleList) with unit templates (flat shards: the gathered buffer is
    viewed, not unpacked) and without (per-parameter buckets, unpacked)."""
    model, stats = gpt_step(templates)
    assert bool(state_of(model).runtime.flat_shards) == templates
    _check(model, stats)


def test_template_cuts_parameters_out_of_the_flat_shard_at_their_uses(gpt_step) -> None:
    """A templated unit's body cuts each parameter out of its gathered flat shard (a copy where
    ranks' rows interleave); cut at their uses, not all at the top, the copies alive at once in
    the forward body stay well below the unit's bytes (before: every parameter copied at once)."""
    from zerograph.templates.unit_trace import _CUTTING_OPS

    assert zerograph.Config().unit_templates  # the default build: gpt_step(True)
    model, _ = gpt_step(True)
    # this model's templates only: the registry also holds other tests' (a weak, process-wide table)
    templates = [t for kind in state_of(model).unit_kinds for t in kind.templates.values()]
    assert templates
    for template in templates:
        graph = template.forward_graph.graph
        nodes = list(graph.nodes)
        flat = max((n for n in nodes if n.op == "placeholder"), key=lambda n: n.meta["val"].numel())
        cuts, stack = [], [flat]
        while stack:
            for user in stack.pop().users:
                if user.target in _CUTTING_OPS and user not in cuts:
                    cuts.append(user)
                    stack.append(user)
        copies = [n for n in cuts if n.target is torch.ops.aten.clone.default]
        pos = {n: i for i, n in enumerate(nodes)}
        last = {c: pos[c] for c in copies}
        for node in nodes:  # a copy lives to the last read of it or of a view of it
            for inp in node.all_input_nodes:
                root = storage_root(inp)
                if root in last:
                    last[root] = max(last[root], pos[node])
        alive = max(sum(c.meta["val"].numel() for c in copies if pos[c] <= i <= last[c]) for i in range(len(nodes)))
        assert len(copies) > 2 and alive <= flat.meta["val"].numel() // 2, (alive, flat.meta["val"].numel())
