"""Bad input and faults: diverged ranks, dead or silent peers, unsupported uses.

Each case must end in a zerograph error on every rank that can still raise one, naming what went
wrong and what to do, and never in a hang. Spawned runs are shared between tests through
``functools.lru_cache`` (one spawn per scenario), as ``conftest.training_run`` does.
"""
from __future__ import annotations

import functools
import re
import weakref

import pytest
import torch

import zerograph
from zerograph.errors import CollectiveError, ModelChangedError
from zerograph.runtime.runtime import CommSchedule, ScheduleEntry, is_communication_failure
from zerograph.runtime.state import runtime_of_model, state_of

from .distributed import RankFailed, spawn
from .workers_faults import (
    cases_out_of_step,
    dies_between_forward_and_backward,
    one_rank_goes_silent,
    replica_and_checkpoint_faults,
    schedule_checks,
    unsupported_uses,
)

WORLD = 2
ADVICE = "only activation shapes, such as sequence lengths, may differ"


@functools.lru_cache(maxsize=None)
def _schedule_run() -> tuple:
    return tuple(spawn(schedule_checks, WORLD, timeout_s=180))


@functools.lru_cache(maxsize=None)
def _unsupported_run() -> tuple:
    return tuple(spawn(unsupported_uses, WORLD, timeout_s=180))


def _mismatch(result: dict, case: str) -> str:
    error = result[case]
    assert error is not None, f"{case}: no error"
    assert error["type"] == "ScheduleMismatchError" and error["zerograph"], error
    return error["message"]


# -- diverged ranks ---------------------------------------------------------------------------------

@pytest.mark.distributed
def test_per_rank_sequence_lengths_are_not_a_mismatch() -> None:
    for rank, result in enumerate(_schedule_run()):
        assert result["legal"] is None, result["legal"]
        assert (2, result["seq_len"], 8) in result["graph_shapes"]  # each rank compiled its own shape
    assert [r["seq_len"] for r in _schedule_run()] == [16, 8]


@pytest.mark.distributed
def test_control_flow_divergence_raises_on_every_rank() -> None:
    messages = [_mismatch(result, "control_flow") for result in _schedule_run()]
    for rank, message in enumerate(messages):
        assert "rank 0 is about to run forward graph" in message and "(3 collectives)" in message
        assert "(2 collectives)" in message
        assert ("differ at collective 2: rank 0 runs all_gather of 72 float32 elements for unit 'blocks.2', "
                "rank 1 runs nothing (its schedule ends after 2 collectives)") in message
        assert ADVICE in message and message.endswith(f"this is rank {rank})")
        # rank 1's schedule is the start of rank 0's: the hint that its forward was cut (by its own raise?)
        assert "Rank 1's graph stops early, where the other continues" in message
        assert "if rank 1 raises an exception of its own right after these collectives" in message
    # the check raised before any collective of the graph: both ranks train on afterwards
    assert [result["after_mismatch"] for result in _schedule_run()] == [None, None]


@pytest.mark.distributed
def test_divergence_at_stage_0_is_caught_before_the_backward_all_reduces() -> None:
    for result in _schedule_run():
        message = _mismatch(result, "stage0_backward")
        assert "stops early" not in message  # different units, not one schedule cut short
        assert "backward graph" in message
        assert ("collective 0: rank 0 runs all_reduce of 72 float32 elements for unit 'blocks.2', "
                "rank 1 runs all_reduce of 72 float32 elements for unit 'blocks.1'") in message


def test_mismatch_text_names_dtype_and_world_size_one_skips_the_check() -> None:
    entry = ScheduleEntry("all_gather", 72, "float32", (1,))
    runtime = runtime_of_model(zerograph.compile(torch.nn.Linear(3, 3), stage=3))
    graph = torch.fx.Graph()
    empty = runtime.schedule_check.schedule(graph, "forward")
    assert isinstance(empty, CommSchedule) and empty.entries == () and empty.label.startswith("forward graph #")
    a = CommSchedule("x", "forward", (entry,), 0)
    text = runtime.schedule_check._describe_mismatch(("forward graph #0", a.entries), 1,
                                                     ("forward graph #3", (ScheduleEntry("all_gather", 72, "bfloat16", (1,)),)))
    assert "rank 0 runs all_gather of 72 float32 elements for unit" in text
    assert "rank 1 runs all_gather of 72 bfloat16 elements" in text
    runtime.schedule_check.check_schedule(a)  # world size 1: nothing to compare, no collective


# -- silent and dead peers ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _silent_run(flag_dir: str) -> tuple:
    return tuple(spawn(one_rank_goes_silent, WORLD, flag_dir, pg_timeout_s=60, timeout_s=180, teardown_barrier=False))


def _waited_s(message: str) -> float:
    return float(re.search(r"failed after ([0-9.]+) s", message).group(1))


