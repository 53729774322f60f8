"""The models people bring take the template fast path: Hugging Face GPT-2 and Llama built from a
config and a torchtitan-style Llama 3 (``zerograph.bench.real_models``), unchanged, every block on
its template in training and in eval at two batch sizes (``Config(strict_templates=True)``: any
exit would raise), with eager's losses and gradients. One rank, in process, small sizes."""
from __future__ import annotations

import copy

import pytest
import torch

import zerograph
from zerograph.bench.real_models import REAL_MODELS
from zerograph.runtime.state import state_of

from .test_unit_template_calls import _grads_match

VOCAB, SEQ = 64, 16


@pytest.mark.slow  # three models traced in train and eval at two batch sizes
@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_every_block_runs_its_template_in_training_and_eval(name: str) -> None:
    real = REAL_MODELS[name]
    torch.manual_seed(0)
    reference = real.build(32, 2, 2, VOCAB, SEQ)
    model = zerograph.compile(copy.deepcopy(reference), 3, config=zerograph.Config(
        lowering="eager", strict_templates=True, unit_classes=tuple({type(b) for b in real.blocks(reference)})))
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    for net in (reference, model):  # the same seed: GPT-2's dropout draws the same masks
        torch.manual_seed(1)
        real.loss(net, tokens[:, :-1], tokens[:, 1:]).backward()
    _grads_match(reference, model)
    reference.eval()
    model.eval()
    for batch in (2, 3):
        x = torch.randint(0, VOCAB, (batch, SEQ + 1))
        with torch.no_grad():
            torch.testing.assert_close(real.loss(model, x[:, :-1], x[:, 1:]), real.loss(reference, x[:, :-1], x[:, 1:]),
                                       rtol=1e-5, atol=1e-5)
    for kind in state_of(model).unit_kinds:
        path = kind.path()
        assert path["path"] == "template" and path["exits"] == {} and path["inline_modes"] == {}, path
    assert "| template |" in zerograph.explain(model)
