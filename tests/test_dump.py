"""The dump (``zerograph.dump``), ``zerograph inspect`` and ``explain`` on the tiny GPT at stage 3.

One spawned world-size-2 run serves the tests that need a dump: first a step of the small MLP with
dumping off (no dump code may run, nothing may be written), then a step of the tiny GPT with
``Config(dump_dir=...)``.
"""
from __future__ import annotations

import ast
import glob
import json
import os
import re

import pytest
import torch

import zerograph
from zerograph import cli
from zerograph.dump import MEMORY_CATEGORIES, describe_changes, write_rendering
from zerograph.runtime.state import config_of, runtime_of_model
from zerograph.shard.sharding import ROOT_UNIT, Unit

from .distributed import spawn
from .models import build, global_batch, rank_slice

# a statement of the dumped Python that runs an all-gather / the unshard marker
ALL_GATHER_LINE = re.compile(r'^\s+\w+(: "[^"]*")? = torch\.ops\._c10d_functional\.all_gather_into_tensor(_out)?\.default\(',
                             re.M)
UNSHARD_LINE = re.compile(r"= torch\.ops\.zerograph\.unshard\.default\(")


def _one_step(model: torch.nn.Module, name: str, rank: int, world_size: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*rank_slice(global_batch(name, 0, 4), rank, world_size)).backward()
    opt.step()
    return opt


def dump_worker(rank: int, world_size: int, dump_dir: str, off_dir: str) -> dict:
    import zerograph.dump as dump

    os.environ.pop("ZEROGRAPH_DUMP", None)
    os.chdir(off_dir)  # a stray relative path would land here

    def refuse(*args, **kwargs):
        raise AssertionError("dump code ran with dumping off")

    real = dump.GraphDump, dump.finish_graph, dump.calibrate_once, dump.begin_dump
    dump.GraphDump = dump.finish_graph = dump.calibrate_once = dump.begin_dump = refuse
    off = zerograph.compile(build("mlp"), stage=3)  # the small model: this part only checks that nothing runs
    _one_step(off, "mlp", rank, world_size)
    dump.GraphDump, dump.finish_graph, dump.calibrate_once, dump.begin_dump = real
    off_files = os.listdir(off_dir)

    model = zerograph.compile(build("gpt"), stage=3, config=zerograph.Config(dump_dir=dump_dir))
    opt = _one_step(model, "gpt", rank, world_size)
    stats = zerograph.stats(model, opt)  # before zero_grad frees the gradient shards
    text = dump.explain(model, opt)
    batch = rank_slice(global_batch("gpt", 1, 4), rank, world_size)
    zerograph.measure(lambda: model(*batch).backward(), warmup=0, model=model)  # writes measured_schedule.json
    rt = runtime_of_model(model)
    return {
        "off_files": off_files,
        "off_dump_dir": config_of(off).resolved_dump_dir(),
        "stats": stats,
        "explain": text,
        "shard_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters()),
        "liveness_gathered_peak": {k: t.peak(("gather",)) for k, t in rt.accounting.graph_memory[0].items()},
        "units": [u.name for u in rt.units],
    }


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump")
    off_dir = tmp_path_factory.mktemp("off")
    results = spawn(dump_worker, 2, str(root), str(off_dir), timeout_s=240)
    return str(root), results


def _graph_dirs(root: str, rank: int = 0) -> dict[str, str]:
    return {os.path.basename(d): d for d in glob.glob(os.path.join(root, f"rank{rank}", "graph*_*"))}


def _load(directory: str, name: str):
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def _passes(graph_dir: str) -> list[dict]:
    return _load(graph_dir, "passes.json")


def _final_python(graph_dir: str) -> str:
    last = [e for e in _passes(graph_dir) if e.get("file")][-1]["file"]
    with open(os.path.join(graph_dir, last)) as f:
        return f.read()


@pytest.mark.distributed
def test_dumping_off_runs_no_dump_code_and_writes_nothing(dumped):
    _, results = dumped
    for r in results:
        assert r["off_dump_dir"] is None
        assert r["off_files"] == []