@pytest.fixture(scope="module")
def silent_run(tmp_path_factory) -> tuple:
    return _silent_run(str(tmp_path_factory.mktemp("flags")))


@pytest.mark.distributed
def test_a_silent_rank_makes_the_others_raise_within_the_group_timeout(silent_run) -> None:
    """Rank 1 fails in Python before its forward and stays alive: the process group's timeout
    (3 s) ends rank 0's wait, although Config.timeout_s is the default 300 s."""
    busy, silent = silent_run
    assert silent["group_timeout"]["type"] == "ValueError" and "corrupt record" in silent["group_timeout"]["message"]
    error = busy["group_timeout"]
    assert error["type"] == "CollectiveError" and error["zerograph"], error
    message = error["message"]
    assert message.startswith("rank 0: the schedule check before forward graph #")
    assert "all_gather of 72 float32 elements for unit 'blocks.0'" in message
    assert "A peer rank probably died, raised before reaching this graph" in message
    assert "RuntimeError" in error["cause"]  # gloo's own error is chained
    assert 2 <= _waited_s(message) < 60, message


@pytest.mark.distributed
def test_a_silent_rank_makes_the_others_raise_within_config_timeout(silent_run) -> None:
    """The same on a group with a 60 s timeout: Config(timeout_s=2) bounds the wait."""
    busy, silent = silent_run
    assert silent["config_timeout"]["type"] == "ValueError"
    error = busy["config_timeout"]
    assert error["type"] == "CollectiveError", error
    assert "Config.timeout_s (2 s here)" in error["message"] and "timed out" in error["message"].lower()
    assert 1.5 <= _waited_s(error["message"]) < 30, error["message"]
    assert error["elapsed_s"] < 45


@pytest.mark.distributed
@pytest.mark.parametrize("episode", ["group_timeout", "config_timeout"])
def test_after_a_failed_collective_the_group_runs_no_more(silent_run, episode: str) -> None:
    """After its collective failed, rank 0's count of collectives on the group differs from its
    peer's: a later call raises at once, naming the earlier failure, instead of pairing its
    collectives with different ones of the peer (gloo's buffers of another collective)."""
    busy, _ = silent_run
    again = busy[episode]["again"]
    assert again["type"] == "CollectiveError" and again["zerograph"], again
    assert "failed on this rank earlier (the schedule check before forward graph #" in again["message"]
    assert "destroy the process group, create a new one" in again["message"]
    assert again["elapsed_s"] < 1.5, again  # no wait for any timeout


@pytest.mark.distributed
def test_a_rank_dying_between_forward_and_backward(tmp_path) -> None:
    """Rank 1 calls ``os._exit`` after its forward; rank 0's ``backward()`` raises a
    ``CollectiveError`` (through autograd, type intact) instead of waiting for it."""
    report = tmp_path / "survivor.pt"
    with pytest.raises(RankFailed) as failed:
        spawn(dies_between_forward_and_backward, WORLD, str(report), pg_timeout_s=30, timeout_s=180,
              teardown_barrier=False)
    assert "--- rank 0 ---" in str(failed.value) and "--- rank 1 ---" not in str(failed.value)
    seen = torch.load(report, weights_only=False)
    assert seen["type"] == "CollectiveError" and seen["zerograph"], seen
    assert seen["message"].startswith("rank 0: the schedule check before backward graph #")
    assert "the graph's first collective is all_gather" in seen["message"]  # stage 3 backward re-gathers first
    assert "A peer rank probably died" in seen["message"] and "by peer" in seen["message"]  # gloo's closed or reset
    assert seen["elapsed_s"] < 30  # Config(timeout_s=5); gloo usually notices the closed socket at once


def test_graph_errors_are_translated_only_when_communication_failed() -> None:
    runtime = runtime_of_model(zerograph.compile(torch.nn.Linear(3, 3), stage=3))
    schedule = CommSchedule("backward graph #7", "backward", (ScheduleEntry("reduce_scatter", 12, "float32", (0,)),), 1)

    def closed(args):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")

    def shape_bug(args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x7 and 5x3)")

    with pytest.raises(CollectiveError, match=r"a collective of backward graph #7 failed") as info:
        runtime.run_graph(schedule, closed, [])
    assert "reduce_scatter of 12 float32 elements for unit '<root>'" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError) and isinstance(info.value, RuntimeError)
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        runtime.run_graph(schedule, shape_bug, [])
    assert not isinstance(info.value, zerograph.ZeroGraphError)
    assert runtime.run_graph(schedule, lambda args: 42, []) == 42
    assert is_communication_failure(RuntimeError("Timed out waiting 3000ms for recv operation"))
    assert not is_communication_failure(ValueError("gloo"))


# -- unsupported uses, checked on both ranks ---------------------------------------------------------------

