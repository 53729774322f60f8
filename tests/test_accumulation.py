"""Gradient accumulation: 4 micro-batches per optimizer step, stages 1-3 on 2
ranks, with gradient sync on every micro-batch and with sync off on the first 3
(``set_requires_gradient_sync(False)``, FSDP2's switch, or DDP's ``no_sync()`` context). Both must
equal single-process training on the full batch (loss = mean of the micro-batch losses, gradients
accumulated the same way) to 1e-5, gradients after each step's accumulation and parameters after
each optimizer step, for 2 steps.

One spawn runs every case (``tests.workers_precision.accumulation_runs``):
a model with a tied weight and a 0-d scale per stage and mode, and a model with a graph break
(eager frames accumulate through the runtime's fallback) at stage 3 without sync.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import zerograph
from zerograph.errors import HeldGradientsError
from zerograph.runtime.state import runtime_of_model

from .distributed import fake_rank, spawn
from .models import build, global_batch, reference_training
from .workers_precision import ACC_STEPS, MICRO, accumulation_reference, accumulation_runs, build_acc

STAGES = (1, 2, 3)
WORLD_SIZE = 2
ATOL = RTOL = 1e-5
CASES = tuple((name, stage, every) for stage in STAGES for name, every in (("accum", True), ("accum", False))) \
    + (("mlp_break", 3, False), ("accum_hooked", 3, False))


@pytest.fixture(scope="module")
def runs() -> dict:
    per_rank = spawn(accumulation_runs, WORLD_SIZE, CASES, timeout_s=600)
    return {case: [rank_out[case] for rank_out in per_rank] for case in CASES}


def run_of(runs: dict, case: tuple) -> list[dict]:
    for rank, result in enumerate(runs[case]):
        if isinstance(result, str):
            pytest.fail(f"{case} raised on rank {rank}:\n{result}", pytrace=False)
    return runs[case]


@functools.lru_cache(maxsize=None)
def reference_of(name: str) -> dict:
    return accumulation_reference(name)


def micro_batches(result: dict, step: int) -> list[dict]:
    return result["comm"][step * MICRO : (step + 1) * MICRO]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-stage{c[1]}-{'sync' if c[2] else 'no_sync'}")
def test_matches_full_batch_reference(runs, case: tuple) -> None:
    reference = reference_of(case[0])
    for result in run_of(runs, case):
        for step in range(ACC_STEPS):
            for kind in ("grads", "params"):
                assert result[kind][step].keys() == reference[kind][step].keys()
                for name, value in reference[kind][step].items():
                    torch.testing.assert_close(result[kind][step][name], value, rtol=RTOL, atol=ATOL,
                                               msg=f"{kind} of {name} after step {step}")
    initial = build_acc(case[0]).layers[0].weight.detach()
    assert not torch.equal(reference["params"][0]["layers.0.weight"], initial)  # the test is not vacuous


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_sync_every_micro_batch_reduces_every_micro_batch(runs, stage: int) -> None:
    for result in run_of(runs, ("accum", stage, True)):
        comm = result["comm"]
        assert comm[0]["reduce_scatter"] > 0 and comm[0]["all_reduce"] > 0  # sharded weights; the 0-d scale
        assert all(c == comm[0] for c in comm)
        assert result["unsynced_bytes"] == [0] * len(comm)
        assert result["graphs"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_reduces_once_per_step(runs, stage: int) -> None:
    """Micro-batches 1-3 run no reduction (forward still gathers); each rank holds the full fp32
    gradient of every parameter meanwhile; the 4th reduces the sum once, moving what one synced
    micro-batch moves, and the buffers are empty again. Step 0 switched with
    ``set_requires_gradient_sync``, step 1 with ``no_sync()``: the same counts."""
    synced = run_of(runs, ("accum", stage, True))[0]["comm"][0]
    for result in run_of(runs, ("accum", stage, False)):
        for step in range(ACC_STEPS):
            comm = micro_batches(result, step)
            for inner in comm[:-1]:
                assert inner == dict(synced, reduce_scatter=0, all_reduce=0)
            assert comm[-1] == synced
            held = result["unsynced_bytes"][step * MICRO : (step + 1) * MICRO]
            assert held == [result["trainable_bytes"]] * (MICRO - 1) + [0]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_compiles_an_accumulating_and_a_flushing_backward(runs, stage: int) -> None:
    """Two graphs, chosen by a Dynamo guard on the mode: the accumulating backward hands every
    parameter's full gradient to the runtime (``accumulate_unsynced``) and runs no reduction; the
    flushing one adds the held gradient (``take_unsynced``) in each reduction's copy-in and runs
    the reductions of a synced backward."""
    synced = run_of(runs, ("accum", stage, True))[0]["backward"][0]["collectives"]
    for result in run_of(runs, ("accum", stage, False)):
        assert result["graphs"] == 2
        accumulate, flush = result["backward"]
        assert accumulate["accumulate"] == result["num_params"] and accumulate["take"] == 0
        assert [c for c in accumulate["collectives"] if c[0] != "all_gather"] == []
        assert flush["take"] == result["num_params"] and flush["accumulate"] == 0
        assert flush["collectives"] == synced


@pytest.mark.distributed
def test_parameter_hooks_turn_no_sync_into_synced_backwards(runs) -> None:
    """Tensor hooks need what an unsynced backward does not have: a ``register_hook`` hook each
    micro-batch's gradient (a clamp of the sum is not the sum of clamps), a
    ``register_post_accumulate_grad_hook`` hook that edits ``.grad`` in place the sum so far
    after every micro-batch. With such hooks, a forward run with sync off reduces anyway (each
    micro-batch moves what a synced one moves, nothing is held) and says so. Its numbers are
    eager's (``test_matches_full_batch_reference[accum_hooked-...]``), which the hooks change."""
    synced = run_of(runs, ("accum", 3, True))[0]["comm"][0]
    for result in run_of(runs, ("accum_hooked", 3, False)):
        assert result["comm"] == [synced] * (ACC_STEPS * MICRO)
        assert result["unsynced_bytes"] == [0] * (ACC_STEPS * MICRO)
        for step in range(ACC_STEPS):
            warned = result["synced_for_hooks_warnings"][step * MICRO : (step + 1) * MICRO]
            assert [len(w) for w in warned] == [1] * (MICRO - 1) + [0]
            assert "layers.1.weight, layers.1.bias" in warned[0][0] and "register_hook" in warned[0][0]
    hooked, plain = reference_of("accum_hooked")["grads"][0], reference_of("accum")["grads"][0]
    for name in ("layers.1.weight", "layers.1.bias"):  # the hooks matter
        assert not torch.allclose(hooked[name], plain[name]), name
    torch.testing.assert_close(hooked["layers.1.bias"].abs().max(), torch.tensor(0.01 * MICRO))  # clamped per micro-batch


