"""``torch.utils.checkpoint`` around the GPT's blocks (``tests.models.CheckpointedGPT``) under
zerograph: backward recomputes each block's forward. Parity with eager training of the same
model, world of one, exact. The per-parameter build (``unit_templates=False``) is the case: in
torch 2.13 the partitioner saved the ``DeviceMesh`` input behind the RNG states of the
recomputed attention (``zerograph.passes.saved_opaque_objects_last``), and AOTAutograd's runtime
refused it. Templated units under a checkpoint: ``tests/test_unit_templates.py``; with hpZ on 4
ranks: ``tests/test_hpz.py``."""
from __future__ import annotations

import copy

import pytest
import torch

import zerograph

from .models import build, global_batch

LR = 1e-3


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpointed_gpt_per_parameter_matches_eager(stage: int) -> None:
    reference = build("gpt_checkpointed")
    model = zerograph.compile(copy.deepcopy(reference), stage, config=zerograph.Config(unit_templates=False))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, reference))
    for step in range(2):
        batch = global_batch("gpt", step, 2)
        loss, expected = model(*batch), reference(*batch)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6, msg=f"loss, step {step}")
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=f"{name}.grad")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=name)
