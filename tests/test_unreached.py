"""Parameters a loss reaches only through graph outputs it does not read (a member of a returned
tuple, an intermediate the model stored on itself, a forward whose outputs go unread) keep
``.grad`` ``None``, as in eager, at stages 0 and 3 with unit templates on and off.

In process: at world size 1 the numbers are eager's (losses, every gradient and its
``None``-ness, parameters after each AdamW step with weight decay); as rank 0 of a fake world of
2 (the world-2 graphs, numerically meaningless) the ``None``-ness is. The spawned world of 2 runs
the same case in the semantics matrix (``tests/test_semantics.py``).
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from .distributed import run_as_rank
from .test_semantics import _compare
from .workers_semantics import run_case

CASE = "outputs read in part: a tuple's member, a stored intermediate, a second forward"
BUILDS = [(0, True), (0, False), (3, True), (3, False)]
IDS = [f"{stage}-{'unit_templates' if templates else 'per_parameter'}" for stage, templates in BUILDS]


def _nones(grads: list[dict]) -> list[list[str]]:
    return [sorted(name for name, grad in step.items() if grad is None) for step in grads]


@pytest.mark.parametrize("stage, templates", BUILDS, ids=IDS)
def test_world_size_1_matches_eager_with_none_for_unreached(stage, templates):
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()
    result = run_case(0, 1, CASE, stage, templates)
    ours, eager = result["ours"], result["reference"]
    # the case can fail: eager has None (the first block's side output is never read; the loss
    # reads the last block's side output only, through the second head)
    unread = [f"blocks.{i}.{layer}.{p}" for i, layer in ((0, "side"), (1, "fc1"), (1, "fc2")) for p in ("bias", "weight")]
    assert _nones(eager["grads"])[0] == [*unread, "out.bias", "out.weight"]
    assert _compare(ours, eager, CASE) == []


@pytest.mark.parametrize("stage, templates", BUILDS, ids=IDS)
def test_fake_world_of_2_leaves_unreached_none(stage, templates):
    result = run_as_rank(run_case, 2, CASE, stage, templates)
    assert _nones(result["ours"]["grads"]) == _nones(result["reference"]["grads"])