@pytest.mark.distributed
def test_graph_break_eager_frames_accumulate_too(runs) -> None:
    """The eager frame's reductions (the last Linear) are skipped and flushed like the graphs'."""
    for result in run_of(runs, ("mlp_break", 3, False)):
        for step in range(ACC_STEPS):
            comm = micro_batches(result, step)
            assert [c["reduce_scatter"] for c in comm[:-1]] == [0] * (MICRO - 1)
            assert comm[-1]["reduce_scatter"] > 0


# -- world size 1 and the switch itself, in this process --------------------------------------------

def test_world_size_1_accumulates_straight_into_grad() -> None:
    """One rank has nothing to synchronise: without sync the gradients go to ``.grad`` at once,
    no buffer is held, and the step equals eager training on the full batch."""
    torch._dynamo.reset()
    model = zerograph.compile(build("mlp"), stage=3)
    runtime = runtime_of_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch("mlp", 0, 8)
    for micro in range(MICRO):
        with model.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
            loss = model(x[2 * micro : 2 * micro + 2], y[2 * micro : 2 * micro + 2]) / MICRO
        loss.backward()
        assert runtime.grad_buffers.unsynced_bytes() == 0
    opt.step()
    reference = reference_training("mlp", 1, 8, 1e-3)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), reference["params"][name], rtol=RTOL, atol=ATOL)


