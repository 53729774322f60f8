"""The dump's manifests and ``zerograph inspect`` on damaged dumps, in one process.

One tiny dump (the MLP at stage 3, world size 1) is written once for the module; each test damages
a copy of it and checks that ``inspect`` names the damage in one line, never with a traceback.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

import zerograph
from zerograph import cli
from zerograph.errors import DumpError

from .models import build, global_batch

GRAPHS = ("graph0_joint", "graph0_partitioned", "graph0_forward", "graph0_backward")


@pytest.fixture(scope="module")
def tiny_dump(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("tiny") / "dump")
    model = zerograph.compile(build("mlp"), stage=3, config=zerograph.Config(dump_dir=root))
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.1)
    model(*global_batch("mlp", 0, 4)).backward()
    zerograph.explain(model, opt)
    return root


@pytest.fixture
def dump_copy(tiny_dump, tmp_path) -> str:
    copy = str(tmp_path / "dump")
    shutil.copytree(tiny_dump, copy)
    return copy


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def _inspect(capsys, *args: str) -> tuple[int, str, list[str]]:
    """``zerograph inspect ARGS``: (status, stdout, stderr lines)."""
    status = cli.main(["inspect", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return status, captured.out, captured.err.splitlines()


def _a_diff(root: str) -> tuple[str, dict]:
    graph = os.path.join(root, "rank0", "graph0_joint")
    entry = next(e for e in _json(os.path.join(graph, "passes.json")) if e.get("diff"))
    return graph, entry


def test_manifests_list_every_file_with_its_size(tiny_dump, capsys):
    root = _json(os.path.join(tiny_dump, "manifest.json"))
    assert root["format"] == "zerograph-dump" and root["schema"] == 1
    assert root["world_size"] == 1 and root["ranks"] == ["rank0"] and root["zerograph_version"]
    rank = _json(os.path.join(tiny_dump, "rank0", "manifest.json"))
    assert rank["run"] == root["run"] and rank["rank"] == 0 and rank["world_size"] == 1
    assert set(rank["graphs"]) == set(GRAPHS)
    for name, graph in rank["graphs"].items():
        assert graph["state"] == "complete"
        on_disk = set(os.listdir(os.path.join(tiny_dump, "rank0", name)))
        assert set(graph["files"]) == on_disk, name  # every file the dump wrote, nothing else
        for file, size in graph["files"].items():
            assert os.path.getsize(os.path.join(tiny_dump, "rank0", name, file)) == size
    assert {"summary.md", "summary.json"} <= set(rank["files"])
    status, out, err = _inspect(capsys, tiny_dump)
    assert (status, err) == (0, [])
    for name in GRAPHS:
        assert f"{name}:" in out


@pytest.mark.parametrize("damage, expected", [
    ("delete", "rank0/graph0_backward/passes.json: missing"),
    ("truncate", "rank0/graph0_backward/passes.json: truncated ("),
    ("schema", "rank0/graph0_backward/passes.json: not of dump schema 1: expected a list of passes"),
    ("entry", "rank0/graph0_backward/passes.json: not of dump schema 1: entry 1 has no str 'summary'"),
])
def test_damaged_passes_json_is_one_line(dump_copy, capsys, damage, expected):
    path = os.path.join(dump_copy, "rank0", "graph0_backward", "passes.json")
    entries = _json(path)
    if damage == "delete":
        os.remove(path)
    elif damage == "truncate":
        with open(path, "r+") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif damage == "schema":
        _write_json(path, {"schema": 2, "passes": entries})
    else:
        del entries[1]["summary"]
        _write_json(path, entries)
    status, out, err = _inspect(capsys, dump_copy)
    assert status == 1
    assert len(err) == 1 and err[0].startswith(f"zerograph inspect: {expected}"), err
    assert "graph0_joint:" in out and "graph0_forward:" in out and "graph0_backward:" not in out


def test_removed_diff_is_named_and_pass_diff_does_not_crash(dump_copy, capsys):
    graph, entry = _a_diff(dump_copy)
    os.remove(os.path.join(graph, entry["diff"]))
    status, _, err = _inspect(capsys, dump_copy)
    assert status == 1
    assert err == [f"zerograph inspect: rank0/graph0_joint/{entry['diff']}: missing (listed in the manifest)"]
    status, out, _ = _inspect(capsys, dump_copy, "--pass", entry["pass"])
    assert status == 1 and "(diff missing)" in out


def test_truncated_diff_is_named(dump_copy, capsys):
    graph, entry = _a_diff(dump_copy)
    with open(os.path.join(graph, entry["diff"]), "r+") as f:
        f.truncate(10)
    _, _, err = _inspect(capsys, dump_copy)
    assert len(err) == 1 and f"rank0/graph0_joint/{entry['diff']}: truncated (10 of the " in err[0]


def test_missing_graph_folder_is_named(dump_copy, capsys):
    shutil.rmtree(os.path.join(dump_copy, "rank0", "graph0_backward"))
    status, out, err = _inspect(capsys, dump_copy)
    assert status == 1
    assert err == ["zerograph inspect: rank0/graph0_backward: missing (listed in rank0/manifest.json): "
                   "deleted after the dump"]
    assert "graph0_forward:" in out


def test_partial_dump_names_the_graph_being_written_and_the_missing_rank(dump_copy, capsys):
    """What a rank that died mid-write leaves: a graph still ``writing``, and no folder of a peer."""
    path = os.path.join(dump_copy, "rank0", "manifest.json")
    manifest = _json(path)
    manifest["graphs"]["graph0_backward"]["state"] = "writing"
    _write_json(path, manifest)
    os.remove(os.path.join(dump_copy, "rank0", "graph0_backward", "memory.png"))
    manifest["graphs"]["graph0_backward"]["files"].pop("memory.png")  # never recorded: the rank died first
    _write_json(path, manifest)
    root = _json(os.path.join(dump_copy, "manifest.json"))
    _write_json(os.path.join(dump_copy, "manifest.json"), {**root, "world_size": 2, "ranks": ["rank0", "rank1"]})
    status, _, err = _inspect(capsys, dump_copy)
    assert status == 1 and len(err) == 2, err
    assert err[0].startswith("zerograph inspect: rank1: missing: the dump's world size is 2")
    assert err[1].startswith("zerograph inspect: rank0/graph0_backward: incomplete: the rank stopped while writing")


def test_stale_rank_and_graph_folders_are_named_and_not_shown(dump_copy, capsys):
    shutil.copytree(os.path.join(dump_copy, "rank0"), os.path.join(dump_copy, "rank3"))
    shutil.copytree(os.path.join(dump_copy, "rank0", "graph0_forward"), os.path.join(dump_copy, "rank0", "graph1_forward"))
    status, out, err = _inspect(capsys, dump_copy)
    assert status == 1 and len(err) == 2, err
    assert any("rank3: stale: rank 3 is outside this dump's world size 1" in line for line in err), err
    assert any("rank0/graph1_forward: stale: not in rank0/manifest.json" in line for line in err), err
    assert "graph1_forward:" not in out


def test_rank_of_another_run_is_stale(dump_copy, capsys):
    root = _json(os.path.join(dump_copy, "manifest.json"))
    _write_json(os.path.join(dump_copy, "manifest.json"), {**root, "run": "f" * 32})
    _, _, err = _inspect(capsys, dump_copy)
    assert len(err) == 2 and "rank0: stale: written by another run" in err[0] and "nothing readable" in err[1]


@pytest.mark.parametrize("where", ["manifest.json", "rank0/manifest.json"])
def test_manifest_of_another_schema_or_truncated(dump_copy, capsys, where):
    path = os.path.join(dump_copy, where)
    _write_json(path, {**_json(path), "schema": 99, "zerograph_version": "9.9"})
    status, _, err = _inspect(capsys, dump_copy)
    assert status == 1 and f"{where}: dump schema 99 (zerograph 9.9); this zerograph" in err[0]
    with open(path, "w") as f:
        f.write('{"format": "zerograph-dump", "sch')
    status, _, err = _inspect(capsys, dump_copy)
    assert status == 1 and f"{where}: unreadable, truncated or corrupt (" in err[0]


def test_folder_that_is_not_a_dump(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    status, _, err = _inspect(capsys, str(tmp_path))
    assert status == 1 and err == [f"zerograph inspect: {tmp_path} is not a zerograph dump: no manifest.json and "
                                   "no rank<r>/ folders (a dump is written where ZEROGRAPH_DUMP or Config(dump_dir=) "
                                   "points, once a step has run)"]
    status, _, err = _inspect(capsys, str(tmp_path / "nope"))
    assert status == 1 and err == [f"zerograph inspect: {tmp_path / 'nope'} is not a directory"]


@pytest.mark.slow  # two fresh interpreters that import torch: about 6 CPU s
def test_import_zerograph_loads_no_dump_and_inspect_into_a_closed_pipe_exits_quietly(tiny_dump):
    """One fresh interpreter (an import of torch costs seconds) checks two things: ``import
    zerograph`` imports no ``zerograph.dump*`` module, and ``zerograph inspect DIR | head`` (the
    reader closing the pipe before the output ends) exits without a ``BrokenPipeError``."""
    code = ("import sys, zerograph; "
            "print(sorted(m for m in sys.modules if m.startswith('zerograph.dump')), file=sys.stderr, flush=True); "
            "from zerograph.cli import main; sys.exit(main(['inspect', sys.argv[1]]))")
    proc = subprocess.Popen([sys.executable, "-c", code, tiny_dump], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child writes a byte: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err.splitlines()[0] == "[]", err  # no dump module after ``import zerograph``
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert callable(zerograph.explain) and callable(zerograph.write_summary)  # still there, loaded on use


def _runtime(rank: int = 0, world_size: int = 1):
    """What ``begin_dump`` reads of a runtime, without a process group (a 1-D world: the mesh
    rank is the rank)."""
    topology = types.SimpleNamespace(rank=rank, world_size=world_size, mesh_rank=rank, dp_size=world_size,
                                     fake_world=False)
    return types.SimpleNamespace(topology=topology)


def test_second_dump_clears_only_the_first_runs_files(dump_copy):
    from zerograph.dump.manifest import begin_dump

    rank_dir = os.path.join(dump_copy, "rank0")
    for path in (os.path.join(dump_copy, "notes.txt"), os.path.join(rank_dir, "graph0_forward", "mine.txt")):
        with open(path, "w") as f:  # not the dump's: they stay
            f.write("mine")
    shutil.copytree(rank_dir, os.path.join(dump_copy, "rank2"))  # a rank of an earlier, larger world
    manifest = begin_dump(dump_copy, _runtime())
    assert sorted(os.listdir(dump_copy)) == ["manifest.json", "notes.txt", "rank0", "rank2"]
    assert sorted(os.listdir(rank_dir)) == ["graph0_forward", "manifest.json"]
    assert os.listdir(os.path.join(rank_dir, "graph0_forward")) == ["mine.txt"]
    assert os.listdir(os.path.join(dump_copy, "rank2")) == ["graph0_forward"]  # only the user's file left
    assert manifest.data["graphs"] == {} and manifest.data["files"] == {}
    assert _json(os.path.join(rank_dir, "manifest.json"))["run"] == _json(os.path.join(dump_copy, "manifest.json"))["run"]


def test_dump_into_a_folder_that_is_not_a_dump_is_refused(tmp_path):
    from zerograph.dump.manifest import begin_dump

    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "results.csv").write_text("1,2\n")
    with pytest.raises(DumpError, match=r"refusing to write into .*rank0: the folder is not empty and it has no "
                                         r"manifest\.json"):
        begin_dump(str(tmp_path), _runtime())
    assert os.listdir(tmp_path / "rank0") == ["results.csv"]
    model = zerograph.compile(build("mlp"), stage=0, config=zerograph.Config(dump_dir=str(tmp_path)))
    with pytest.raises(DumpError, match="refusing to write into"):  # at the first forward, as itself
        model(*global_batch("mlp", 0, 4))
    assert os.listdir(tmp_path / "rank0") == ["results.csv"]


def test_every_name_of_the_dump_package_loads_on_use():
    import zerograph.dump as dump

    assert sorted(dump.__all__) == sorted(dump._LAZY)
    for name in dump.__all__:
        assert getattr(dump, name) is getattr(sys.modules[f"zerograph.dump.{dump._LAZY[name]}"], name)
