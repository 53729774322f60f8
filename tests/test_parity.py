"""Sharded training matches single-process eager training on the same global batch (fp32, 1e-5)."""
from __future__ import annotations

import pytest
import torch

from .distributed import spawn
from .models import reference_training
from .workers import train

STEPS, LR = 3, 1e-3
ATOL = RTOL = 1e-5


def check_parity(result: dict, reference: dict) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=RTOL, abs=ATOL)
    assert result["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        torch.testing.assert_close(result["params"][name], ref, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_matches_single_process(name: str, stage: int) -> None:
    results = spawn(train, 2, name, stage, STEPS, 4, LR)
    reference = reference_training(name, STEPS, 4, LR)
    for result in results:
        check_parity(result, reference)
    # every rank ends with the same full parameters
    for name_, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name_])


def test_stage3_world_size_3_uneven() -> None:
    results = spawn(train, 3, "mlp", 3, STEPS, 6, LR)
    reference = reference_training("mlp", STEPS, 6, LR)
    for result in results:
        check_parity(result, reference)
