"""The package's import structure: one-way layers, no cycles, every module importable first.

``LAYERS`` is the architecture in code (the layout in docs/design.md says the same in words): a
module may import, at module level, only from its own layer or the layers before it, and so may
the imports kept for type annotations (under ``if TYPE_CHECKING:``): a lower package that names a
higher one's type depends on it all the same, and no two packages import each other, types
included. Imports inside functions (kept for optional, heavy parts such as the dump) may point
anywhere but must not close a cycle of modules. Inside one package, not even the type imports may
close one: two modules that name each other's types are one concern split in two, or lack a lower
module both could import. ``test_every_module_imports_first``
imports each module as the first zerograph import of a fresh process with the package's
``__init__.py`` left unrun (tests/import_first.py), which is what fails with "partially
initialized module" when a cycle hides behind the import order of ``zerograph/__init__.py``.
"""
from __future__ import annotations

import ast
import concurrent.futures
import fnmatch
import multiprocessing
import pathlib
import re
from typing import NamedTuple

import networkx as nx
import pytest

from tests import forkserver
from tests.import_first import import_first

ROOT = pathlib.Path(__file__).resolve().parent.parent

# bottom to top, in the pipeline's order where imports allow it: each package is a stage or a
# concern; the public face (api, config, policies, errors, checkpoint, optim, cli) sits at the top
# of zerograph/ beside them. A pattern ending in * covers a package and its modules
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["zerograph.errors", "zerograph.policies", "zerograph.models*"]),
    ("kernels", ["zerograph.kernels*", "zerograph.optim"]),
    ("graph", ["zerograph.graph*"]),
    ("shard", ["zerograph.shard*"]),
    ("runtime", ["zerograph.runtime*"]),
    ("io", ["zerograph.io*", "zerograph.checkpoint"]),
    ("passes", ["zerograph.passes*"]),
    ("config", ["zerograph.config"]),
    ("templates", ["zerograph.templates*"]),
    ("capture", ["zerograph.capture*"]),
    ("planning", ["zerograph.planning*"]),
    ("api", ["zerograph.api"]),
    ("report", ["zerograph.report*", "zerograph.dump*"]),
    ("tools", ["zerograph.bench*", "zerograph.cli", "zerograph.__main__"]),
]


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the installed layout (``passes/`` is
    ``zerograph.passes``)."""
    found = {}
    for base, package in ((ROOT / "zerograph", "zerograph"), (ROOT / "passes", "zerograph.passes")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatch(module, p) or module == p.rstrip("*").rstrip(".") for p in patterns):
            return index
    raise AssertionError(f"module {module} is in no layer: add it to LAYERS in tests/test_layers.py "
                         f"(and to the layout in docs/design.md)")


class Import(NamedTuple):
    """One import of a zerograph module: ``top`` where it runs at module level, ``typing`` where it
    sits under ``if TYPE_CHECKING:`` (runs no code, never ``top``)."""

    target: str
    top: bool
    typing: bool


def imports_of(module: str, path: pathlib.Path, known: set[str], typing: bool = False) -> list[Import]:
    """Every import of a zerograph module in ``path``; with ``typing``, the imports under
    ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    # `if TYPE_CHECKING:` blocks import nothing at run time
    type_checking = {id(n) for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                     for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_checking and not typing:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module and target != "zerograph":
                found.append(Import(target, id(node) in top_level, id(node) in type_checking))
    return found


def import_graph(typing: bool = False) -> tuple[nx.DiGraph, dict[str, pathlib.Path]]:
    """Module -> each zerograph module it imports, the edge marked ``top`` where an import runs at
    module level; with ``typing``, the imports kept for type annotations are edges too, marked
    ``typing``."""
    files = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        if module == "zerograph":
            continue  # the package's face imports everything by design
        for target, top, for_types in imports_of(module, path, set(files), typing):
            if graph.has_edge(module, target):
                top = top or graph.edges[module, target]["top"]
                for_types = for_types or graph.edges[module, target]["typing"]
            graph.add_edge(module, target, top=top, typing=for_types)
    return graph, files


def test_every_module_is_in_a_layer() -> None:
    for module in module_files():
        if module != "zerograph":
            layer_of(module)


def test_module_level_imports_point_down_or_sideways() -> None:
    """Type-annotation imports included."""
    graph, _ = import_graph(typing=True)
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              + (" for types" if not edge["top"] else "")
              for a, b, edge in graph.edges(data=True) if (edge["top"] or edge["typing"]) and layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def package_of(module: str) -> str:
    """``zerograph.runtime.state`` -> ``zerograph.runtime``; a module of the top level is its own."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_between_packages() -> None:
    """Packages import each other one way, counting module-level and type-annotation imports (an
    import inside a function, such as one of the dump, is a module cycle's concern only)."""
    graph, _ = import_graph(typing=True)
    packages = nx.DiGraph((package_of(a), package_of(b)) for a, b, edge in graph.edges(data=True)
                          if (edge["top"] or edge["typing"]) and package_of(a) != package_of(b))
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(packages))
    assert not cycles, "import cycles between packages (TYPE_CHECKING imports included):\n  " + "\n  ".join(cycles)


def test_no_import_cycles() -> None:
    graph, _ = import_graph(typing=True)
    # a subpackage's modules import their own package's __init__ and vice versa (re-exports);
    # that is not a layering cycle, so package -> own submodule edges are left out
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_no_import_cycles_inside_a_package() -> None:
    """The modules of one package import each other one way, type annotations included."""
    graph, _ = import_graph(typing=True)
    same_package = [(a, b) for a, b in graph.edges if a.rpartition(".")[0] == b.rpartition(".")[0]]
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(graph.edge_subgraph(same_package)))
    assert not cycles, "import cycles inside a package (TYPE_CHECKING imports included):\n  " + "\n  ".join(cycles)