@pytest.mark.distributed
def test_every_file_is_written_and_parses(dumped):
    root, results = dumped
    manifest = _load(root, "manifest.json")  # one run: the ranks agreed on its id
    assert manifest["world_size"] == len(results) and manifest["ranks"] == [f"rank{r}" for r in range(len(results))]
    for rank in range(len(results)):
        assert _load(os.path.join(root, f"rank{rank}"), "manifest.json")["run"] == manifest["run"]
    for rank in range(len(results)):
        graphs = _graph_dirs(root, rank)
        assert {"graph0_joint", "graph0_partitioned", "graph0_forward", "graph0_backward"} <= set(graphs)
        for name in ("summary.md", "summary.json", "schedule.json"):
            assert os.path.isfile(os.path.join(root, f"rank{rank}", name)), name
        for kind, graph in graphs.items():
            entries = _passes(graph)
            assert entries[0]["file"] == "00_input.py"
            for entry in entries[1:]:
                if entry.get("modified"):
                    assert os.path.isfile(os.path.join(graph, entry["file"]))
                    assert os.path.isfile(os.path.join(graph, entry["diff"]))
            if kind.endswith("partitioned"):  # a pass log only: the pair goes on into the forward and backward
                assert set(os.listdir(graph)) - {"passes.json"} == {e["file"] for e in entries if e.get("file")} | {
                    e["diff"] for e in entries if e.get("diff")}
                continue
            wanted = ["graph.dot", "memory.json", "memory.png"] + ([] if kind.endswith("joint") else ["schedule.json"])
            for name in wanted:
                assert os.path.isfile(os.path.join(graph, name)), f"{kind}/{name}"
            with open(os.path.join(graph, "memory.png"), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        # the passes that insert collectives changed their graphs and left a diff
        assert any(e.get("diff") for e in _passes(graphs["graph0_joint"]))
        assert any(e.get("diff") for e in _passes(graphs["graph0_backward"]))
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        with open(path) as f:
            ast.parse(f.read(), filename=path)
    for path in glob.glob(os.path.join(root, "**", "*.json"), recursive=True):
        with open(path) as f:
            json.load(f)


@pytest.mark.distributed
def test_inserted_nodes_are_commented_and_pass_changes_counted(dumped):
    root, results = dumped
    graphs = _graph_dirs(root)
    forward = _final_python(graphs["graph0_forward"])
    gathers = len(ALL_GATHER_LINE.findall(forward))
    assert gathers == len(results[0]["units"])  # stage 3: one all-gather per unit
    assert len(re.findall(r"# zerograph: all_gather of unit \d+", forward)) == gathers
    assert len(re.findall(r"# zerograph: wait for all_gather_into_tensor", forward)) == gathers
    for index in range(len(results[0]["units"])):  # every unit's gathered parameters die in forward
        assert f"# zerograph: release of unit {index} " in forward

    entries = _passes(graphs["graph0_joint"])
    files = [e for e in entries if e.get("file")]
    insert = next(e for e in entries if e["pass"] == "insert_allgather")
    before = files[files.index(insert) - 1]
    with open(os.path.join(graphs["graph0_joint"], before["file"])) as f:
        markers = len(UNSHARD_LINE.findall(f.read()))
    with open(os.path.join(graphs["graph0_joint"], insert["file"])) as f:
        inserted = len(ALL_GATHER_LINE.findall(f.read()))
    assert markers > 0 and inserted == len(results[0]["units"])
    assert insert["changes"]["unshard"] == -markers
    assert insert["changes"]["all_gather_into_tensor"] == inserted
    assert insert["changes"]["wait_tensor"] == inserted
    assert f"+{inserted} all_gather_into_tensor" in insert["summary"]
    assert f"-{markers} unshard" in insert["summary"]
    with open(os.path.join(graphs["graph0_joint"], insert["diff"])) as f:
        diff = f.read().splitlines()
    assert sum(1 for line in diff if line.startswith("-") and UNSHARD_LINE.search(line)) == markers
    assert sum(1 for line in diff if line.startswith("+") and ALL_GATHER_LINE.match(line[1:])) == inserted


def test_describe_changes_lists_zerograph_ops_first():
    changes, line = describe_changes({"unshard": 3, "view": 5}, {"view": 9, "all_gather_into_tensor": 1,
                                                                  "wait_tensor": 1})
    assert changes == {"unshard": -3, "all_gather_into_tensor": 1, "wait_tensor": 1, "view": 4}
    assert line == "nodes 8 -> 11 (+3): -3 unshard, +1 all_gather_into_tensor, +1 wait_tensor, +4 view"
    assert describe_changes({"add": 2}, {"add": 2}, moved=2)[1] == "nodes 2 -> 2 (+0): 2 nodes moved"


def test_svg_only_where_graphviz_dot_exists(tmp_path, monkeypatch):
    import torch.fx as fx

    graph = fx.symbolic_trace(lambda x: (x + 1).relu()).graph
    units = [Unit(0, ROOT_UNIT, ())]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    write_rendering(str(tmp_path), graph, units)
    assert os.path.isfile(tmp_path / "graph.dot") and not os.path.exists(tmp_path / "graph.svg")

    bin_dir = tmp_path / "bin"  # a stand-in for Graphviz: `dot -Tsvg IN -o OUT` copies IN to OUT
    bin_dir.mkdir()
    (bin_dir / "dot").write_text('#!/bin/sh\ncp "$2" "$4"\n')
    (bin_dir / "dot").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/bin:/usr/bin")
    write_rendering(str(tmp_path), graph, units)
    assert (tmp_path / "graph.svg").read_text() == (tmp_path / "graph.dot").read_text()
    assert len(graph.nodes) == (tmp_path / "graph.dot").read_text().count("label=")


@pytest.mark.distributed
def test_memory_timeline_matches_liveness_and_shards(dumped):
    root, results = dumped
    for rank, r in enumerate(results):
        graphs = _graph_dirs(root, rank)
        for kind in ("forward", "backward"):
            memory = _load(graphs[f"graph0_{kind}"], "memory.json")
            live = memory["live_bytes"]
            assert set(live) == set(MEMORY_CATEGORIES)
            n = len(memory["nodes"])
            assert all(len(series) == n for series in live.values())
            assert max(live["gathered parameters"]) == r["liveness_gathered_peak"][kind]
            assert set(live["parameters"]) == {r["shard_bytes"]}  # the model holds its shards throughout
            for i in range(n):
                assert memory["total"][i] == sum(live[c][i] for c in MEMORY_CATEGORIES)
            assert min(live["activations"]) >= 0
        assert max(_load(graphs["graph0_backward"], "memory.json")["live_bytes"]["gradients"]) > 0


@pytest.mark.distributed
def test_dot_parses_with_unit_clusters_and_trace_has_both_tracks(dumped):
    import pydot

    root, results = dumped
    graph = _graph_dirs(root)["graph0_forward"]
    (dot,) = pydot.graph_from_dot_file(os.path.join(graph, "graph.dot"))
    clusters = {s.get_name().strip('"') for s in dot.get_subgraphs()}
    assert clusters == {f"cluster_unit{i}" for i in range(len(results[0]["units"]))}
    collectives = len(_load(graph, "memory.json")["collectives"])
    filled = [node for sub in dot.get_subgraphs() for node in sub.get_nodes()
              if "all_gather_into_tensor" in (node.get("label") or "") and node.get("fillcolor")]
    assert collectives == len(results[0]["units"]) and len(filled) >= collectives
    assert len(dot.get_edges()) > 0

    step_collectives = collectives + len(_load(_graph_dirs(root)["graph0_backward"], "memory.json")["collectives"])
    rank_dir = os.path.join(root, "rank0")
    for path, name, expected in ((graph, "schedule.json", collectives), (rank_dir, "schedule.json", step_collectives),
                                 (rank_dir, "measured_schedule.json", step_collectives)):
        by_track = _trace_tracks(_load(path, name)["traceEvents"])
        assert by_track.get("compute") and by_track.get("comm"), (path, name)
        assert len(by_track["comm"]) == expected, (path, name)  # one interval per collective


def _trace_tracks(trace: list[dict]) -> dict[str, list[dict]]:
    """Chrome trace "X" events by the name of their thread (track)."""
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    by_track: dict[str, list[dict]] = {}
    for e in trace:
        if e["ph"] == "X":
            by_track.setdefault(names.get(e["tid"]), []).append(e)
    return by_track


@pytest.mark.distributed
def test_summary_totals_equal_stats(dumped):
    root, results = dumped
    for rank, r in enumerate(results):
        stats = r["stats"]
        with open(os.path.join(root, f"rank{rank}", "summary.md")) as f:
            markdown = f.read()
        assert markdown == r["explain"]
        with open(os.path.join(root, f"rank{rank}", "summary.json")) as f:
            report = json.load(f)
        totals = report["totals"]
        assert totals["num_params"] == stats.num_params
        assert totals["comm_elements"] == stats.comm_elements
        assert totals["comm_bytes"] == stats.comm_bytes
        assert totals["resident_bytes"] == stats.resident_bytes
        assert totals["formula_bytes"] == pytest.approx(stats.formula_bytes)
        assert totals["comm_elements_total"] == sum(stats.comm_elements.values())
        assert totals["paper_comm_psi"] == 3
        assert sum(u["elements"] for u in report["units"]) == stats.num_params
        assert sum(u["shard_bytes"] for u in report["units"]) == r["shard_bytes"]
        for key, held in stats.resident_bytes.items():
            assert f"| {key} held at most (sec. 5) | {held:,} bytes" in markdown
        assert f"{sum(stats.comm_elements.values()):,} elements" in markdown
        for unit in report["units"]:  # stage 3: gathered in forward and backward, reduced in backward
            assert {e["kind"] for e in unit["gathered"]} == {"forward", "backward"}
            assert [e["kind"] for e in unit["reduced"]] == ["backward"]
            assert all(e["position"] is not None for e in unit["released"])


@pytest.mark.distributed
def test_cli_inspect_prints_passes_and_diffs(dumped, capsys, tmp_path):
    root, _ = dumped
    assert cli.main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert "# zerograph summary: rank 0 of 2, stage 3" in out
    for name, graph in _graph_dirs(root).items():
        assert f"{name}:" in out
        for entry in _passes(graph):
            assert f"{entry['number']:02d} {entry['pass']:<24} {entry['summary']}" in out

    assert cli.main(["inspect", root, "--rank", "1", "--pass", "insert_allgather"]) == 0
    out = capsys.readouterr().out
    insert = next(e for e in _passes(_graph_dirs(root, 1)["graph0_joint"]) if e["pass"] == "insert_allgather")
    lines = out.splitlines()
    assert f"+++ {insert['file']}" in lines
    assert any(line.startswith("-") and UNSHARD_LINE.search(line) for line in lines)
    assert any(line.startswith("+") and ALL_GATHER_LINE.match(line[1:]) for line in lines)

    assert cli.main(["inspect", root, "--pass", "no_such_pass"]) == 1
    assert "no pass 'no_such_pass'" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path)]) == 1
