"""The DTensor shards work with state_dict and torch.distributed.checkpoint across ranks."""
from __future__ import annotations

import torch

from .distributed import spawn
from .models import build, global_batch
from .workers import checkpoint_roundtrip


def test_dcp_save_load_and_full_state_dict(tmp_path) -> None:
    results = spawn(checkpoint_roundtrip, 2, str(tmp_path / "ckpt"))
    for result in results:
        assert result["equal"]
        assert result["losses"][0] == result["losses"][1]
    # the gathered state dict has the unsharded model's keys and loads into a plain model
    plain = build("gpt")
    missing = plain.load_state_dict(results[0]["full_state"], strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"lm_head.weight"}  # tied to wte
    trained_loss = sum(r["losses"][0] for r in results) / 2
    with torch.no_grad():
        plain_loss = plain(*global_batch("gpt", 0, 4)).item()
    assert abs(plain_loss - trained_loss) < 1e-5, (plain_loss, trained_loss)