def test_no_sync_restores_the_previous_setting() -> None:
    torch._dynamo.reset()
    model = zerograph.compile(build("mlp"), stage=1)
    runtime = runtime_of_model(model)
    assert runtime.grad_buffers.requires_gradient_sync
    with pytest.raises(KeyError):
        with model.no_sync():
            assert not runtime.grad_buffers.requires_gradient_sync
            raise KeyError("inside")
    assert runtime.grad_buffers.requires_gradient_sync
    model.set_requires_gradient_sync(False)
    with model.no_sync():
        pass
    assert not runtime.grad_buffers.requires_gradient_sync


@pytest.mark.parametrize("templates", [True, False], ids=["unit_templates", "per_parameter"])
def test_zero_grad_in_place_discards_the_held_gradients(templates) -> None:
    """``zero_grad(set_to_none=False)`` (or ``.grad.zero_()``) between micro-batches discards what
    the unsynced backwards held, as eager's zeroing discards the sum so far: the next forward holds
    nothing, where it once reduced the held sum too (a + b for eager's b). A backward that holds
    again after the zeroing is kept. In process (a fake world of 2): held bytes, not values."""
    with fake_rank(2):
        model = zerograph.compile(build("mlp"), stage=3, config=zerograph.Config(unit_templates=templates))
        runtime = runtime_of_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        x, y = global_batch("mlp", 0, 4)
        with model.no_sync():
            model(x, y).backward()
            held = runtime.grad_buffers.unsynced_bytes()
            assert held > 0
            model(x, y).backward()  # a second holding backward writes .grad too: still held
            assert runtime.grad_buffers.unsynced_bytes() == held
            model(x, y)  # the forward before which the zeroing is looked for
            assert runtime.grad_buffers.unsynced_bytes() == held
        opt.zero_grad(set_to_none=False)
        model(x, y)
        assert runtime.grad_buffers.unsynced_bytes() == 0
        with model.no_sync():
            model(x, y).backward()
        for param in model.parameters():
            param.grad.zero_()
        model(x, y).backward()
        assert runtime.grad_buffers.unsynced_bytes() == 0


def test_set_requires_gradient_sync_is_read_at_backward() -> None:
    """FSDP2's switch decides when the backward runs (torchtitan sets it before ``backward``): a
    forward run with sync off whose backward runs with it back on reduces its gradients and
    what earlier micro-batches held, holding nothing; a ``no_sync()`` forward holds whenever its
    backward runs (DDP's), and a loss summing it with a synced forward's reduces both. In process
    (a fake world of 2): held bytes and reductions, not values."""
    with fake_rank(2):
        model = zerograph.compile(build("mlp"), stage=3)
        runtime = runtime_of_model(model)
        x, y = global_batch("mlp", 0, 4)
        model.set_requires_gradient_sync(False)
        model(x, y).backward()
        assert runtime.grad_buffers.unsynced_bytes() > 0
        loss = model(x, y)
        model.set_requires_gradient_sync(True)
        loss.backward()
        assert runtime.grad_buffers.unsynced_bytes() == 0
        assert zerograph.stats(model).comm_elements["reduce_scatter"] > 0
        with model.no_sync():
            loss = model(x, y)
        loss.backward()  # the forward decided: held
        assert runtime.grad_buffers.unsynced_bytes() > 0
        with model.no_sync():
            unsynced = model(x, y)
        (unsynced + model(x, y)).backward()
        assert runtime.grad_buffers.unsynced_bytes() == 0


def test_an_optimizer_step_over_held_gradients_is_refused() -> None:
    """A step whose last backward was a ``no_sync()`` forward's (run after leaving the context)
    would leave that micro-batch out of ``.grad``: the step raises ``HeldGradientsError`` naming
    the parameters, instead of losing it; a micro-batch loop that ends synced steps as usual, and
    so does one whose held gradients the caller discarded (``zero_grad``). In process (a fake
    world of 2)."""
    with fake_rank(2):
        model = zerograph.compile(build("mlp"), stage=3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = global_batch("mlp", 0, 4)
        with model.no_sync():
            model(x, y).backward()
        model(x, y).backward()  # synced: everything reduced
        optimizer.step()
        optimizer.zero_grad()
        with model.no_sync():
            loss = model(x, y)
        loss.backward()  # the forward decided: held, and nothing reduces it
        with pytest.raises(HeldGradientsError, match="no_sync still holds"):
            optimizer.step()
        optimizer.zero_grad()  # discarded, as eager's zero_grad discards them
        optimizer.step()
