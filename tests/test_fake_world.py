"""``zerograph.fake_world``: one rank of a large world in this process."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zerograph
from zerograph.graph.vocab import COLLECTIVE_KINDS
from zerograph.models.gpt import GPT, SIZES
from zerograph.runtime.state import graphs_of, runtime_of_model

from .distributed import fake_rank

WORLD = 64


def tiny_gpt_batch(batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = SIZES["tiny"]
    x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, dims=1)


def test_rank_of_64_compiles_and_steps_the_tiny_gpt_at_stage_3(tmp_path) -> None:
    torch.manual_seed(0)
    full_rows = {name: p.shape[0] for name, p in GPT(SIZES["tiny"]).named_parameters() if p.dim() > 0}
    with fake_rank(WORLD):
        torch.manual_seed(0)
        model = zerograph.compile(GPT(SIZES["tiny"]), stage=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(*tiny_gpt_batch())
        loss.backward()
        stats = zerograph.stats(model, opt)
        opt.step()
        opt.zero_grad()
        assert loss.shape == () and all(p.to_local().shape[0] == math.ceil(full_rows[n] / WORLD)
                                        for n, p in model.named_parameters() if n in full_rows)
        units = runtime_of_model(model).units
        forward = graphs_of(model)[0]["forward"]
        gathers = [n for n in forward.graph.nodes if COLLECTIVE_KINDS.get(n.target) == "all_gather"]
        assert len(gathers) == len(units)  # one all-gather per unit (root + 2 blocks)
        # reporting says what the numbers are; nothing meaningless is persisted
        assert stats.fake_world and stats.world_size == WORLD and str(stats).startswith("[fake world")
        assert sum(stats.comm_elements.values()) > 0  # the rank's collectives were counted all the same
        with pytest.raises(zerograph.FakeWorldError, match="checkpoint.save"):
            zerograph.checkpoint.save(model, opt, tmp_path / "ckpt")
        assert not list(tmp_path.iterdir())
    assert not dist.is_initialized()  # the block tore the fake group down


def test_stats_of_a_real_world_are_not_marked() -> None:
    model = zerograph.compile(torch.nn.Linear(4, 2), stage=3)
    model(torch.ones(3, 4)).sum().backward()
    stats = zerograph.stats(model)
    assert not stats.fake_world and not str(stats).startswith("[fake world")


@pytest.mark.parametrize("world_size, rank", [(0, 0), (4, 4), (4, -1), (2.0, 0), (True, 0)])
def test_bad_world_is_a_config_error(world_size, rank) -> None:
    with pytest.raises(zerograph.ConfigError):
        with zerograph.fake_world(world_size, rank):
            pass


def test_refuses_to_replace_an_initialised_group() -> None:
    with fake_rank(2):
        with pytest.raises(zerograph.ProcessGroupError, match="already initialised"):
            with zerograph.fake_world(4):
                pass
        assert dist.get_world_size() == 2  # the outer world is untouched


def test_table1_example_refuses_a_model_the_plan_says_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``examples/paper_table1.py`` asks ``zerograph.plan`` before allocating: a trillion
    parameters over 2 ranks is refused with the plan's numbers, not an out-of-memory crash. The
    script runs as ``__main__`` in this process (``runpy``, as ``python script`` runs it, without
    a second interpreter's imports of torch): the refusal is a ``SystemExit`` with a message,
    which Python prints to stderr with exit status 1."""
    import os
    import runpy
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "paper_table1.py")
    monkeypatch.setattr(sys, "argv", [script, "--params", "1.0e12", "--width", "25600", "--world-size", "2",
                                      "--stages", "3"])
    with pytest.raises(SystemExit) as refused:
        runpy.run_path(script, run_name="__main__")
    message = refused.value.code
    assert isinstance(message, str)  # not an exit status: Python prints it and exits with 1
    assert "zerograph.plan needs 8048.0 GB of model states per rank" in message
    assert "refusing to allocate" in message
