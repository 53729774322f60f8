"""World size 1 (no launcher): everything degenerates to local ops and matches eager exactly."""
from __future__ import annotations

import pytest
import torch

import zerograph
from zerograph.runtime.state import graphs_of

from .models import build, global_batch, reference_training


@pytest.mark.parametrize("stage", [0, 3])
def test_world_size_1_matches_eager(stage: int) -> None:
    model = zerograph.compile(build("gpt"), stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        loss = model(*global_batch("gpt", step, 4))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    reference = reference_training("gpt", 3, 4, 1e-3)
    assert losses == pytest.approx(reference["losses"], rel=1e-5, abs=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), reference["params"][name], rtol=1e-5, atol=1e-5)
    stats = zerograph.stats(model, opt)
    assert sum(stats.comm_elements.values()) == 0  # no collective at world size 1
    graph = graphs_of(model)[0]
    assert not [n for n in graph["backward"].graph.nodes if "_c10d_functional" in str(n.target)]


def test_dump_writes_every_graph_before_and_after_each_pass(tmp_path) -> None:
    import ast
    import re

    model = zerograph.compile(build("mlp"), stage=3, config=zerograph.Config(dump_dir=str(tmp_path)))
    model(*global_batch("mlp", 0, 4)).backward()
    dumped = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py"))
    for kind, last_pass in (("joint", "insert_allgather"), ("backward", "insert_reduce_scatter")):
        assert f"rank0/graph0_{kind}/00_input.py" in dumped
        assert any(re.fullmatch(rf"rank0/graph0_{kind}/\d\d_{last_pass}\.py", p) for p in dumped), dumped
    for path in tmp_path.rglob("*.py"):
        ast.parse(path.read_text())


def test_parameter_attribute_outside_forward_is_the_shard() -> None:
    """As in FSDP2: outside forward, ``module.weight`` is the registered DTensor shard, so writes
    reach the parameter and reads run no collective."""
    model = zerograph.compile(build("mlp"), stage=3)
    params = dict(model.named_parameters())
    assert model.layers[0].weight is params["layers.0.weight"]
    with torch.no_grad():
        torch.nn.init.zeros_(model.layers[2].bias)
        model.layers[2].weight.zero_()
    x, y = global_batch("mlp", 0, 4)
    assert model(x, y).item() == pytest.approx((y ** 2).mean().item())  # the net now outputs zeros


@pytest.mark.slow
def test_more_models_of_one_class_than_dynamos_recompile_limit_all_run_compiled() -> None:
    """Dynamo keeps at most 8 graphs per code object; each compiled model gets a code object of
    its own, so the ninth model of a class still runs its captured graph (not eagerly)."""
    import torch._dynamo

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x).sum()

    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        model = zerograph.compile(Tiny(), stage=3)
        model(torch.randn(2, 4)).backward()
        assert len(graphs_of(model)) == 1  # captured, so the passes ran
