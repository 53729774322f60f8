"""The memory side-by-side bench (zerograph.bench.side_by_side): the structure of its JSON and table,
from one tiny in-process run in a fake world (the figures themselves are not checked: no timing, no RSS)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from zerograph.bench.side_by_side import ModelSpec, format_table, side_by_side

TINY = ModelSpec("gpt", dim=32, layers=2, heads=2, batch=1, seq=8)


@pytest.fixture(scope="module")
def result() -> dict:
    # measure() makes its own fake world: drop the world-1 group an earlier in-process test's
    # zerograph.compile leaves behind, as tests.distributed.fake_rank does
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()
    return side_by_side({"gpt": TINY}, 4, ("zerograph-s3", "fsdp2"), steps=1, in_process=True)


def test_json_has_one_row_per_model_with_the_plan_and_every_system(result):
    assert json.loads(json.dumps(result)) == result  # JSON-able as it is
    assert {"world_size", "steps", "systems", "rows", "machine", "date", "commit", "uncommitted"} <= result.keys()
    (row,) = result["rows"]
    assert row["model"] == "gpt" and row["spec"]["dim"] == 32
    assert set(row["systems"]) == {"zerograph-s3", "fsdp2"}
    plan = row["plan"]
    assert set(plan["step_peak_breakdown"]) == {"model_states", "gathered_params", "full_gradients", "activations"}
    assert plan["step_peak_bytes"] == sum(plan["step_peak_breakdown"].values())
    assert plan["step_peak_breakdown"]["activations"] > 0  # the bench gives the plan its inputs


def test_each_system_reports_its_peak_and_state(result):
    for name, r in result["rows"][0]["systems"].items():
        assert r["error"] is None, r["error"]
        assert r["system"] == name and r["world_size"] == 4 and len(r["step_s"]) == 1
        assert isinstance(r["peak_rss_growth_bytes"], int)
        assert r["state_bytes"]["params"] > 0 and r["state_bytes"]["optimizer_states"] > 0
    stats = result["rows"][0]["systems"]["zerograph-s3"]["zerograph_stats"]
    assert stats["saved_activation_bytes"] > 0


def test_table_names_every_system_and_the_plan(result):
    table = format_table(result)
    header = table.splitlines()[0]
    for column in ("zerograph-s3", "fsdp2", "plan (s3)", "plan / measured s3", "s3 / fsdp2"):
        assert column in header
    assert "fake world of 4" in table


def test_a_failed_system_is_reported_not_faked():
    failed = {"system": "fsdp2-compile", "error": "RuntimeError: boom"}
    result = {"world_size": 4, "steps": 1, "systems": ["fsdp2-compile"], "machine": "m", "date": "d", "commit": "c",
              "rows": [{"model": "gpt", "label": "gpt", "plan": {"psi": 1, "step_peak_bytes": 1, "notes": []},
                        "systems": {"fsdp2-compile": failed}}]}
    table = format_table(result)
    assert "failed" in table and "boom" in table


def test_zerograph_memory_is_the_cli_of_the_side_by_side_and_refuses_bad_flags(capsys) -> None:
    """``zerograph memory`` parses the example's flags and refuses an unknown model or a width the
    heads do not divide before it starts any process (exit status 2, one line naming it)."""
    from zerograph import cli

    assert cli.main(["memory", "--models", "gpt,bert", "--world-size", "8"]) == 2
    assert "unknown model(s) / system(s): ['bert']" in capsys.readouterr().err
    assert cli.main(["memory", "--models", "gpt", "--gpt", "100x2:1x8", "--heads", "16"]) == 2
    assert "width 100 is not a multiple of --heads 16" in capsys.readouterr().err


def test_the_json_names_the_command_as_typed(monkeypatch, tmp_path) -> None:
    """The JSON's ``command`` is the command line that reproduces it (it read "zerograph memory
    memory ..." when taken from ``sys.argv``, which already holds the subcommand)."""
    from zerograph import cli
    from zerograph.bench import side_by_side_cli

    def measured(*args, **kwargs) -> dict:
        return {"world_size": 8, "steps": 1, "systems": ["fsdp2"], "machine": "m", "date": "d", "commit": "c",
                "rows": [{"model": "gpt", "label": "gpt", "plan": {"psi": 1, "step_peak_bytes": 1, "notes": []},
                          "systems": {"fsdp2": {"system": "fsdp2", "error": "RuntimeError: not run"}}}]}

    monkeypatch.setattr(side_by_side_cli, "side_by_side", measured)
    out = tmp_path / "memory.json"
    assert cli.main(["memory", "--models", "gpt", "--systems", "fsdp2", "--world-size", "8", "--json", str(out)]) == 0
    command = json.loads(out.read_text())["command"]
    assert command == f"zerograph memory --models gpt --systems fsdp2 --world-size 8 --json {out}"
