"""Communication volume and resident model-state bytes against the ZeRO paper's formulas, measured
as rank 0 of a fake world of 2 in this process (the ``one_rank`` fixture): counts and bytes are
that rank's own, whatever the collectives carry."""
from __future__ import annotations

import pytest

import zerograph

from .models import build

STAGES = [0, 1, 2, 3]
IDEAL_VOLUME = {0: {"all_reduce": 2}, 1: {"all_gather": 1, "reduce_scatter": 1},
                2: {"all_gather": 1, "reduce_scatter": 1}, 3: {"all_gather": 2, "reduce_scatter": 1}}


def padded_numel(result: dict) -> int:
    return sum(size for _, size in result["units"])


@pytest.mark.parametrize("stage", STAGES)
def test_volume_per_step(one_rank, stage: int) -> None:
    """GPT: 2Ψ at stages 0-2, 3Ψ at stage 3 (section 7), up to padding, split by collective."""
    stats = one_rank("gpt", stage)["stats"]
    psi = sum(p.numel() for p in build("gpt").parameters())
    assert stats.num_params == psi
    padded = padded_numel(one_rank("gpt", stage)) if stage else psi
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        ideal = IDEAL_VOLUME[stage].get(kind, 0)
        assert ideal * psi <= stats.comm_elements[kind] <= ideal * padded, kind
    assert stats.comm_bytes["all_gather"] == stats.comm_elements["all_gather"] * 4 // 2  # fp32, (N-1)/N


def test_stage3_backward_regathers_only_what_backward_reads(one_rank) -> None:
    """MLP: the first Linear's weight is not needed in backward (its input needs no gradient), so
    backward re-gathers only the last Linear: volume = Ψ (forward) + Ψ_last + Ψ (reduce-scatter)."""
    result = one_rank("mlp", 3)
    stats, units = result["stats"], dict(result["units"])
    padded = padded_numel(result)
    assert stats.comm_elements["all_gather"] == padded + units["layers.2"]
    assert stats.comm_elements["reduce_scatter"] == padded


@pytest.mark.parametrize("stage", STAGES)
def test_resident_bytes_follow_the_stage_formula(one_rank, stage: int) -> None:
    """Section 5 with fp32 (4 B param, 4 B grad, 8 B Adam): measured >= formula, and above it only
    by padding plus the transient buffers the formula leaves out: per unit in flight, its all-gather
    output beside its copy-out, or its full gradients beside their reduce-scatter bucket. The
    schedule keeps up to ``prefetch_depth + 1`` units in flight (the root unit, which stage 3
    needs at both ends of the step, besides)."""
    result = one_rank("gpt", stage)
    stats, units = result["stats"], result["units"]
    psi, n = stats.num_params, stats.world_size
    padding = 4 * (padded_numel(result) - psi) if stage else 0
    root_bytes, block_bytes = 4 * units[0][1], 4 * max(size for _, size in units[1:])
    inflight = zerograph.Config().schedule.prefetch_depth + 1
    transient = {
        "params": {0: 0, 1: 2 * inflight * block_bytes, 2: 2 * inflight * block_bytes,
                   3: 2 * (root_bytes + inflight * block_bytes)}[stage],
        "grads": 2 * inflight * max(root_bytes, block_bytes),
        "optimizer_states": 0,
    }
    for kind, formula in stats.formula_bytes.items():
        measured = stats.resident_bytes[kind]
        assert formula <= measured <= formula + padding + transient[kind], (kind, measured, formula)
    assert stats.formula_bytes["optimizer_states"] == (8 * psi if stage == 0 else 8 * psi / n)


@pytest.mark.slow
def test_stages_order_their_memory(one_rank) -> None:
    """Each stage holds strictly less than the one before (the point of ZeRO). On a model of 8
    blocks: the units in flight (up to ``prefetch_depth + 1``) are small beside Ψ, as in real
    models; on the 2-block GPT they are the same order as the 2Ψ/N a stage saves."""
    totals = [sum(one_rank("gpt_deep", s)["stats"].resident_bytes.values()) for s in STAGES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals
