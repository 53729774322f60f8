"""A templated unit's submodules and attributes, checked before every forward: Dynamo's guards for
the code a template hides from them.

A kind's template is traced once and called from the model's graphs as one op, so Dynamo never
guards on what the body read: a plain attribute (a temperature, a ``residual`` flag) set, or a
submodule swapped (``block.act = nn.ReLU()``), after the trace would leave every unit of the kind
running the old graphs. Eager reads the new values, and so does zerograph: ``changed`` compares a
unit with what it was when ``compile`` grouped it (``template_keys.unit_signature``: same modules
by identity, same instance attribute names, same values of the attributes its templates read, or
of every one before a template is traced), and a kind with a changed unit runs inline from then on
(``UnitKind.check_unchanged``, ``run_inline``), traced with the model by Dynamo, whose guards then follow every later
change (a recompile per value, as without templates).

Layer: execution (runs before each forward, outside the trace; reads modules only).

Source: Dynamo's guards on module attributes (``torch._dynamo.guards``), which a compiled region
that is not traced through (``invoke_subgraph``) does not get either.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from typing import Any

from torch import nn

from .template_keys import _attribute_key, _keyed


def _path(index: int) -> str:
    """``_keyed``'s path argument: only whether the module is the unit itself (index 0) matters."""
    return "" if index == 0 else "sub"


def _names(index: int, module: nn.Module) -> frozenset[str]:
    return frozenset(name for name in vars(module) if _keyed(name, _path(index)))


@dataclasses.dataclass
class UnitBaseline:
    """One unit as ``compile`` grouped it: ``modules``, its ``modules()``, and ``children``, each
    one's submodule slots (by identity); ``names``, each one's keyed instance attribute names
    (``raw_names``: all of them, the fast check, kept current when only zerograph's own flags
    change); ``values``, ``(module index, name)`` -> the attribute's value as ``unit_signature``
    keys it (``training`` left out: the unit's mode), and ``raw``, the value itself."""

    modules: tuple[nn.Module, ...]
    children: tuple[tuple[nn.Module | None, ...], ...]
    names: tuple[frozenset[str], ...]
    raw_names: list[frozenset[str]]
    values: dict[tuple[int, str], Any]
    raw: dict[tuple[int, str], Any]

    @classmethod
    def of(cls, unit: nn.Module) -> UnitBaseline:
        modules = tuple(unit.modules())
        names = tuple(_names(i, m) for i, m in enumerate(modules))
        raw = {(i, name): vars(m)[name] for i, m in enumerate(modules) for name in names[i] if name != "training"}
        return cls(modules, tuple(tuple(m._modules.values()) for m in modules), names,
                   [frozenset(vars(m)) for m in modules], {key: _attribute_key(v) for key, v in raw.items()}, raw)


def changed(baseline: UnitBaseline, reads: Iterable[tuple[int, str]]) -> str | None:
    """What changed in the unit of ``baseline`` since then that a template could have read, or
    ``None``. ``reads``: the ``(module index, name)`` of ``baseline.values`` to compare (those its
    kind's templates read, or all). Costs a few microseconds per submodule: it runs every forward."""
    modules = baseline.modules
    for module, children in zip(modules, baseline.children):
        if tuple(module._modules.values()) != children:  # identity first: no module defines __eq__
            return "a submodule was replaced, added or removed after compile"
    for i, module in enumerate(modules):
        if vars(module).keys() != baseline.raw_names[i]:
            if _names(i, module) != baseline.names[i]:
                return f"an instance attribute of {type(module).__name__} was added or deleted after compile"
            baseline.raw_names[i] = frozenset(vars(module))  # only zerograph's own flags came or went
    for key in reads:
        value = vars(modules[key[0]])[key[1]]
        if value is not baseline.raw[key] and _attribute_key(value) != baseline.values[key]:
            return f"attribute {key[1]!r} of {type(modules[key[0]]).__name__} changed after compile"
    return None


class KindWatch:
    """The baselines of one kind's units (``add``, at install, in unit order) and the first change
    among them (``first_change``, every forward)."""

    def __init__(self) -> None:
        self.baselines: list[UnitBaseline] = []
        self._reads: tuple[int, list[tuple[int, str]]] = (-1, [])  # (templates counted, what to compare)

    def add(self, unit: nn.Module) -> None:
        self.baselines.append(UnitBaseline.of(unit))

    def first_change(self, names: list[str], templates: Collection) -> str | None:
        """``"unit NAME: what changed"`` for the first of the units (named ``names``) that changed
        in an attribute one of ``templates`` (the kind's ``UnitTemplate``s) read, or in any while
        there is none, or ``None``."""
        if not self.baselines:
            return None
        if self._reads[0] != len(templates):  # anew once per template traced
            values = self.baselines[0].values  # keyed alike in every unit of the kind
            read: set[tuple[int, str]] | None = set()
            for template in templates:
                if template.read_attrs is None:  # it read a whole __dict__: every attribute counts
                    read = None
                    break
                read.update(template.read_attrs)
            every = read is None or not templates
            self._reads = (len(templates), [key for key in values if every or key in read])
        for name, baseline in zip(names, self.baselines):
            reason = changed(baseline, self._reads[1])
            if reason is not None:
                return f"unit {name!r}: {reason}"
        return None
