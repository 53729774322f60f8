"""The ``zerograph`` command: ``zerograph inspect DIR`` reads a dump written by ``zerograph.dump``.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``handler``, a function ``(argparse.Namespace) -> exit status``; ``build_parser`` lists them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence

KIND_ORDER = ("joint", "forward", "backward", "inference")
_GRAPH_DIR = re.compile(r"^graph(\d+)_(\w+)$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


class DumpNotFound(Exception):
    """The path given to ``inspect`` holds no zerograph dump."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerograph`` console script and of ``python -m zerograph``.

    ``argv``: the arguments after the program name (``sys.argv[1:]`` when ``None``). Returns the
    exit status: 0 on success, 1 when the command could not do its job (message on stderr);
    argparse exits with 2 on a usage error.
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerograph", description="ZeRO as compiler passes: tools.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_inspect(subparsers)
    add_bench(subparsers)
    return parser


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    from . import bench  # imported on use: the benchmark pulls in DDP / FSDP2

    parser = subparsers.add_parser("bench", help="compare stages and schedules with DDP and FSDP2",
                                   description=bench.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    parser.set_defaults(handler=bench.run)


# ---------------------------------------------------------------------------------------------
# zerograph inspect


def add_inspect(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="print a dump's summary and what each pass changed",
        description="Print the summary of a zerograph dump (ZEROGRAPH_DUMP=DIR or Config(dump_dir=DIR)) "
                    "and, per graph, the passes with a one-line summary of their changes.")
    parser.add_argument("dir", help="the dump directory, one rank's directory in it, or one graph's")
    parser.add_argument("--pass", dest="pass_name", metavar="NAME",
                        help="print this pass's unified diff(s) instead (e.g. prefetch, or 02_prefetch)")
    parser.add_argument("--rank", type=int, default=None, help="which rank's dump to read (default: the lowest)")
    parser.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    try:
        rank_dir, graphs, note = locate(args.dir, args.rank)
    except DumpNotFound as exc:
        print(f"zerograph inspect: {exc}", file=sys.stderr)
        return 1
    if args.pass_name:
        return print_pass_diffs(graphs, args.pass_name)
    if note:
        print(note)
    summary = os.path.join(rank_dir, "summary.md") if rank_dir else None
    if summary and os.path.exists(summary):
        with open(summary) as f:
            print(f.read())
    print("## Passes")
    for graph in graphs:
        print_pass_list(graph)
    return 0


def locate(path: str, rank: int | None) -> tuple[str | None, list[str], str]:
    """``(rank directory or None, graph directories in order, a note for the reader)``.

    ``path`` may be the dump's root (``rank<r>/`` inside), one rank's directory, or one graph's
    directory (``passes.json`` inside). Raises ``DumpNotFound`` naming what is missing.
    """
    if not os.path.isdir(path):
        raise DumpNotFound(f"{path} is not a directory")
    if os.path.exists(os.path.join(path, "passes.json")):
        return None, [path], ""
    ranks = {int(m.group(1)): os.path.join(path, name) for name in os.listdir(path) if (m := _RANK_DIR.match(name))}
    note = ""
    if ranks:
        chosen = min(ranks) if rank is None else rank
        if chosen not in ranks:
            raise DumpNotFound(f"no rank{chosen}/ in {path}; ranks dumped: {sorted(ranks)}")
        if len(ranks) > 1:
            note = f"ranks dumped: {', '.join(map(str, sorted(ranks)))}; showing rank {chosen} (--rank to pick)\n"
        path = ranks[chosen]
    graphs = graph_dirs(path)
    if not graphs:
        raise DumpNotFound(f"no graph<g>_<kind>/ directories under {path}: was the dump written "
                           "(ZEROGRAPH_DUMP or Config(dump_dir=)) and a step run?")
    return path, graphs, note


def graph_dirs(rank_dir: str) -> list[str]:
    """``graph<g>_<kind>`` directories of one rank, by graph then joint, forward, backward, inference."""
    found = []
    for name in os.listdir(rank_dir):
        match = _GRAPH_DIR.match(name)
        if match and match.group(2) in KIND_ORDER:
            found.append((int(match.group(1)), KIND_ORDER.index(match.group(2)), os.path.join(rank_dir, name)))
    return [path for *_, path in sorted(found)]


def read_passes(graph_dir: str) -> list[dict]:
    with open(os.path.join(graph_dir, "passes.json")) as f:
        return json.load(f)


def print_pass_list(graph_dir: str) -> None:
    """One line per pass: number, name, what changed; then the graph's other files."""
    print(f"\n{os.path.basename(graph_dir)}:")
    for entry in read_passes(graph_dir):
        print(f"  {entry['number']:02d} {entry['pass']:<24} {entry['summary']}")
    extras = [name for name in ("graph.dot", "graph.svg", "memory.png", "memory.json", "schedule.json")
              if os.path.exists(os.path.join(graph_dir, name))]
    if extras:
        print(f"     files: {', '.join(extras)}")


def print_pass_diffs(graphs: Sequence[str], name: str) -> int:
    """Print the diff of pass ``name`` (``prefetch`` or ``04_prefetch``) in every graph that ran it."""
    shown = 0
    known: list[str] = []
    for graph in graphs:
        for entry in read_passes(graph):
            label = f"{entry['number']:02d}_{entry['pass']}"
            known.append(entry["pass"])
            if name not in (entry["pass"], label) or entry["number"] == 0:
                continue
            shown += 1
            where = os.path.join(os.path.basename(graph), entry.get("diff", label))
            print(f"==> {where}: {entry['summary']}")
            if entry.get("diff"):
                with open(os.path.join(graph, entry["diff"])) as f:
                    print(f.read() or "(no textual change)")
    if not shown:
        passes = ", ".join(dict.fromkeys(p for p in known if p != "input"))
        print(f"zerograph inspect: no pass {name!r} in this dump; passes: {passes}", file=sys.stderr)
        return 1
    return 0
