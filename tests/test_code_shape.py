"""The code's shape for whoever carries it on: no import cycle among zerograph's modules, no
module over 500 lines, no module docstring over 30 lines, no function over 80 lines of code, no
module global rebound at run time (the trace's flags are fields of ``shard.trace_state.TRACE``),
and no comment or docstring naming a tracker issue, a date or a measured figure (zerograph/,
passes/, tests/, examples/).

Read from the source with ``ast``, in this process; nothing is imported. The modules and their
imports are tests/test_layers.py's (``module_files``: ``passes/`` is ``zerograph.passes``;
``import_graph``: imports under ``if TYPE_CHECKING:`` left out, each edge marked ``top`` when the
import runs at module level). test_layers' own cycle check counts imports inside functions too;
the one here is about what importing a module runs.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator

import networkx as nx

from tests.test_layers import ROOT, import_graph, module_files

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_MODULE_DOCSTRING_LINES = 30


def module_level_graph() -> nx.DiGraph:
    """Module -> the zerograph modules it imports at module level (not inside a function)."""
    graph, _ = import_graph()
    return graph.edge_subgraph([(a, b) for a, b, top in graph.edges(data="top") if top]).copy()


def test_no_import_cycle() -> None:
    """A cycle makes import order matter and hides which module owns what."""
    cycles = sorted(" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(module_level_graph()))
    assert not cycles, "import cycles among zerograph modules (module-level imports):\n  " + "\n  ".join(cycles)


def test_no_module_over_500_lines() -> None:
    over = sorted(f"{path.relative_to(ROOT)} ({n} lines)" for path in module_files().values()
                  if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES)
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(over)


def docstring_lines(path) -> int:
    """Source lines of the module's docstring (0 without one), its quotes included."""
    body = ast.parse(path.read_text(), str(path)).body
    doc = body[0] if body else None
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
        return doc.end_lineno - doc.lineno + 1
    return 0


