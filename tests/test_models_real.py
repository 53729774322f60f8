"""Training patterns on whole models: evaluation between training steps, BatchNorm CNNs (torchvision's
ResNet-18 when torchvision imports, a small ResNet of our own always) at stage 3, and sequence
lengths that differ per rank and per step. World size 2; the reference is single-process eager.

Every check runs in ONE spawn (``tests.workers_patterns2.run_parts``): starting ranks costs more
than most checks. A check that raises fails only its own tests (the worker returns the traceback).
"""
from __future__ import annotations

import functools

import pytest
import torch

from zerograph.capture import compiled_model

from .distributed import spawn
from .workers_patterns2 import (
    DYN_STEPS,
    EVAL_STAGES,
    cnn_reference,
    dynamic_lengths,
    dynamic_reference,
    eval_reference,
    run_parts,
)

pytestmark = pytest.mark.distributed  # every test reads the one spawn

WORLD_SIZE = 2
ATOL = RTOL = 1e-5


def _torchvision_error() -> str | None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a wheel built for another torch fails with RuntimeError
        return f"{type(exc).__name__}: {exc}"
    return None


PARTS = ("eval", "small_resnet", "dynamic") + (() if _torchvision_error() else ("resnet18",))


@pytest.fixture(scope="module")
def runs() -> dict:
    """``{check: [rank 0 result, rank 1 result]}``."""
    per_rank = spawn(run_parts, WORLD_SIZE, PARTS, timeout_s=600)
    return {name: [rank_out[name] for rank_out in per_rank] for name in PARTS}


def results_of(runs: dict, name: str) -> list:
    for rank, result in enumerate(runs[name]):
        if isinstance(result, str):
            pytest.fail(f"{name} raised on rank {rank}:\n{result}", pytrace=False)
    return runs[name]


def stage_results(runs: dict, stage: int) -> list[dict]:
    per_rank = [result[stage] for result in results_of(runs, "eval")]
    for rank, result in enumerate(per_rank):
        if isinstance(result, str):
            pytest.fail(f"eval at stage {stage} raised on rank {rank}:\n{result}", pytrace=False)
    return per_rank


# -- evaluation -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _eval_reference() -> dict:
    return eval_reference(WORLD_SIZE)


@pytest.mark.parametrize("stage", EVAL_STAGES)
def test_eval_outputs_match_reference(runs, stage: int) -> None:
    """``model.eval()`` under ``no_grad`` and under ``inference_mode``, before training and after
    each step: the outputs equal the reference's, whose BatchNorm uses this rank's running
    statistics (each rank normalised its own micro-batches while training)."""
    ref = _eval_reference()
    for rank, result in enumerate(stage_results(runs, stage)):
        assert len(result["evals"]) == len(ref["outputs"])
        for point, (got, want) in enumerate(zip(result["evals"], ref["outputs"])):
            for mode in ("no_grad", "inference_mode"):
                torch.testing.assert_close(got[mode], want[rank], rtol=RTOL, atol=ATOL, msg=f"{mode} at {point}")
        assert result["losses"] == pytest.approx([step[rank] for step in ref["losses"]], rel=RTOL, abs=ATOL)
    # the ranks' running statistics differ after training, so the eval outputs do too
    rank0, rank1 = stage_results(runs, stage)
    assert not torch.allclose(rank0["evals"][-1]["no_grad"], rank1["evals"][-1]["no_grad"])


@pytest.mark.parametrize("stage", EVAL_STAGES)
def test_eval_returns_to_sharded_baseline(runs, stage: int) -> None:
    """After every eval forward each parameter attribute is again this rank's DTensor shard, and
    the inference graphs free every gathered parameter before they end (none is returned); the
    inference graphs are reused between training steps (at most one per grad mode)."""
    for result in stage_results(runs, stage):
        assert all(all(point["baseline"]) for point in result["evals"])
        assert ["backward", "forward", "joint", "partitioned"] in result["graph_kinds"]  # training ran as graphs too
        graphs = result["inference_graphs"]
        assert 1 <= len(graphs) <= 2, result["graph_kinds"]
        for graph in graphs:
            assert graph["peak_gathered"] > 0  # parameters were gathered: the check is not vacuous
            assert graph["gathered_at_end"] == 0
            assert graph["returned"] == {}


# -- BatchNorm CNNs at stage 3 ---------------------------------------------------------------------

def _check_cnn(results: list[dict], reference: dict) -> None:
    """Each rank's own loss, the parameters, and each rank's BatchNorm buffers (running mean,
    variance, batches tracked) equal the per-rank reference's."""
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx([step[rank] for step in reference["losses"]], rel=RTOL, abs=ATOL)
        assert result["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=RTOL, atol=ATOL, msg=name)
        assert result["buffers"].keys() == reference["rank_buffers"][rank].keys()
        for name, value in reference["rank_buffers"][rank].items():
            torch.testing.assert_close(result["buffers"][name], value, rtol=RTOL, atol=ATOL, msg=name)
        assert result["graphs"] == 1  # one training graph, no recompile
    running = [name for name in reference["rank_buffers"][0] if name.endswith("running_mean")]
    assert running and not torch.equal(results[0]["buffers"][running[0]], results[1]["buffers"][running[0]])


def test_batchnorm_resnet_stage3_matches_reference(runs) -> None:
    results = results_of(runs, "small_resnet")
    assert results[0]["units"] == 3  # the root unit and one per residual block
    _check_cnn(results, cnn_reference("small_resnet", WORLD_SIZE))


@pytest.mark.skipif(_torchvision_error() is not None, reason=f"torchvision does not import: {_torchvision_error()}")
def test_torchvision_resnet18_stage3_matches_reference(runs) -> None:
    """torchvision's ResNet-18, unchanged (num_classes=10, 2 images of 3x32x32 per rank)."""
    results = results_of(runs, "resnet18")
    assert results[0]["units"] == 9  # the root unit and the 8 BasicBlocks
    _check_cnn(results, cnn_reference("resnet18", WORLD_SIZE))


# -- dynamic shapes --------------------------------------------------------------------------------

def test_per_rank_sequence_lengths_match_reference_with_bounded_recompiles(runs) -> None:
    """Each rank draws its own sequence length every step: no hang (the spawn finished), each
    rank's loss equals the reference's loss on that rank's batch, and recompiles are bounded:
    with unit templates each of a model's first ``STATIC_SHAPES`` lengths is a static graph (a
    template each), past them one graph with a symbolic length, so a rank holds one graph per
    length it drew here (three at most), never more than ``STATIC_SHAPES + 1``."""
    ref = dynamic_reference(WORLD_SIZE)
    drawn = [dynamic_lengths(step, WORLD_SIZE) for step in range(DYN_STEPS)]
    assert any(len(set(step)) > 1 for step in drawn)  # the ranks' shapes differ at some step
    results = results_of(runs, "dynamic")
    for rank, result in enumerate(results):
        assert result["lengths"] == [step[rank] for step in drawn]
        assert len(set(result["lengths"])) > 1  # this rank's own shape changes: a recompile happens
        assert result["losses"] == pytest.approx([step[rank] for step in ref["rank_losses"]], rel=RTOL, abs=ATOL)
        for name, value in ref["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=RTOL, atol=ATOL, msg=name)
        assert result["graphs"] == len(set(result["lengths"])) <= compiled_model.STATIC_SHAPES
    assert max(len(set(r["lengths"])) for r in results) > 2  # some rank traced a graph per length, three
