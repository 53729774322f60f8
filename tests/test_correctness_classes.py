"""Correctness classes a parity test on plain models misses, each against single-process eager PyTorch:

1. in-place writes to a parameter inside forward (``nn.Embedding(max_norm=...)``, ``weight.data.clamp_``,
   item assignment): refused at capture with ``ShardingError`` naming the parameter and the op,
   at every stage; in-place ops on activations and on copies of parameters still run;
2. sparse gradients (``nn.Embedding(sparse=True)``): refused at ``compile``, every stage, naming
   the module and ``sparse=False``;
3. every dtype through pack, pool, all-gather, reduce-scatter and unpack (complex64/128, float64,
   float16, bfloat16, frozen int64 and bool, mixed in one unit), world size 2, stages 0-3;
4. mixed precision with fp32 inputs (``MixedPrecisionPolicy.cast_forward_inputs``) and fp32 buffers;
5. gradients that never reach the loss stay ``None`` as in eager, world size 2, stages 0-3: layers
   whose output is discarded (in a block and in the root unit), a head used on one step only and
   there only in an unsynced micro-batch (its held gradient must reach ``.grad`` at the synced
   backward, not linger into the next step).

The multi-rank cases run in one spawned phase (``tests.workers_classes.classes_runs``).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerograph
from zerograph.errors import ShardingError

from .distributed import spawn
from .workers_classes import classes_runs

STAGES = (0, 1, 2, 3)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


# --------------------------------------------------------------------- 1: in-place writes in forward
@pytest.mark.parametrize("templates", [False, True], ids=["inline", "unit_templates"])
@pytest.mark.parametrize("stage", STAGES)
def test_embedding_max_norm_is_refused_naming_parameter_and_op(stage, templates):
    """Refused with one wording whether the model graph or a unit template's body holds the write."""
    model = zerograph.compile(nn.Sequential(nn.Embedding(11, 8, max_norm=1.0), nn.Linear(8, 3)), stage=stage,
                              config=zerograph.Config(unit_templates=templates))
    with pytest.raises(ShardingError, match=r"'0\.weight'.*max_norm.*max_norm=None"):
        model(torch.arange(11))


class _Writes(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "data_clamp":
            self.lin.weight.data.clamp_(-0.1, 0.1)
        elif self.how == "no_grad_mul":
            with torch.no_grad():
                self.lin.weight.mul_(0.5)
        elif self.how == "setitem":
            with torch.no_grad():
                self.lin.bias[0] = 1.0
        elif self.how == "view_copy":
            with torch.no_grad():
                self.lin.weight.t().copy_(torch.zeros(4, 4))
        return self.lin(x).sum()


@pytest.mark.parametrize("how, param, op", [("data_clamp", "lin.weight", "clamp_"),
                                            ("no_grad_mul", "lin.weight", "mul_"),
                                            ("setitem", "lin.bias", "item assignment"),
                                            ("view_copy", "lin.weight", "copy_")])
def test_in_place_parameter_writes_are_refused(how, param, op):
    model = zerograph.compile(_Writes(how), stage=3)
    with pytest.raises(ShardingError, match=rf"'{param}'.*{op}.*lost silently"):
        model(torch.randn(2, 4))


class _InPlaceOnActivations(nn.Module):
    """In-place ops that touch no parameter: activations, and a copy of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.add_(1.0)
        h[:, 0] = 0.0
        w = self.lin.weight.clone()
        w.mul_(2.0)
        return (h @ w).sum()


def test_in_place_ops_on_activations_and_copies_still_run():
    torch.manual_seed(0)
    model = _InPlaceOnActivations()
    reference = copy.deepcopy(model)
    compiled = zerograph.compile(model, stage=3)
    x = torch.randn(3, 4)
    ours, theirs = compiled(x), reference(x)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(compiled.lin.weight.grad.full_tensor(), reference.lin.weight.grad)


# --------------------------------------------------------------------------- 2: sparse gradients
@pytest.mark.parametrize("stage", STAGES)
def test_sparse_embedding_is_refused_at_compile(stage):
    model = nn.Sequential(nn.Embedding(11, 8, sparse=True), nn.Linear(8, 3))
    with pytest.raises(ShardingError, match=r"module '0' \(Embedding\) has sparse=True.*sparse=False"):
        zerograph.compile(model, stage=stage)


def test_sparse_embedding_bag_is_refused_at_compile():
    with pytest.raises(ShardingError, match=r"EmbeddingBag.*sparse=False"):
        zerograph.compile(nn.ModuleDict({"bag": nn.EmbeddingBag(11, 8, sparse=True)}), stage=0)


class _FunctionalSparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(11, 8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.table, sparse=True).sum()


def test_functional_sparse_embedding_is_refused_at_capture():
    model = zerograph.compile(_FunctionalSparse(), stage=1)
    with pytest.raises(ShardingError, match=r"'table'.*sparse=True.*sparse=False"):
        model(torch.arange(11))


# -------------------------------------------------------------- 4: mixed precision inputs, buffers
BF16 = zerograph.Config(mixed_precision=zerograph.MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def _frozen_then_trainable() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_inputs_are_cast_to_param_dtype(stage):
    """The issue's recipe: a frozen Linear then a trainable one, bf16 parameters, an fp32 batch.
    The frozen parameters are cast like the others; the result is eager bf16's, bitwise."""
    model = _frozen_then_trainable()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    compiled = zerograph.compile(model, stage=stage, config=BF16)
    x = torch.randn(4, 32)
    out = compiled(x)
    expected = reference(x.to(torch.bfloat16))
    out.float().sum().backward()
    expected.float().sum().backward()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled[1].weight.grad.full_tensor(), reference[1].weight.grad.float(), rtol=0, atol=0)
    assert compiled[0].weight.grad is None and compiled[0].weight.dtype == torch.float32  # frozen fp32 master