@pytest.mark.parametrize("case, error, fragments", [
    ("call_submodule", "ShardingError",
     ["submodule 'blocks.0' (Linear) was called on its own", "Call the compiled model itself"]),
    ("torch_compile_submodule", "ShardingError", ["submodule 'blocks.0' (Linear)", "do not torch.compile"]),
    ("zerograph_compile_submodule", "ShardingError",
     ["parameter 'weight' is already sharded", "Compile the whole model once"]),
    ("zerograph_compile_twice", "ShardingError", ["already compiled by zerograph", "compile a fresh instance"]),
    ("freeze_after_compile", "ModelChangedError",
     ["requires_grad changed after zerograph.compile for 'blocks.1.weight' (trainable -> frozen)",
      "set requires_grad before zerograph.compile"]),
    ("parameter_added", "ModelChangedError", ["parameter 'blocks.2.scale' was added after zerograph.compile",
                                              "before calling zerograph.compile"]),
    ("parameter_replaced", "ModelChangedError", ["parameter 'blocks.0.bias' was replaced after zerograph.compile"]),
    ("submodule_added", "ModelChangedError",
     ["submodule 'head' with parameters zerograph did not shard (weight, bias) was added"]),
])
@pytest.mark.distributed
def test_unsupported_use_raises_a_clear_error_on_every_rank(case: str, error: str, fragments: list[str]) -> None:
    for result in _unsupported_run():
        seen = result[case]
        assert seen is not None and seen["type"] == error and seen["zerograph"], (case, seen)
        for fragment in fragments:
            assert fragment in seen["message"], (fragment, seen["message"])


@pytest.mark.distributed
def test_unfreezing_again_and_freezing_before_compile_stay_legal() -> None:
    for result in _unsupported_run():
        assert result["unfrozen_again"] is None  # the refused forward ran no collective
        legal = result["frozen_before_compile"]
        assert legal["error"] is None and legal["unchanged"] and legal["grad"] is None, legal


def test_model_changes_are_caught_without_a_per_step_parameter_loop() -> None:
    """The per-forward check is one list test; the requires_grad comparison runs only when Dynamo
    recompiles (it guards on requires_grad), so a steady step never loops over the parameters."""
    model = zerograph.compile(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)), stage=3)
    watch = state_of(model).watch
    calls = []
    check = watch.check_trainable
    watch.check_trainable = lambda: calls.append(1) or check()  # type: ignore[method-assign]
    x = torch.randn(2, 3)
    for _ in range(3):
        model(x).sum().backward()
    assert len(calls) == 1  # the first compile only
    model[0].weight.requires_grad_(False)
    with pytest.raises(ModelChangedError, match=r"'0.weight' \(trainable -> frozen\)"):
        model(x)
    assert len(calls) == 2
    assert watch.changes == []
    model[1].bias = torch.nn.Parameter(torch.zeros(1))
    assert watch.changes == ["parameter '1.bias' was replaced"]


# -- replicas that start different, checkpoints across ranks ----------------------------------------

@pytest.fixture(scope="module")
def replica_run(tmp_path_factory) -> tuple[list[dict], dict]:
    """Per-rank results of ``replica_and_checkpoint_faults`` and rank 0's view of the dead peer."""
    root = tmp_path_factory.mktemp("issue22")
    with pytest.raises(RankFailed):  # rank 1 dies on purpose in the last case; rank 0 raises
        spawn(replica_and_checkpoint_faults, WORLD, str(root), pg_timeout_s=30, timeout_s=240, teardown_barrier=False)
    results = [torch.load(root / f"result{r}.pt", weights_only=False) for r in range(WORLD)]
    return results, torch.load(root / "dead_peer.pt", weights_only=False)


@pytest.mark.distributed
def test_replicas_seeded_differently_start_from_rank_0(replica_run) -> None:
    """Each rank seeded ``torch.manual_seed(rank)``; at every stage every rank's
    full parameters and buffer are those rank 0 built (DDP's and FSDP1's broadcast at construction)."""
    from .workers_faults import Stack

    torch.manual_seed(0)
    expected = Stack()
    expected.register_buffer("scale", torch.randn(8))
    results, _ = replica_run
    for stage in range(4):
        for rank, result in enumerate(results):
            got = result["replicas"][stage]
            assert got.keys() == dict(expected.named_parameters()).keys() | {"scale"}
            for name, value in [*expected.named_parameters(), ("scale", expected.scale)]:
                assert torch.equal(got[name], value), (stage, rank, name)


@pytest.mark.distributed
def test_different_models_are_refused_at_compile() -> None:
    for rank, result in enumerate(_schedule_run()):
        error = result["shapes"]
        assert error is not None and error["type"] == "ShardingError", error
        assert ("ranks built different models: at parameter/buffer 0, rank 0 has parameter 'blocks.0.weight' "
                "of shape (8, 8) float32, rank 1 has parameter 'blocks.0.weight' of shape (6, 6) float32") \
            in error["message"]
        assert f"(this is rank {rank})" in error["message"]


