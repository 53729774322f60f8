"""The code's shape for whoever carries it on (issue 41): no import cycle among zerograph's modules,
no module over 500 lines, no function over 80 lines of code.

Read from the source with ``ast``, in this process; nothing is imported. The modules and their
imports are tests/test_layers.py's (``module_files``: ``passes/`` is ``zerograph.passes``;
``import_graph``: imports under ``if TYPE_CHECKING:`` left out, each edge marked ``top`` when the
import runs at module level). test_layers' own cycle check counts imports inside functions too;
the one here is the rule of issue 41: what importing a module runs.
"""
from __future__ import annotations

import ast

import networkx as nx

from tests.test_layers import ROOT, import_graph, module_files

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


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
