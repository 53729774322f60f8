"""What tests/test_layers.py's fresh children run: import one zerograph module first.

This module imports only the standard library, so that a child forked from the zerograph-free
server (tests/forkserver.py) loads nothing but the module under test and what it imports.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys


def import_first(module: str) -> str | None:
    """Import ``module`` as the first zerograph import of this process; the error as text, or ``None``.

    The package ``zerograph`` itself runs its ``__init__.py``. For any other module the package is
    registered without running it (as if that file were empty), so ``module`` loads only what it
    imports itself: an import cycle that ``zerograph/__init__.py``'s order would otherwise hide
    fails here with "partially initialized module".
    """
    assert not any(m == "zerograph" or m.startswith("zerograph.") for m in sys.modules), "not a fresh process"
    try:
        if module != "zerograph":
            spec = importlib.util.find_spec("zerograph")
            sys.modules["zerograph"] = importlib.util.module_from_spec(spec)  # its __path__, none of its code
        importlib.import_module(module)
    except Exception as exc:  # report, the parent asserts
        return f"{module}: {type(exc).__name__}: {exc}"
    return None
