"""One name per module: ``passes/`` is installed as ``zerograph.passes`` and is imported by that name only.

Under pytest the repository root is on ``sys.path`` (``tests/`` is a package, so pytest's
``prepend`` import mode puts its parent there, and ``python -m pytest`` adds the working
directory too), so ``import passes`` would also find ``passes/``: each file would then load twice,
as two modules whose classes differ (``passes.context.PassContext`` is not
``zerograph.passes.context.PassContext``) and whose module state (``PASS_TIMES``, registries)
splits in two. These tests refuse such an import wherever it is written and whenever it happens.
"""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("zerograph", "passes", "tests", "examples")
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _second_names(tree: ast.AST) -> list[str]:
    """The ``import passes...`` / ``from passes... import`` statements of ``tree``, as source text."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name == "passes" or name.startswith("passes.") for name in names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_source_imports_passes_by_its_folder_name():
    bad = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)} {line}" for line in _second_names(ast.parse(path.read_text()))]
    for path in sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "passes").glob("*.md")]):
        for block in CODE_BLOCK.findall(path.read_text()):
            bad += [f"{path.relative_to(ROOT)} {line}" for line in _second_names(ast.parse(block))]
    assert not bad, "import zerograph.passes, never passes (the folder's name):\n" + "\n".join(bad)


def _tests_modules() -> list[str]:
    """Every module of tests/passes/ (the tests of the passes, the likeliest to import them by path)."""
    return [f"tests.passes.{p.stem}" for p in sorted((ROOT / "tests" / "passes").glob("*.py")) if p.stem != "__init__"]


def test_every_module_file_is_loaded_under_one_name():
    """After the passes and their tests are imported (and whatever this session imported before),
    no module is named ``passes`` or ``passes.*`` and no file of the repository is two modules."""
    import zerograph.passes.manager  # noqa: F401  (imports every pass)

    for name in _tests_modules():
        importlib.import_module(name)
    modules = dict(sys.modules)
    assert not [n for n in modules if n == "passes" or n.startswith("passes.")]
    names_of: dict[pathlib.Path, list[str]] = {}
    for name, module in modules.items():
        file = getattr(module, "__file__", None)
        path = pathlib.Path(file).resolve() if file else None
        if path is not None and any(path.is_relative_to(ROOT / folder) for folder in SOURCES):
            names_of.setdefault(path, []).append(name)
    twice = {str(path.relative_to(ROOT)): names for path, names in names_of.items() if len(names) > 1}
    assert not twice, f"files loaded as more than one module: {twice}"
