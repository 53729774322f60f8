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


_UNIT_KINDS: dict[int, weakref.ReferenceType[Any]] = {}  # kind -> templates.UnitKind (its model's state owns it)
# template id -> unit_trace.UnitTemplate, weakly: its kind holds it, and so do whatever still needs it
# for a backward (a compiled backward graph, an eager call's autograd context) after the model is gone
_TEMPLATES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_TEMPLATE_IDS = itertools.count()


def register_unit_kind(kind: int, unit_kind: Any) -> None:
    """Record ``unit_kind`` (``templates.kinds.UnitKind``: the units that share one traced template) under ``kind``."""
    _UNIT_KINDS[kind] = weakref.ref(unit_kind)


def unit_kind(kind: int) -> Any:
    """The ``templates.kinds.UnitKind`` recorded under ``kind``."""
    unit_kind = _UNIT_KINDS[kind]()
    assert unit_kind is not None, f"unit kind {kind} outlived its model"
    return unit_kind


def unit_template(kind: int, mode: int, arg_grads: int, primals: Any, call: int) -> Any:
    """The ``UnitTemplate`` of unit kind ``kind`` in training-flag ``mode``, differentiating the
    arguments of ``arg_grads``'s bits, for inputs like ``primals`` passed as call ``call``
    (``unit_calls.call_key``), traced on first use."""
    unit_kind = _UNIT_KINDS[kind]()
    assert unit_kind is not None, f"unit kind {kind} outlived its model"
    return unit_kind.template(mode, arg_grads, primals, call)


def next_template_id() -> int:
    """A fresh template id (unique in this process)."""
    return next(_TEMPLATE_IDS)


def register_template_as(template_id: int, template: Any) -> None:
    """Record ``template`` (``unit_trace.UnitTemplate``) as ``template_id``, for the backward op."""
    _TEMPLATES[template_id] = template


def template_of(template_id: int) -> Any:
    """The ``UnitTemplate`` registered as ``template_id``."""
    return _TEMPLATES[template_id]
