"""Mixed precision: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
keeps fp32 master shards, gathers and computes in bf16, reduces gradients in fp32, and leaves
buffers' dtypes and values alone; stages 1 and 3 on 2 ranks (stage 2: ``STAGES``).

One spawn runs every case (``tests.workers_precision.precision_runs``): the mixed-precision GPT
per stage, a batch-norm model per stage, and a model with a graph break at stage 3. The GPT
without mixed precision, whose bytes and graphs the mixed one is compared with, runs in this
process as rank 0 of a fake world (structure only; its numbers against eager are
``tests/test_parity.py``'s), and so do the world-size-1 tests.

Tolerances. Against the fp32 reference the GPT can only agree to bf16 accuracy: bf16 keeps 8
significant bits, so one rounding errs by up to 2^-9 (0.2%) and neighbouring values near the loss
(5.5) are 2^-5 = 0.03 (0.6%) apart; the GPT's loss is itself a bf16 number (its cross-entropy runs
on bf16 logits). ``LOSS_RTOL`` = 1e-2 allows under two such spacings, well above a correct run's error. The
first step's gradients (same parameters on both sides) carry the rounding of every bf16 factor
through two blocks' backward: ``GRAD_RTOL`` = 5e-2 in norm per parameter, above a correct run's error
(a mistake in the reduction, such as a missing 1/N or a lost rank's share, is off by 50% or more).
Against the emulation of the same arithmetic (``mixed_reference``) the tolerance is fp32's 1e-5.
"""
from __future__ import annotations

import functools

import pytest
import torch

import zerograph
from zerograph.errors import ConfigError
from zerograph.report.stats import formula_bytes
from zerograph.runtime.state import graphs_of, runtime_of_model

from .distributed import run_as_rank, spawn
from .models import build, global_batch, reference_training
from .workers_precision import (
    BATCH,
    LR,
    MIXED,
    STEPS,
    bn_batch,
    build_bn,
    mixed_reference,
    mlp_batch,
    precision_runs,
    train_gpt,
)

# Stage 2 is not run: the runtime has no stage branch, and stage 2's graphs are stage 1's but for
# where insert_reduce_scatter places each reduce-scatter (after its bucket's last gradient, stage 3's
# placement), which changes no cast, dtype or byte count checked here.
STAGES = (1, 3)
WORLD_SIZE = 2
LOSS_RTOL = 1e-2  # bf16 against fp32 (module docstring)
GRAD_RTOL = 5e-2
ATOL = RTOL = 1e-5  # against the emulation of the same mixed-precision arithmetic


@pytest.fixture(scope="module")
def runs() -> dict:
    per_rank = spawn(precision_runs, WORLD_SIZE, STAGES, timeout_s=600)
    return {key: [rank_out[key] for rank_out in per_rank] for key in per_rank[0]}


def run_of(runs: dict, case: str, stage: int) -> list[dict]:
    results = runs[case, stage]
    for rank, result in enumerate(results):
        if isinstance(result, str):
            pytest.fail(f"{case} at stage {stage} raised on rank {rank}:\n{result}", pytrace=False)
    return results


@functools.lru_cache(maxsize=None)
def fp32_run(stage: int) -> dict:
    """The GPT without mixed precision (the default ``Config``) at ``stage``, as rank 0 of a fake
    world of 2: its graphs and byte counts are rank 0's of a real run; its values are meaningless.
    Its training against eager at 1e-5 is ``tests/test_parity.py::test_matches_single_process``."""
    return run_as_rank(train_gpt, WORLD_SIZE, stage, zerograph.Config())


@pytest.fixture(scope="module")
def fp32_reference() -> dict:
    reference = reference_training("gpt", STEPS, BATCH, LR)
    model = build("gpt")
    model(*global_batch("gpt", 0, BATCH)).backward()
    reference["first_grads"] = {n: p.grad for n, p in model.named_parameters()}
    return reference