def test_cast_forward_inputs_off_hands_inputs_over_as_they_are():
    policy = zerograph.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    compiled = zerograph.compile(_frozen_then_trainable(), stage=3, config=zerograph.Config(mixed_precision=policy))
    with pytest.raises(RuntimeError, match="same dtype"):
        compiled(torch.randn(4, 32))
    assert compiled(torch.randn(4, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


class _BufferScaled(nn.Module):
    """An fp32 buffer used in compute next to bf16 parameters; ids (int) pass uncast."""

    def __init__(self, cast_buffer: bool) -> None:
        super().__init__()
        self.cast_buffer = cast_buffer
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(ids) + x)
        h = h * (self.scale.to(h.dtype) if self.cast_buffer else self.scale)
        return self.out(h.to(self.out.weight.dtype)).float().mean()


def test_fp32_buffer_stays_fp32_and_a_model_that_casts_it_trains_as_eager_bf16():
    torch.manual_seed(0)
    model = _BufferScaled(cast_buffer=True)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    reference.scale = model.scale.clone()  # the eager emulation keeps the buffer fp32 too
    compiled = zerograph.compile(model, stage=3, config=BF16)
    ids, x = torch.randint(0, 10, (4,)), torch.randn(4, 8)
    loss = compiled(ids, x)
    expected = reference(ids, x.to(torch.bfloat16))
    loss.backward()
    expected.backward()
    assert compiled.scale.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled.lin.weight.grad.full_tensor(), reference.lin.weight.grad.float(),
                               rtol=0, atol=0)


def test_fp32_buffer_promotes_activations_as_type_promotion_says():
    """Buffers are never cast (FSDP2's choice): ``h * fp32_buffer`` is fp32, the model's own
    ``.to(self.out.weight.dtype)`` brings it back to bf16; documented in the README."""
    compiled = zerograph.compile(_BufferScaled(cast_buffer=False), stage=1, config=BF16)
    assert compiled(torch.randint(0, 10, (4,)), torch.randn(4, 8)).dtype == torch.float32
    assert compiled.scale.dtype == torch.float32


# ------------------------------------------------------------------- 3 and 5: world size 2 (spawned)
@pytest.fixture(scope="module")
def runs():
    return spawn(classes_runs, 2, timeout_s=600)


DTYPE_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.complex64: 1e-5,
                   torch.float64: 1e-12, torch.complex128: 1e-12}


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_every_dtype_trains_as_single_process(runs, stage):
    for rank, per_rank in enumerate(runs):
        result = per_rank["dtype", stage]
        assert isinstance(result, dict), result
        ours, reference = result["ours"], result["reference"]
        assert ours.keys() == reference.keys()
        assert (result["pooled"] > 0) == (stage > 0), "stages 1-3 gather non-root units into pooled buffers"
        for name, expected in reference.items():
            got = ours[name]
            assert got.dtype == expected.dtype, name
            if expected.is_floating_point() or expected.is_complex():
                tol = DTYPE_TOLERANCE[expected.dtype]
                torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=f"rank {rank} {name}")
            else:  # frozen int and bool parameters: exactly as they were
                assert torch.equal(got, expected), f"rank {rank} {name}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_gradients_that_never_reach_the_loss_stay_none(runs, stage):
    for rank, per_rank in enumerate(runs):
        result = per_rank["unused", stage]
        assert isinstance(result, dict), result
        ours, reference = result["ours"], result["reference"]
        for step, (got, expected) in enumerate(zip(ours["grads"], reference["grads"])):
            where = f"rank {rank}, backward {step}"
            assert {n for n, g in got.items() if g is None} == {n for n, g in expected.items() if g is None}, where
            for name, grad in expected.items():
                if grad is not None:
                    torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")
        for name, param in reference["params"].items():
            torch.testing.assert_close(ours["params"][name], param, rtol=1e-5, atol=1e-6, msg=name)
        assert ours["held"] == [], f"rank {rank}: unsynced gradients carried into the next step"
    # the eager reference itself: the discarded layers never get a gradient, the head only when used
    grads = runs[0]["unused", stage]["reference"]["grads"]
    assert grads[0]["side.weight"] is None and grads[0]["blocks.0.aux.weight"] is None
    assert grads[0]["head.weight"] is None and grads[1]["head.weight"] is not None and grads[2]["head.weight"] is None
