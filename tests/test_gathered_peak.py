"""Gathered parameters alive at once (issue 42, item 2), counted in bytes, not timed.

Rank 0 of a fake world of ``WORLD`` in this process; one stage-3 step; the peak of the gathered
parameters alive at once is read from the liveness of the graphs that ran
(``zerograph.stats(...).transient_bytes["params"]``, per graph ``Timeline.peak``). With the default
``prefetch_depth=1`` the schedule holds the unit in use and the one in flight: no graph may hold more
than its two largest units gathered plus the root (the parameters used outside blocks), plus the
copy-in send buffers of the gathers in flight (each a unit's 1/N, this rank's shards). Before the
fix, a unit's copy-out (``unpack_gathered``: rank-major buffer and unpacked copy both alive) ran
after the next unit's gather had started, so three units were alive there. With
``gather_in_place`` a unit is not copied out at all: held once, not twice
(``test_a_gathered_unit_is_held_once_not_twice``).
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
from zerograph.passes.liveness import PARAM_ROLES, reads, storage_root
from zerograph.sharding import ROOT_INDEX
from zerograph.state import graphs_of, state_of
from zerograph.vocab import TAG

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
    peaks = {kind: t.peak(PARAM_ROLES) for mem in state_of(model).runtime.graph_memory for kind, t in mem.items()}
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


def _gpt_step(templates: bool, in_place: bool | None = None) -> tuple[torch.nn.Module, zerograph.Stats]:
    """The small GPT at stage 3, one step as rank 0 of a fake world of ``WORLD``, with unit
    templates (the default build) or without; ``in_place``: ``gather_in_place`` (``None``: the default)."""
    cfg = GPT_CONFIG
    extra = {} if in_place is None else {"gather_in_place": in_place}
    with fake_rank(WORLD):
        torch.manual_seed(0)
        model = zerograph.compile(GPT(cfg), stage=3, config=zerograph.Config(unit_templates=templates, **extra))
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
    from zerograph.unit_trace import _CUTTING_OPS

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


def _alive_per_unit(graph: torch.fx.Graph) -> dict[int, int]:
    """Per unit, the most bytes of its gathered storages (nodes tagged ``gather`` that allocate)
    alive at once in ``graph``, by ``liveness``' rules (a storage lives to the last read of any
    alias of it; a send buffer to its collective's wait)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    span: dict[torch.fx.Node, list[int]] = {}
    for node in nodes:
        val = node.meta.get("val")
        if (node.meta.get(TAG, {}).get("role") == "gather" and isinstance(val, torch.Tensor) and val.numel()
                and storage_root(node) is node):
            span[node] = [pos[node], pos[node]]
    for node in nodes:
        for inp in reads(node):
            root = storage_root(inp)
            if root in span:
                span[root][1] = len(nodes) if node.op == "output" else max(span[root][1], pos[node])
    alive: dict[int, int] = {}
    for i in range(len(nodes)):
        now: dict[int, int] = {}
        for root, (first, last) in span.items():
            if first <= i <= last:
                (unit,) = root.meta[TAG]["units"]  # per-parameter build: a bucket per unit
                now[unit] = now.get(unit, 0) + root.meta["val"].numel() * root.meta["val"].element_size()
        for unit, nbytes in now.items():
            alive[unit] = max(alive.get(unit, 0), nbytes)
    return alive


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied-out"])
def test_a_gathered_unit_is_held_once_not_twice(gpt_step, in_place: bool) -> None:
    """Issue 42, "gather once, in place": with ``gather_in_place`` each parameter is gathered into
    its own tensor and viewed, so a unit's gathered storages alive at once, in forward and in
    backward, are at most its padded parameter bytes plus this rank's padded shards (send
    buffers). Copied out (the rank-major buffer, then ``unpack_gathered``), both copies are alive
    during the copy-out: at least twice the parameter bytes, which the same count shows."""
    model, _ = gpt_step(False, in_place)
    rt = state_of(model).runtime
    layouts = [[rt.marker_layouts[k] for k in unit.keys] for unit in rt.units]
    padded = [sum(la.padded_numel * la.param_dtype.itemsize for la in unit) for unit in layouts]
    exact = [sum(la.numel * la.param_dtype.itemsize for la in unit) for unit in layouts]
    seen = 0
    for graphs in graphs_of(model):
        for kind in ("forward", "backward"):
            for unit, nbytes in _alive_per_unit(graphs[kind].graph).items():
                seen += 1
                if in_place:
                    assert nbytes <= padded[unit] + padded[unit] // WORLD, (kind, unit, nbytes, padded[unit])
                else:
                    assert nbytes >= 2 * exact[unit], (kind, unit, nbytes, exact[unit])
    assert seen >= 2 * len(rt.units)  # every unit gathered in forward and again in backward