# -- the GPT against fp32 ---------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_gpt_losses_within_bf16_tolerance_of_fp32(runs, fp32_reference, stage: int) -> None:
    # the default Config's sharded losses equal fp32_reference's to 1e-5: test_parity's gpt at this stage
    for result in run_of(runs, "gpt", stage):
        assert result["loss_dtype"] == "bfloat16"  # the forward really computed in bf16
        assert result["losses"] == pytest.approx(fp32_reference["losses"], rel=LOSS_RTOL)
        assert result["losses"] != pytest.approx(fp32_reference["losses"], rel=1e-5, abs=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_gpt_gradients_within_bf16_tolerance_of_fp32(runs, fp32_reference, stage: int) -> None:
    """First step (equal parameters): each parameter's averaged gradient, in norm."""
    for result in run_of(runs, "gpt", stage):
        assert result["first_grads"].keys() == fp32_reference["first_grads"].keys()
        for name, ref in fp32_reference["first_grads"].items():
            error = (result["first_grads"][name] - ref).norm() / ref.norm()
            assert error < GRAD_RTOL, (name, error.item())


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_master_weights_gradients_and_optimizer_states_stay_fp32(runs, stage: int) -> None:
    for result in run_of(runs, "gpt", stage):
        assert result["param_dtypes"] == ["float32"]
        assert result["grad_dtypes"] == ["float32"]
        assert result["optimizer_state_dtypes"] == ["float32"]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_all_gathers_move_half_the_bytes_of_fp32(runs, stage: int) -> None:
    """Same elements as the fp32 run, gathered in bf16: half the bytes; reductions in fp32: the same."""
    mixed = run_of(runs, "gpt", stage)[0]["stats"]
    fp32 = fp32_run(stage)["stats"]
    assert mixed.comm_elements == fp32.comm_elements
    assert mixed.comm_elements["all_gather"] > 0
    assert 2 * mixed.comm_bytes["all_gather"] == fp32.comm_bytes["all_gather"]
    assert mixed.comm_bytes["reduce_scatter"] == fp32.comm_bytes["reduce_scatter"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_graphs_gather_in_bf16_and_reduce_in_fp32(runs, stage: int) -> None:
    """The captured graphs themselves: every all-gather's output is bf16 (stage 3's backward
    re-gathers too), every reduce-scatter's input fp32; the fp32 run gathers in fp32."""
    for result in run_of(runs, "gpt", stage):
        graphs = result["collectives"]
        gathers = [c for kind in ("forward", "backward") for c in graphs[kind] if c[0] == "all_gather"]
        reductions = [c for c in graphs["backward"] if c[0] != "all_gather"]
        assert len(gathers) == (6 if stage == 3 else 3)  # root + 2 blocks, twice at stage 3
        assert {dtype for _, dtype, _ in gathers} == {"bfloat16"}
        assert len(reductions) == 3
        assert {(kind, dtype) for kind, dtype, _ in reductions} == {("reduce_scatter", "float32")}
    fp32 = fp32_run(stage)["collectives"]
    assert {dtype for kind in ("forward", "backward") for _, dtype, _ in fp32[kind]} == {"float32"}


# -- batch norm, buffers, graph breaks: against the emulation -------------------------------------

def check_against_emulation(results: list[dict], reference: dict) -> None:
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(reference["losses"], rel=RTOL, abs=ATOL)
        assert result["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=RTOL, atol=ATOL, msg=name)
        assert result["param_dtypes"] == ["float32"] and result["grad_dtypes"] == ["float32"]
        for name, value in reference["buffers"][rank].items():  # each rank keeps its own statistics
            buffer = result["buffers"][name]
            assert buffer.dtype == value.dtype, name
            torch.testing.assert_close(buffer, value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_batch_norm_keeps_fp32_buffers_and_matches_the_emulation(runs, stage: int) -> None:
    results = run_of(runs, "bn", stage)
    check_against_emulation(results, mixed_reference(build_bn, bn_batch, WORLD_SIZE))
    initial = dict(build_bn().named_buffers())
    for result in results:
        buffers = result["buffers"]
        assert buffers["layers.1.running_mean"].dtype == buffers["layers.1.running_var"].dtype == torch.float32
        assert not torch.equal(buffers["layers.1.running_mean"], initial["layers.1.running_mean"])  # it trained
        assert buffers["layers.1.num_batches_tracked"].item() == STEPS
        assert torch.equal(buffers["out_scale"], initial["out_scale"])  # a constant stays one
    # the batch norm is a full-precision unit: gathered and reduced in fp32, the Linears in bf16
    units = results[0]["units"]
    for kind, dtype, unit_ids in results[0]["collectives"]["forward"]:
        assert dtype == ("float32" if units[unit_ids[0]] == "layers.1" else "bfloat16"), (kind, unit_ids)


@pytest.mark.distributed
def test_graph_break_eager_frames_gather_in_bf16(runs) -> None:
    """The last Linear runs in an eager frame: the runtime's fallback casts, gathers, and
    reduces in fp32 the way the graphs do, so the run equals the emulation."""
    check_against_emulation(run_of(runs, "mlp_break", 3), mixed_reference(lambda: build("mlp_break"),
                                                                          mlp_batch, WORLD_SIZE))


# -- world size 1, in this process ------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 3])
def test_world_size_1_casts_without_communicating(stage: int) -> None:
    torch._dynamo.reset()
    model = zerograph.compile(build("mlp"), stage=stage, config=MIXED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = mlp_batch(step)
        loss = model(x.to(torch.bfloat16), y)
        loss.backward()
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    reference = mixed_reference(lambda: build("mlp"), mlp_batch, 1)
    assert losses == pytest.approx(reference["losses"], rel=RTOL, abs=ATOL)
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32
        torch.testing.assert_close(param.full_tensor(), reference["params"][name], rtol=RTOL, atol=ATOL)
    graphs = graphs_of(model)[0]
    for kind in ("forward", "backward"):
        targets = [str(n.target) for n in graphs[kind].graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if "_c10d_functional" in t]
    forward_casts = [n for n in graphs["forward"].graph.nodes
                     if n.target is torch.ops.aten._to_copy.default and n.meta["val"].dtype == torch.bfloat16]
    # every weight and bias cast in the graph: one cast per parameter, or one per unit whose
    # shards live in one flat shard (templated units at every stage, zerograph.shard.flat)
    runtime = runtime_of_model(model)
    flattened = {layout.key for flat in runtime.flat_shards.values() for layout in flat.layouts}
    expected = len(runtime.flat_shards) + len(set(runtime.layouts) - flattened)
    assert expected >= 2
    assert len(forward_casts) >= expected


# -- configuration and formulas ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("param_dtype", torch.int32), ("reduce_dtype", "bf16")])
def test_config_rejects_non_float_dtypes(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"MixedPrecisionPolicy.{field} must be a floating-point"):
        zerograph.MixedPrecisionPolicy(**{field: value})


def test_formula_bytes_with_mixed_precision() -> None:
    """bf16 compute copies (2 B), fp32 masters and ``.grad`` shards (4 B), Adam's m and v (8 B);
    without mixed precision the formulas are the fp32 ones (4 B everywhere)."""
    psi, n = 1000, 4
    mixed = {s: formula_bytes(s, n, psi, 2, 2, 8, master_bytes=4, grad_shard_bytes=4) for s in range(4)}
    assert mixed[0] == {"params": 4 * psi + 2 * psi, "grads": 2 * psi, "optimizer_states": 8 * psi}
    assert mixed[1] == {"params": 2 * psi + 4 * psi / n, "grads": 2 * psi, "optimizer_states": 8 * psi / n}
    assert mixed[2] == {"params": 2 * psi + 4 * psi / n, "grads": 4 * psi / n, "optimizer_states": 8 * psi / n}
    assert mixed[3] == {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer_states": 8 * psi / n}
    fp32 = {s: formula_bytes(s, n, psi, 4, 4, 8) for s in range(4)}
    assert [fp32[s]["params"] for s in range(4)] == [4 * psi, 4 * psi + psi, 4 * psi + psi, psi]
    assert formula_bytes(1, 1, psi, 4, 4, None) == {"params": 4 * psi, "grads": 4 * psi}  # one copy at N = 1
