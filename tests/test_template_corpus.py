"""Differential tests of the unit-template fast path on a generated corpus of block bodies
(``tests/corpus.py``): each body's model trained two AdamW steps (weight decay on) by the default
build (``zerograph.Config()``: templates, flat shards) equals single-process eager training
(fp32, 1e-5): the losses, every gradient (``None`` where eager's is) and the parameters and
buffers after the steps; the per-parameter build (``unit_templates=False``) beside it says
whether a fault is the template path's. In process (a world of one, as the other in-process
parity tests), a sample at stages 1 and 3 in the fast lane, every body at stages 0-3 in the slow
one; a few bodies on two gloo ranks, each rank on its half of the batch, against eager on the
global batch."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerograph
from zerograph.graph.ops import UNIT_FORWARD
from zerograph.runtime.state import graphs_of, state_of

from . import corpus
from .distributed import spawn

RTOL = ATOL = 1e-5
STEPS, LR, WEIGHT_DECAY = 2, 1e-2, 0.1
BODIES = {body.name: body for body in corpus.corpus()}
# the fast lane's sample: complex weights and buffers, writes into activations, casts, a composition
FAST = ["SpectralCat", "SliceAdd", "ViewWrite", "mix4_InplaceMul_ComplexGain_tensor"]


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(body: corpus.Body, stage: int | None, config: zerograph.Config | None = None,
          rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """``body``'s model trained ``STEPS`` AdamW steps: eager on the global batch when ``stage`` is
    None, else compiled at ``stage`` with ``config`` on this rank's rows of it. Per step the loss
    and every gradient (``None`` kept); then the parameters, the buffers and, compiled, the path
    each unit kind took (``None``: its template; else why it ran inline)."""
    model = corpus.model(body)
    if stage is not None:
        model = zerograph.compile(model, stage, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    share = corpus.B // world_size
    rows = slice(rank * share, (rank + 1) * share) if stage is not None else slice(None)
    run: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(STEPS):
        torch.manual_seed(1000 + step)  # dropout's draws: the same in every build (world of one)
        loss = model(*corpus.batch(step, rows))
        loss.backward()
        if stage is not None and world_size > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world_size
        run["losses"].append(loss.item())
        run["grads"].append({name: _full(p.grad) for name, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    run["params"] = {name: _full(p) for name, p in model.named_parameters()}
    run["buffers"] = {name: _full(b) for name, b in model.named_buffers()}
    if stage is not None:
        run["path"] = unit_path(model)
    return run


def unit_path(model: torch.nn.Module) -> str:
    """How the compiled ``model``'s blocks ran: ``"template"`` (a ``unit_forward`` per block in
    the forward graphs), ``"inline"`` (none: a keyword call, or the kind fell back, with why), or
    ``"mixed"``."""
    calls = sum(n.target is UNIT_FORWARD for record in graphs_of(model) for n in record["forward"].graph.nodes)
    if calls == 0:
        reasons = [kind.inline_reason for kind in state_of(model).unit_kinds if kind.inline_reason]
        return "inline" + (f" ({reasons[0]})" if reasons else "")
    return "template" if calls == corpus.N_BLOCKS * len(graphs_of(model)) else f"mixed ({calls} unit_forward)"



def mismatches(ours: dict[str, Any], eager: dict[str, Any]) -> list[str]:
    """What differs between two runs of ``train`` beyond the tolerances (empty: nothing)."""
    found = []

    def compare(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        if (got is None) != (want is None):
            found.append(f"{what}: {'None' if got is None else 'a tensor'} where eager has "
                         f"{'None' if want is None else 'a tensor'}")
        elif want is not None:
            try:
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            except AssertionError:
                found.append(f"{what}: off by {(got - want).abs().max().item():.3g}")

    for step, (got, want) in enumerate(zip(ours["losses"], eager["losses"], strict=True)):
        compare(f"loss {step}", torch.tensor(got), torch.tensor(want))
    for step, (got, want) in enumerate(zip(ours["grads"], eager["grads"], strict=True)):
        for name in want:
            compare(f"grad {step} {name}", got[name], want[name])
    for kind in ("params", "buffers"):
        for name in eager[kind]:
            compare(f"{kind[:-1]} {name}", ours[kind][name], eager[kind][name])
    return found


def _eager(name: str, cache: dict[str, dict[str, Any]] = {}) -> dict[str, Any]:  # noqa: B006 (a cache)
    if name not in cache:
        cache[name] = train(BODIES[name], None)
    return cache[name]


def check_body(name: str, stage: int) -> list[str | None]:
    """The default build of body ``name`` at ``stage`` equals eager; on a mismatch the message
    says whether the per-parameter build has it too. Returns the path its blocks took (``unit_path``)."""
    eager = _eager(name)
    ours = train(BODIES[name], stage, zerograph.Config())
    found = mismatches(ours, eager)
    if found:
        plain = mismatches(train(BODIES[name], stage, zerograph.Config(unit_templates=False)), eager)
        where = "the per-parameter build too" if plain else "the per-parameter build equals eager"
        pytest.fail(f"{name} at stage {stage} ({where}; {ours['path']}):\n  " + "\n  ".join(found[:12]))
    return ours["path"]


def check_path(name: str, path: str) -> None:
    """The blocks ran their template, or inline, as ``Body.expects`` says."""
    expects = BODIES[name].expects
    assert path.split()[0] == ("inline" if expects == "inline" else "template"), f"{name}: expected {expects}, ran {path}"


def check(name: str, stage: int) -> None:
    """``check_body``, then the path its blocks took."""
    check_path(name, check_body(name, stage))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", FAST)
def test_a_sample_of_the_corpus_trains_as_eager(name: str, stage: int) -> None:
    check(name, stage)


def _slow_cases() -> list[tuple[str, int]]:
    """Every body at stage 3 and at one of stages 0-2 in turn (``ZEROGRAPH_CORPUS_FULL=1``: at
    every stage), less the fast lane's."""
    full = os.environ.get("ZEROGRAPH_CORPUS_FULL") == "1"
    cases = [(name, stage) for i, name in enumerate(BODIES)
             for stage in ((0, 1, 2, 3) if full else sorted({i % 3, 3}))]
    return [(name, stage) for name, stage in cases if name not in FAST or stage not in (1, 3)]


@pytest.mark.slow  # the rest of the corpus
@pytest.mark.parametrize("name, stage", _slow_cases())
def test_every_body_trains_as_eager_on_its_expected_path(name: str, stage: int) -> None:
    check(name, stage)


DISTRIBUTED = {1: ["SpectralCat", "Unused"], 3: ["SpectralIndexPut", "Rope", "Casts"]}


def _two_ranks(rank: int, world_size: int) -> dict[tuple[str, int], Any]:
    return {(name, stage): train(BODIES[name], stage, zerograph.Config(), rank, world_size)
            for stage, names in DISTRIBUTED.items() for name in names}


@pytest.mark.distributed
def test_a_few_bodies_on_two_ranks_train_as_eager_on_the_global_batch() -> None:
    """Real collectives (complex weights and buffers, an unused layer, casts; stages 1 and 3):
    each rank's losses (averaged over the ranks), gradients and parameters equal eager's on the
    global batch."""
    for result in spawn(_two_ranks, 2):
        for (name, stage), run in result.items():
            found = mismatches(run, _eager(name))
            assert not found, f"{name} at stage {stage}:\n  " + "\n  ".join(found[:12])
