"""``MemoryPolicy(budget_bytes=...)``: ``compile`` keeps the largest ``prefetch_depth``
whose planned step peak fits, and refuses with the plan's numbers when none does. In process,
rank 0 of a fake world of 8: only the plan and the chosen schedule are read."""
from __future__ import annotations

import pytest
import torch

import zerograph
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.planning.budget import plan_for_config
from zerograph.runtime.state import state_of

from .distributed import fake_rank

WORLD = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))


def _config(prefetch_depth: int, budget_bytes: int | None = None) -> zerograph.Config:
    return zerograph.Config(schedule=zerograph.SchedulePolicy(prefetch_depth=prefetch_depth),
                            memory=zerograph.MemoryPolicy(budget_bytes=budget_bytes))


def _peaks() -> dict[int, int]:
    model = _model()
    return {depth: plan_for_config(model, 3, WORLD, _config(depth)).step_peak_bytes for depth in (0, 1, 2)}


def test_budget_between_two_depths_keeps_the_largest_depth_that_fits():
    peaks = _peaks()
    assert peaks[0] < peaks[1] < peaks[2]  # each unit gathered ahead costs a unit's bytes
    with fake_rank(WORLD):
        compiled = zerograph.compile(_model(), stage=3, config=_config(2, peaks[1]))
        assert state_of(compiled).config.schedule.prefetch_depth == 1


def test_budget_that_fits_changes_nothing():
    peaks = _peaks()
    with fake_rank(WORLD):
        compiled = zerograph.compile(_model(), stage=3, config=_config(2, peaks[2]))
        assert state_of(compiled).config.schedule.prefetch_depth == 2


def test_budget_no_schedule_fits_is_refused_with_the_plans_numbers():
    peaks = _peaks()
    with fake_rank(WORLD), pytest.raises(zerograph.ConfigError,
                                         match=r"predicted step peak .* exceeds memory.budget_bytes.*model states"):
        zerograph.compile(_model(), stage=3, config=_config(1, peaks[0] - 1))


def test_budget_must_be_positive_bytes():
    with pytest.raises(zerograph.ConfigError, match="MemoryPolicy.budget_bytes must be >= 1"):
        zerograph.MemoryPolicy(budget_bytes=0)
