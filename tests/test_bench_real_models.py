"""The real models of the bench and ``zerograph memory`` (zerograph/bench/real_models.py): Hugging
Face GPT-2 and Llama used unchanged, and the torchtitan-shaped Llama of zerograph.models.titan_llama.
Each builds and trains under the bench's harness as rank 0 of a fake world, in process, at a tiny
size: the structure of what runs and is reported, not its time. And ``make gpu-check`` skips
cleanly without CUDA."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from zerograph.bench.real_models import REAL_MODELS
from zerograph.bench.side_by_side import ModelSpec, format_table, side_by_side
from zerograph.bench.systems import build_system, parse_system, train_step
from zerograph.bench.workloads import load_workload
from zerograph.runtime.state import units_of

from .distributed import fake_rank

WORLD_SIZE = 4
LAYERS = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_three_real_models_are_registered() -> None:
    assert set(REAL_MODELS) == {"hf-gpt2", "hf-llama", "titan-llama"}


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_bench_workload_trains_a_step_under_zerograph_and_fsdp2(name: str) -> None:
    """``zerograph bench --model NAME``'s workload: built by the bench's ``build_system``, stepped by
    its ``train_step`` with the loss outside the model; zerograph's units are the blocks FSDP2 wraps."""
    workload = load_workload(name, WORLD_SIZE, 16, 0, LAYERS, 64)
    with fake_rank(WORLD_SIZE):
        for system in ("zerograph-s3", "fsdp2"):
            torch.manual_seed(0)
            model, optimizer = build_system(parse_system(system, 1, 2**20), workload, torch.device("cpu"), 1e-3)
            batch = workload.batch(0, 0, WORLD_SIZE)
            assert batch[0].shape == (1, 16)
            loss = train_step(model, optimizer, batch, workload.loss)
            assert loss.dim() == 0 and math.isfinite(loss.item()), (system, loss)
            assert optimizer.state, f"{system}: AdamW took no step"
            if system == "zerograph-s3":
                blocks = [id(b) for b in workload.blocks(model)]
                block_names = [n for n, m in model.named_modules() if id(m) in blocks]
                assert [u.name for u in units_of(model)[1:]] == block_names and len(blocks) == LAYERS
            del model, optimizer


@pytest.fixture(scope="module")
def memory_run() -> dict:
    """``zerograph memory`` in process for the three models: meta-built, sharded, initialised, two steps."""
    specs = {name: ModelSpec(name, dim=64, layers=LAYERS, heads=4, batch=1, seq=16) for name in sorted(REAL_MODELS)}
    # measure() makes its own fake world: drop the world-1 group an earlier in-process test's
    # zerograph.compile leaves behind, as tests.distributed.fake_rank does
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch._dynamo.reset()
    return side_by_side(specs, WORLD_SIZE, ("zerograph-s3", "fsdp2"), steps=2, warmup=1, in_process=True)


@pytest.mark.slow  # the fixture: six models built, sharded, initialised and stepped (about a minute)
def test_memory_side_by_side_measures_every_real_model(memory_run: dict) -> None:
    assert [row["model"] for row in memory_run["rows"]] == sorted(REAL_MODELS)
    for row in memory_run["rows"]:
        for system, r in row["systems"].items():
            assert r["error"] is None, (row["model"], system, r["error"])
            assert len(r["step_s"]) == 2 and r["state_bytes"]["optimizer_states"] > 0
        templated = row["systems"]["zerograph-s3"]["templated_units"]
        assert templated["units"] == LAYERS and 0 <= templated["templated"] <= LAYERS
        assert row["plan"]["psi"] > 0


@pytest.mark.slow
def test_memory_table_has_step_times_and_templated_units(memory_run: dict) -> None:
    table = format_table(memory_run)
    time_header = next(line for line in table.splitlines() if "step ms" in line)
    assert "zerograph-s3 step ms" in time_header and "s3 templated units" in time_header
    for row in memory_run["rows"]:
        assert sum(row["label"] in line for line in table.splitlines()) == 2  # the memory and the time table
    assert "median (min-max) of steps 2-2" in table


def test_bench_and_memory_refuse_a_bad_real_model_size(capsys, monkeypatch) -> None:
    """Refused before any rank or process starts: a width the 64-wide heads do not divide, a
    warm-up that leaves no timed step."""
    from zerograph import cli
    from zerograph.bench import cli as bench_cli

    def launched(*args, **kwargs):
        raise AssertionError("launched despite a bad flag")

    monkeypatch.setattr(bench_cli, "launch", launched)
    assert cli.main(["bench", "--model", "hf-llama", "--n-embd", "100"]) == 2
    assert "--n-embd 100" in capsys.readouterr().err
    assert cli.main(["memory", "--models", "titan-llama", "--steps", "2", "--warmup", "2"]) == 2
    assert "--warmup 2" in capsys.readouterr().err


def test_gpu_check_skips_cleanly_without_cuda() -> None:
    """``make gpu-check`` on a machine without CUDA: exit 0 and one line saying it was skipped."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gpu_check.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("gpu-check skipped: no CUDA")


def test_titan_llama_keyword_inputs_and_init_as_torchtitan() -> None:
    """Positions 0..T-1 and a causal boolean mask give the defaults' logits; ``init_weights``
    re-assigns ``freqs_cis`` (a new tensor, as torchtitan's) and fills the meta-built model."""
    from zerograph.models.titan_llama import LlamaConfig, Transformer, cross_entropy_loss

    with torch.device("meta"):
        model = Transformer(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=8))
    model.to_empty(device="cpu")
    before = model.freqs_cis
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    assert model.freqs_cis is not before and model.freqs_cis.shape == (16, 4)
    assert isinstance(model.layers, torch.nn.ModuleDict) and list(model.layers) == ["0", "1"]
    tokens = torch.randint(64, (2, 8))
    logits = model(tokens)
    assert logits.shape == (2, 8, 64)
    causal = torch.ones(8, 8, dtype=torch.bool).tril().view(1, 1, 8, 8)
    positions = torch.arange(8).expand(2, 8)
    torch.testing.assert_close(model(tokens, attention_masks=causal, positions=positions), logits, atol=1e-5, rtol=1e-5)
    assert math.isfinite(cross_entropy_loss(logits, tokens).item())
