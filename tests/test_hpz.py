"""hpZ (``Config(secondary_partition_size=M)``, ZeRO++ section 3.2): stage 3 whose backward
re-gathers each unit from a secondary partition over M ranks instead of all N. Parity with
single-process eager training on 4 gloo ranks as 2 nodes of 2; structure and bytes per group as
rank 0 of a fake world of 4 (``tests.distributed.run_as_rank``: the graphs and counts are that
rank's, and no values are checked)."""
from __future__ import annotations

import functools

import pytest
import torch

import zerograph

from .distributed import run_as_rank, spawn
from .models import build, reference_training
from .test_parity import LR, STEPS, check_parity
from .workers import train_runs
from .workers_hybrid import hpz_graph_facts


@functools.lru_cache(maxsize=None)
def graph_facts(name: str = "gpt", templates: bool = True, bucketing: bool = True) -> dict:
    """``hpz_graph_facts`` as rank 0 of a fake world of 4 in nodes of 2, once per build: tests that
    read the same build share its compile."""
    return run_as_rank(hpz_graph_facts, 4, 2, name, templates, bucketing)


@pytest.mark.distributed
def test_hpz_matches_single_process_on_two_nodes_of_two() -> None:
    """The tiny GPT with templated, bucketed units; the GPT with every block under
    ``torch.utils.checkpoint`` (whose backward recomputes each block's forward from the node
    group's re-gather) in the per-parameter build; and the checkpointed GPT with a collective per
    unit (no bucketing). Two runs of the five this trained on four ranks are left out: the
    checkpointed templated bucketed one, each of whose pairs of choices (checkpointed, templated,
    bucketed) another run trains; and the plain unbucketed one: the checkpointed GPT's
    embeddings, final norm and head are not checkpointed, so its unbucketed run trains them on
    that path, and its blocks save and re-gather pieces as plain blocks do, adding the recompute
    (the in-process tests below check both models' unbucketed graphs)."""
    hpz = zerograph.Config(secondary_partition_size=2)
    per_parameter = zerograph.Config(secondary_partition_size=2, unit_templates=False)
    unbucketed = zerograph.Config(secondary_partition_size=2, disabled_passes=("bucketing",))
    runs = (("gpt", 3), ("gpt_checkpointed", 3, per_parameter), ("gpt_checkpointed", 3, unbucketed))
    results = spawn(train_runs, 4, runs, STEPS, 4, LR, hpz)
    for run in runs:
        reference = reference_training(run[0], STEPS, 4, LR)
        for result in results:
            check_parity(result[run], reference)


def test_hpz_backward_gathers_inside_the_node() -> None:
    """Backward runs no all-gather over the 4 ranks: each re-gather is over the rank's node of 2,
    counted on its own dim; forward still gathers over all 4."""
    facts = graph_facts()
    assert facts["world_gathers_in_backward"] == 0
    assert facts["node_gathers_in_backward"]
    assert all(same and size == 2 for same, size in facts["node_gathers_in_backward"])
    assert facts["comm_bytes_per_dim"]["secondary"]["all_gather"] > 0
    # the step's bytes per dim, as counted from the graphs, are the plan's
    planned = zerograph.plan(build("gpt"), 3, 4, secondary_partition_size=2, param_dtype=torch.float32)
    assert facts["comm_bytes_per_dim"] == {d: dict(c) for d, c in planned.comm_bytes_per_dim.items()}
    # the secondary partition held from forward to backward, measured, is the plan's
    assert facts["secondary_partition_bytes"] == planned.secondary_partition_bytes > 0


@pytest.mark.parametrize("name", ["gpt", "gpt_checkpointed"])
def test_hpz_without_bucketing_cuts_each_piece_after_its_wait(name: str) -> None:
    """Without ``bucketing`` each unit's flat shard is all-gathered alone, with no copy-out after
    the collective: the forward cuts the unit's piece from the collective's result after its wait
    (it read the collective's buffer before the wait, which the pass manager refused), and
    backward re-gathers every unit over the node only. Checkpointed, some parameters gathered
    alone (a bias) are read in backward only by the recomputed forward: they get a piece too."""
    facts = graph_facts(name, True, False)
    assert facts["world_gathers_in_backward"] == 0
    assert all(same and size == 2 for same, size in facts["node_gathers_in_backward"])
    assert facts["node_gathers_of_saved_pieces"] == facts["pieces_saved"] == len(facts["node_gathers_in_backward"]) > 0
    assert facts["secondary_partition_bytes"] > 0


@pytest.mark.parametrize("templates", [True, False], ids=["templates", "per-parameter"])
def test_hpz_with_activation_checkpointing_saves_pieces_not_gathered_blocks(templates: bool) -> None:
    """Blocks under ``torch.utils.checkpoint``: backward recomputes each block's forward, which
    reads the block's gathered parameters. The forward saves the block's 1/2 piece (not the
    gathered block, which stage 3 forbids), and backward re-gathers it over the node only, the
    same bytes per group and the same pieces as without the checkpoint; with templated units and
    with the per-parameter build."""
    facts = graph_facts("gpt_checkpointed", templates)
    plain = graph_facts("gpt", templates)
    assert facts["world_gathers_in_backward"] == 0
    assert all(same and size == 2 for same, size in facts["node_gathers_in_backward"])
    assert facts["node_gathers_of_saved_pieces"] == facts["pieces_saved"] == plain["pieces_saved"] > 0
    assert facts["comm_bytes_per_dim"] == plain["comm_bytes_per_dim"]
    assert facts["secondary_partition_bytes"] == plain["secondary_partition_bytes"] > 0
    # the checkpoint's point: fewer saved activations than without it
    assert facts["saved_activation_bytes"] < plain["saved_activation_bytes"]


@pytest.mark.parametrize("kwargs, stage, match", [
    (dict(secondary_partition_size=2), 2, "stage 3"),
    (dict(secondary_partition_size=1), 3, "at least 2"),
    (dict(secondary_partition_size=2), 3, "divide the world size 1"),  # no launcher: a world of one
    (dict(secondary_partition_size=2, activations=zerograph.ActivationPolicy(budget_bytes=0)), 3, "not supported yet"),
])
def test_hpz_refuses_what_it_cannot_do(kwargs, stage, match) -> None:
    with pytest.raises(zerograph.ConfigError, match=match):
        zerograph.compile(torch.nn.Linear(4, 4), stage, config=zerograph.Config(**kwargs))
