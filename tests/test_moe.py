"""Mixtures of experts whose ranks route to different experts train as eager, or are refused by
name, never abort (the routing loop inside a unit, or in a module above the experts made units):
two gloo ranks, each on its half of the global batch, against single-process
eager on the whole batch (losses, every gradient, ``None`` where eager leaves ``None``, and the
parameters after each AdamW step, to 1e-5). The cases are in ``tests.workers_moe``."""
from __future__ import annotations

import pytest

from .distributed import spawn
from .test_semantics import check_result
from .workers_moe import CASES, moe_runs, routed_experts

pytestmark = pytest.mark.distributed

MIXTRAL, SET_LOOP, ROOT_LOOP, SKIPPING, PLAIN_LOOP = CASES
# (case, stage): transformers' Mixtral and the loop in the root at every stage; the other cases at
# the ends of the sharded builds
RUNS = (*((case, stage) for case in (MIXTRAL, ROOT_LOOP) for stage in range(4)), (SET_LOOP, 1), (SET_LOOP, 3),
        (PLAIN_LOOP, 1), (PLAIN_LOOP, 3), (SKIPPING, 3))
# what a (case, stage) may answer instead of eager's numbers: the error class and words of it
REFUSALS = {(SKIPPING, 3): ("ScheduleMismatchError", "the island forward of unit")}


@pytest.fixture(scope="module")
def runs() -> dict:
    return spawn(moe_runs, 2, RUNS, timeout_s=900)[0]


@pytest.mark.parametrize("case", [MIXTRAL, SET_LOOP, ROOT_LOOP, PLAIN_LOOP])
def test_the_ranks_route_to_different_experts(case: str) -> None:
    """In process: the batch makes the ranks' halves reach different sets of experts in a layer."""
    routed = routed_experts(case)
    assert routed and all(len(halves) == 2 for halves in routed)
    assert any(first != second for first, second in routed), routed


@pytest.mark.parametrize("case, stage", RUNS, ids=[f"{case}-stage{stage}" for case, stage in RUNS])
def test_mixture_of_experts_matches_eager_or_is_refused_by_name(runs: dict, case: str, stage: int) -> None:
    result = runs[case, stage]
    if check_result(result, REFUSALS.get((case, stage)), case) and case != MIXTRAL:
        # the router's last expert is reached by no token: None, as in eager
        assert any(grad is None for grad in result["ours"]["grads"][0].values())