def design_layout() -> dict[str, str]:
    """What the layout block of docs/design.md (the first fenced block under "## Layout") names:
    dotted module or package name, or a data file's path under ``zerograph/``, -> its row's layer.

    A row starts at the left margin with its layer's name; indented lines continue it. Segments
    split by ``;`` are ``pkg/: a, b`` (modules of ``zerograph.pkg``; ``pkg/`` names the package) or
    ``a, b`` (modules of ``zerograph``). Parentheses are remarks, except ``(+ a, b)``, which names
    more modules of the same segment; a name with a dot is a data file of the segment's package."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "docs/design.md: no fenced block under '## Layout'"
    rows: list[list[str]] = []
    for line in block.group(1).splitlines():
        if line.strip():
            rows.append(line.split(None, 1)) if not line[0].isspace() else rows[-1].append(line.strip())
    named = {}
    for layer, *text_parts in rows:
        text = re.sub(r"\(\+\s*([^()]*)\)", r", \1", " ".join(text_parts))
        while (stripped := re.sub(r"\([^()]*\)", "", text)) != text:
            text = stripped
        for segment in text.split(";"):
            header = re.match(r"\s*([\w/]+)/\s*:?", segment)
            package = "zerograph." + header.group(1).replace("/", ".") if header else "zerograph"
            if header:
                named[package], segment = layer, segment[header.end():]
            for name in filter(None, (n.strip() for n in segment.split(","))):
                key = f"{package.replace('.', '/')}/{name}" if "." in name else f"{package}.{name}"
                named[key] = layer
    return named


def test_design_layout_names_every_module_in_its_layer() -> None:
    """docs/design.md's layout block names every package and module of the tree (``passes/`` as
    ``zerograph.passes``), in the row of the layer ``LAYERS`` puts it in, and names nothing that is
    not there."""
    named, modules = design_layout(), set(module_files()) - {"zerograph"}
    files = {k for k in named if "/" in k}
    unnamed = sorted(modules - set(named))
    stale = sorted(set(named) - modules - files) + sorted(f for f in files if not (ROOT / f).exists())
    misplaced = sorted(f"{m} in row {named[m]!r}, in layer {LAYERS[layer_of(m)][0]!r}"
                       for m in modules & set(named) if named[m] != LAYERS[layer_of(m)][0])
    assert not (unnamed or stale or misplaced), (
        "docs/design.md's layout block and the tree differ:\n  not named: " + ", ".join(unnamed)
        + "\n  named, not in the tree: " + ", ".join(stale) + "\n  in another layer's row: " + "; ".join(misplaced))


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(m for m in module_files() if m != "zerograph.__main__"))
def test_every_module_imports_first(module: str, fresh_importer) -> None:
    """As if ``zerograph/__init__.py`` were empty: each module loads what it imports and nothing
    that the package face would have loaded before it (``zerograph`` itself: the face)."""
    assert fresh_importer.submit(import_first, module).result(timeout=120) is None


@pytest.fixture(scope="module")
def fresh_importer():
    """A process pool whose every task runs in a new child forked from a server that has imported
    torch but no zerograph module: a fresh interpreter per module, without paying torch's import
    each time (or, where this process's forkserver is the warm one, a spawned interpreter)."""
    context = forkserver.context(zerograph_free=True) or multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=context, max_tasks_per_child=1) as pool:
        yield pool