def test_no_module_docstring_over_30_lines() -> None:
    """A module's docstring says what the module is for, its contract, its layer and the source of
    the idea; the story (why, the choices made, worked examples) is docs/design.md's or a topical
    doc's, and an explanation two modules share is one ``[Note: title]`` block the other names."""
    over = sorted(f"{path.relative_to(ROOT)} ({n} lines)" for path in module_files().values()
                  if (n := docstring_lines(path)) > MAX_MODULE_DOCSTRING_LINES)
    assert not over, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines:\n  " + "\n  ".join(over)


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, less its docstring (decorators not counted).

    The docstring is left out: a public function's is its API reference (shapes, units, every
    error raised, the source of the idea), and ``compile`` documents eleven refusals; a long
    reference is not a long function."""
    n = node.end_lineno - node.lineno + 1
    body = node.body[0] if node.body else None
    if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str):
        n -= body.end_lineno - body.lineno + 1
    return n


def test_no_function_over_80_lines() -> None:
    over = []
    for path in module_files().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := code_lines(node)) > MAX_FUNCTION_LINES:
                over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (docstrings aside):\n  " + "\n  ".join(sorted(over))


# module globals a function may rebind (``global``): latches that install a process-wide hook once
GLOBAL_LATCHES = {"zerograph.api": {"_GUARD_INSTALLED"}, "zerograph.shard.parameter_watch": {"_HOOKS_INSTALLED"}}


def test_no_module_global_is_rebound() -> None:
    """A flag that says where a forward or trace is (gathering, tracing a unit, substituted
    parameters, every unit inline, a gradient mode, init_weights' reads) is a field of
    ``shard.trace_state.TRACE``, set for a scope with ``TRACE.scope``: one object that every module
    reads, instead of globals of one module that others read and set through setters."""
    rebound = sorted(f"{module}:{node.lineno} {name}" for module, path in module_files().items()
                     for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)
                     for name in node.names if name not in GLOBAL_LATCHES.get(module, set()))
    assert not rebound, "module globals rebound at run time (make them TRACE's fields):\n  " + "\n  ".join(rebound)


# what a comment or docstring must not name: a tracker issue (the word issue or issues, then a
# number, with or without "#") or an ISO date; history belongs in the commits, the reason in the
# comment
HISTORY = re.compile(r"\bissues?\s+#?\d+|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)

# a measured figure, by a heuristic that catches the clear spellings only: the word "measured" with
# a number right after it (a colon or "at most", "about" and the like between), or two quantities
# with a unit of time, bytes or percent set against each other ("against", "vs", "versus"). A
# setting ("a timeout of N s") or a unit in an API docstring is not caught; figures belong in
# docs/benchmarks.md with their command, commit and machine
_QUANTITY = r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s*(?:s|ms|us|µs|min|minutes|seconds|[KMG]i?B|%)"
MEASURED = re.compile(rf"\bmeasured\b:?\s+(?:(?:at most|at least|about|around|up to|~)\s*)?\d"
                      rf"|{_QUANTITY}\s+(?:against|vs\.?|versus)\s+\d", re.IGNORECASE)


def comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every comment and every string standing as a statement (module, class,
    function and attribute docstrings) in ``source``; string literals inside code are not read."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def matches(source: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """``(line, matched text)`` for each match of ``pattern`` in a comment or docstring of ``source``."""
    return [(line + text.count("\n", 0, match.start()), match.group(0))
            for line, text in comments_and_docstrings(source) for match in pattern.finditer(text)]


def matches_in_tree(pattern: re.Pattern[str]) -> list[str]:
    """``path:line: 'match'`` over the package (``passes/`` included), the tests and the examples."""
    paths = [*module_files().values(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py"))]
    return [f"{path.relative_to(ROOT)}:{line}: {text!r}" for path in paths for line, text in matches(path.read_text(), pattern)]


def test_history_detector() -> None:
    """The detector sees issue numbers and dates in comments and docstrings, and nothing in code."""
    source = ('"""Module (issue 42)."""\n'
              'x = "issue 7 in a message is code"  # the rule before Issue #16\n'
              'def f():\n'
              '    """Since 2026-05-01; 16 bytes per parameter, issues in general."""\n')
    assert matches(source, HISTORY) == [(2, "Issue #16"), (1, "issue 42"), (4, "2026-05-01")]


def test_no_issue_or_date_in_comments() -> None:
    """Comments and docstrings state intent and reasons; which issue asked for a change and when it
    was made are the history's (git log), and read as noise once the tracker moves on. A test says
    what it checks and why, not which issue asked for it."""
    found = matches_in_tree(HISTORY)
    assert not found, "comments or docstrings naming a tracker issue or a date:\n  " + "\n  ".join(found)


def test_measured_figure_detector() -> None:
    """The heuristic sees a figure after "measured" and two timings or sizes set against each
    other, in comments and docstrings; settings, units and the word alone pass."""
    source = ('"""Takes 2.5 s against 3 s on two cores."""\n'
              'x = "measured: 4 s in a message is code"  # measured: at most 0.3%\n'
              'TIMEOUT_S = 3  # a timeout of 3 s; 16 bytes per parameter; what is measured: the bytes\n'
              'def f():\n'
              '    """The measured profile, in seconds; 1.2 ms vs 3.4 ms when profiled."""\n')
    assert matches(source, MEASURED) == [(2, "measured: at most 0"), (1, "2.5 s against 3"), (5, "1.2 ms vs 3")]


def test_no_measured_figure_in_comments() -> None:
    """A figure in a comment goes stale the day the code or the machine changes, and nothing
    re-measures it; the comment says why, docs/benchmarks.md keeps the figure with its command,
    commit and machine. A heuristic (``MEASURED``): it catches the clear spellings only."""
    found = matches_in_tree(MEASURED)
    assert not found, "comments or docstrings quoting a measured figure:\n  " + "\n  ".join(found)
