"""Marker keys: the int a graph marker carries, mapped back to its parameter's layout and runtime.

``zerograph::unshard(shard, key)`` and its siblings name a parameter by an int, since a graph node
cannot hold a Python object that Dynamo would guard on. Keys are handed out in compile order, so
every rank that compiles the same models in the same order agrees on them. The ops' real and fake
implementations look the key up here; the runtime registers its layouts when it is built. This
module sits in the bottom layer so that the ops need not import the runtime.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

_KEYS = itertools.count()
_LAYOUTS: dict[int, Any] = {}                            # key -> sharding.ParamLayout
_RUNTIMES: dict[int, weakref.ReferenceType[Any]] = {}    # key -> runtime.Runtime (weakly: a freed model frees it)


def next_key() -> int:
    """A fresh marker key (unique in this process)."""
    return next(_KEYS)


def register(layouts: Any, runtime: Any) -> None:
    """Record each of ``layouts`` (``sharding.ParamLayout``) under its key, owned by ``runtime``."""
    for layout in layouts:
        _LAYOUTS[layout.key] = layout
        _RUNTIMES[layout.key] = weakref.ref(runtime)


def layout_of(key: int) -> Any:
    """The ``ParamLayout`` of marker key ``key``."""
    return _LAYOUTS[key]


def runtime_of(key: int) -> Any:
    """The ``Runtime`` that owns marker key ``key``."""
    runtime = _RUNTIMES[key]()
    assert runtime is not None, f"marker key {key} outlived its model"
    return runtime