@pytest.mark.distributed
def test_save_refuses_ranks_that_disagree_on_the_path_or_share_no_file_system(replica_run) -> None:
    """Different paths, then the same relative path in different directories (no
    shared file system), with and without a staging directory on rank 1's disk: every rank raises
    ``CheckpointError`` and nothing is marked complete."""
    results, _ = replica_run
    for rank, result in enumerate(results):
        paths = result["paths"]
        assert paths["type"] == "CheckpointError", paths
        assert "ranks passed different paths to checkpoint.save" in paths["message"]
        assert "rank 1 '" in paths["message"] and "rank1'" in paths["message"]
        assert result["after_paths"] == []  # nothing written
        assert result["unshared"]["type"] == "CheckpointError", result["unshared"]
        assert "rank 1 does not see the staging directory" in result["unshared"]["message"]
        assert "do not share a file system" in result["unshared"]["message"]
        stale = result["unshared_stale"]
        assert stale["type"] == "CheckpointError", stale
        assert "does not see rank 1's files" in stale["message"] or "does not see rank 0's files" in stale["message"]
        assert "ck" not in result["host_listing"] and "ck2" not in result["host_listing"]  # never completed
        corrupt = result["corrupt"]
        assert corrupt["type"] == "CheckpointError" and "corrupt" in corrupt["message"], corrupt
        assert "__1_0.distcp" in corrupt["message"]


@pytest.mark.distributed
def test_a_peer_dying_during_save_is_a_collective_error(replica_run) -> None:
    """The class "every failure names its cause": rank 1 exits while writing its shards; rank 0's
    save raises ``CollectiveError`` (gloo's error chained), not gloo's raw ``RuntimeError``."""
    _, dead = replica_run
    assert dead["type"] == "CollectiveError" and dead["zerograph"], dead
    assert "a peer rank probably died" in dead["message"]
    assert dead["elapsed_s"] < 30


def test_eager_collectives_translate_communication_failures(monkeypatch) -> None:
    """A frame Dynamo ran eagerly uses the runtime's eager collectives: a dead peer there is a
    ``CollectiveError`` naming the parameter (gloo's error chained), other errors pass unchanged;
    after the failure the group is out of step, and the next eager collective raises at once."""
    import zerograph.runtime.eager as eager_module
    import zerograph.runtime.topology as topology_module

    monkeypatch.setattr(topology_module, "_OUT_OF_STEP", weakref.WeakKeyDictionary())  # this test's marks only
    runtime = runtime_of_model(zerograph.compile(torch.nn.Linear(4, 3), stage=3))
    runtime.topology.world_size = 2  # pretend a peer: the eager all-gather runs instead of the one-rank shortcut
    key = next(k for k, layout in runtime.layouts.items() if layout.fqn == "weight")
    monkeypatch.setattr(eager_module, "gather_fn", lambda *a, **k: lambda *t: (_ for _ in ()).throw(RuntimeError("shape")))
    with pytest.raises(RuntimeError, match="shape") as info:
        runtime.eager.unshard(torch.zeros(2, 4), key)
    assert not isinstance(info.value, zerograph.ZeroGraphError)

    def closed(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(eager_module, "gather_fn", lambda *a, **k: closed)
    with pytest.raises(CollectiveError, match=r"rank 0: the eager all_gather of 'weight' \(run outside a graph") as info:
        runtime.eager.unshard(torch.zeros(2, 4), key)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(CollectiveError, match=r"failed on this rank earlier \(the eager all_gather of 'weight'"):
        runtime.eager.unshard(torch.zeros(2, 4), key)


@pytest.mark.distributed
@pytest.mark.parametrize("case, difference", [
    ("raised", "rank 0: case 'raised', raised ValueError: a bad batch on rank 0 only, 0 collectives"),
    ("extra collective", "rank 0: case 'extra collective', returned, 1 collectives on the world group; "
                         "rank 1: case 'extra collective', returned, 0 collectives"),
])
def test_a_multi_case_run_stops_where_its_ranks_fall_out_of_step(case: str, difference: str) -> None:
    """The tests' runs of many cases per spawn check after each case, through the store, that the
    ranks ran the same case to the same end and the same number of collectives: a rank that raised
    alone (a timeout, a one-sided error) would otherwise pair its next collectives with different
    ones of its peer, which gloo answers with a crash in a later test or wrong values."""
    with pytest.raises(RankFailed, match="ranks out of step after case 1 of this run") as failed:
        spawn(cases_out_of_step, WORLD, case, timeout_s=120, teardown_barrier=False)
    assert difference in str(failed.value)
    assert "the next case" not in str(failed.value)
