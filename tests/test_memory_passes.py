"""The memory passes: selective_unshard keeps the smallest units gathered for backward."""
from __future__ import annotations

import functools

import pytest

import zerograph
from zerograph.passes.selective_unshard import choose_kept

from .distributed import spawn
from .models import reference_training
from .test_parity import LR, STEPS, check_parity
from .workers import train_configs

BLOCK_BYTES = 4 * 3280  # one block of the tiny GPT, fp32, full (at 2 ranks nothing is padded)


def test_choose_kept_takes_smallest_first_within_budget() -> None:
    assert choose_kept([300, 100, 200, 100], 250) == [1, 3]
    assert choose_kept([300, 100, 200], 0) == []
    assert choose_kept([300, 100, 200], 10_000) == [0, 1, 2]
    assert choose_kept([300, 100, 200], 99) == []


CONFIGS = (zerograph.Config(memory=zerograph.MemoryPolicy(unshard_budget_bytes=BLOCK_BYTES)),
           zerograph.Config(memory=zerograph.MemoryPolicy(reshard_root_after_forward=False)))


@functools.lru_cache(maxsize=None)
def runs() -> tuple:
    """Per config of ``CONFIGS``, per rank: ``tests.workers.train``'s result (one spawn for both)."""
    per_rank = spawn(train_configs, 2, "gpt", 3, STEPS, 4, LR, CONFIGS)
    return tuple(tuple(rank[i] for rank in per_rank) for i in range(len(CONFIGS)))


def kept_run() -> tuple:
    return runs()[0]


@pytest.mark.distributed
def test_selective_unshard_skips_one_regather_and_matches_eager() -> None:
    results = kept_run()
    for result in results:
        check_parity(result, reference_training("gpt", STEPS, 4, LR))
    backward = results[0]["graphs"][0]["backward"]
    assert backward["collectives"].count("all_gather") == 2  # root + one block; the other is kept
    forward = results[0]["graphs"][0]["forward"]
    assert len(forward["saved_gathered"]) > 0  # the kept block's parameters are saved for backward
    gathered = sum(size for _, size in results[0]["units"])  # Ψ, padded
    block = results[0]["units"][1][1]
    assert block * 4 == BLOCK_BYTES
    assert results[0]["stats"].comm_elements["all_gather"] == 2 * gathered - block  # one re-gather less



def root_kept_run() -> tuple:
    return runs()[1]


@pytest.mark.distributed
def test_root_kept_from_forward_to_backward_as_fsdp2_does() -> None:
    """``reshard_root_after_forward=False``: backward gathers the two blocks but not the root
    (embeddings, final norm, tied LM head), whose gathered parameters forward saves instead; the
    step moves Ψ + (Ψ - root) in all-gathers, and training matches eager."""
    results = root_kept_run()
    for result in results:
        check_parity(result, reference_training("gpt", STEPS, 4, LR))
    assert results[0]["graphs"][0]["backward"]["collectives"].count("all_gather") == 2
    assert len(results[0]["graphs"][0]["forward"]["saved_gathered"]) > 0
    gathered = sum(size for _, size in results[0]["units"])
    root = results[0]["units"][0][1]
    assert results[0]["stats"].comm_elements["all_gather"] == 2 * gathered - root


def test_config_validates_root_policy() -> None:
    with pytest.raises(zerograph.ConfigError, match="MemoryPolicy.reshard_root_after_forward must be a bool"):
        zerograph.MemoryPolicy(reshard_root_after_forward=1)
