"""The ``zerograph`` command: ``zerograph inspect DIR`` reads a dump written by ``zerograph.dump``.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its parser and sets
``handler``, a function ``(argparse.Namespace) -> exit status``; ``build_parser`` lists them.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerograph`` console script and of ``python -m zerograph``.

    ``argv``: the arguments after the program name (``sys.argv[1:]`` when ``None``). Returns the
    exit status: 0 on success, 1 when the command could not do its job (message on stderr);
    argparse exits with 2 on a usage error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.invocation = shlex.join(["zerograph", *argv])  # what a report records as its command
    try:
        return args.handler(args)
    except BrokenPipeError:  # the reader went away (``zerograph inspect DIR | head``): stop quietly
        # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail too
        # (the recipe of the ``signal`` module's documentation, "Note on SIGPIPE")
        try:
            stdout = sys.stdout.fileno()
        except (AttributeError, ValueError, OSError):  # not a file (a test's capture): nothing to redirect
            return 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerograph", description="ZeRO as compiler passes: tools.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_inspect(subparsers)
    add_bench(subparsers)
    add_memory(subparsers)
    return parser


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    from . import bench  # imported on use: the benchmark pulls in DDP / FSDP2

    _add_tool(subparsers, "bench", "compare stages and schedules with DDP and FSDP2", bench)


def add_memory(subparsers: argparse._SubParsersAction) -> None:
    from .bench import side_by_side_cli  # imported on use, as the bench

    _add_tool(subparsers, "memory", "peak memory of one rank: zerograph vs FSDP2 vs FSDP2 + compile", side_by_side_cli)


def _add_tool(subparsers: argparse._SubParsersAction, name: str, help_text: str, module) -> None:
    """Subcommand ``name`` served by ``module``: its docstring, ``add_arguments(parser)`` and ``run(args)``."""
    parser = subparsers.add_parser(name, help=help_text, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)


# ---------------------------------------------------------------------------------------------
# zerograph inspect


def add_inspect(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="print a dump's summary and what each pass changed",
        description="Print the summary of a zerograph dump (ZEROGRAPH_DUMP=DIR or Config(dump_dir=DIR)) "
                    "and, per graph, the passes with a one-line summary of their changes. Problems (files "
                    "missing, truncated, of another schema or left from another run) are named one per line "
                    "on stderr, and the exit status is then 1.")
    parser.add_argument("dir", help="the dump directory, one rank's directory in it, or one graph's")
    parser.add_argument("--pass", dest="pass_name", metavar="NAME",
                        help="print this pass's unified diff(s) instead (e.g. prefetch, or 02_prefetch)")
    parser.add_argument("--rank", type=int, default=None, help="which rank's dump to read (default: the lowest)")
    parser.add_argument("--html", nargs="?", const="", default=None, metavar="OUT",
                        help="write a static web page of the whole dump instead (every rank; default OUT: "
                             "DIR/index.html) with each pass's highlighted diff, graphs, memory plots, schedules")
    parser.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    """``zerograph inspect``: 0 when the dump is whole, 1 when it is not a dump or has problems
    (each named on one line of stderr; what can be read is still printed)."""
    from .dump.reader import read_dump  # light: no torch, no plotting
    from .errors import DumpError

    try:
        view = read_dump(args.dir)
    except DumpError as exc:
        print(f"zerograph inspect: {exc}", file=sys.stderr)
        return 1
    for problem in view.problems:
        print(f"zerograph inspect: {problem}", file=sys.stderr)
    status = 1 if view.problems else 0
    if args.html is not None:
        return write_page(args.dir, args.html or None) or status
    if not view.ranks:
        print(f"zerograph inspect: nothing readable in {args.dir}", file=sys.stderr)
        return 1
    chosen = min(view.ranks) if args.rank is None else args.rank
    if chosen not in view.ranks:
        print(f"zerograph inspect: no readable rank{chosen}/ in {args.dir}; ranks: {sorted(view.ranks)}", file=sys.stderr)
        return 1
    rank = view.ranks[chosen]
    graphs = [g for g in rank.graphs if g.passes is not None]
    if not rank.graphs:
        print(f"zerograph inspect: no graph<g>_<kind>/ folders under {rank.path}: was a step run with the dump on "
              "(ZEROGRAPH_DUMP or Config(dump_dir=))?", file=sys.stderr)
        return 1
    if args.pass_name:
        return print_pass_diffs(graphs, args.pass_name) or status
    for note in view.notes:
        print(note)
    if len(view.ranks) > 1:
        print(f"ranks dumped: {', '.join(map(str, sorted(view.ranks)))}; showing rank {chosen} (--rank to pick)\n")
    summary = os.path.join(rank.path, "summary.md")
    if rank.rank is not None and os.path.exists(summary):
        with open(summary, errors="replace") as f:
            print(f.read())
    print("## Passes")
    for graph in graphs:
        print_pass_list(graph)
    return status


def write_page(path: str, out: str | None) -> int:
    """``inspect --html``: write the page (``zerograph.dump.html``) and print where it is."""
    from .dump.html import write_html

    try:
        page, _ = write_html(path, out)
    except OSError as exc:
        print(f"zerograph inspect: cannot write the page: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {page}")
    return 0


def print_pass_list(graph) -> None:
    """One line per pass: number, name, what changed; then the graph's other files."""
    print(f"\n{graph.name}:")
    for entry in graph.passes:
        print(f"  {entry['number']:02d} {entry['pass']:<24} {entry['summary']}")
    extras = [name for name in ("graph.dot", "graph.svg", "memory.png", "memory.json", "schedule.json")
              if os.path.exists(os.path.join(graph.path, name))]
    if extras:
        print(f"     files: {', '.join(extras)}")


def print_pass_diffs(graphs: Sequence, name: str) -> int:
    """Print the diff of pass ``name`` (``prefetch`` or ``04_prefetch``) in every graph that ran it."""
    shown = 0
    known: list[str] = []
    for graph in graphs:
        for entry in graph.passes:
            label = f"{entry['number']:02d}_{entry['pass']}"
            known.append(entry["pass"])
            if name not in (entry["pass"], label) or entry["number"] == 0:
                continue
            shown += 1
            print(f"==> {os.path.join(graph.name, entry.get('diff', label))}: {entry['summary']}")
            diff = os.path.join(graph.path, entry["diff"]) if entry.get("diff") else None
            if diff and os.path.exists(diff):
                with open(diff, errors="replace") as f:
                    print(f.read() or "(no textual change)")
            elif diff:
                print("(diff missing)")
    if not shown:
        passes = ", ".join(dict.fromkeys(p for p in known if p != "input"))
        print(f"zerograph inspect: no pass {name!r} in this dump; passes: {passes}", file=sys.stderr)
        return 1
    return 0
