"""Where a unit kind's units run (``UnitPath``), and the moves allowed between paths (``TRANSITIONS``).

A kind starts on its templates and only ever moves toward eager: inline in one training-flag
mode, inline in every mode, an island. Nothing brings it back, because what made it leave stays
(an object argument comes again at every step, a unit changed since compile, data-dependent
control flow); the graphs traced on the old path guard on the unit attributes below and are
traced again. ``UnitKind.leave`` (templates/kinds.py) is the one place that moves a kind, and the
one that writes those attributes.

An exit that keeps the kind's lasting path is a move to the path it is on: one more
training-flag mode inline, or a trace with dynamic shapes (every unit inline in that trace only).
A call over substituted parameters (``functional_call``) runs inline for that call only, without
moving the kind (``UnitKind.note_exit``). Every exit is counted all the same (``stats().template_exits``).
"""
from __future__ import annotations

import enum

# Dynamo reads these per unit in its forward and guards on them; only ``UnitKind.leave`` sets them
ISLAND_ATTR = "_zerograph_unit_island"  # True once the unit's kind runs as eager islands
INLINE_ATTR = "_zerograph_unit_inline"  # True once the unit's kind runs inline in every mode (islands too)
# + str(mode): True once the kind runs inline in that training-flag mode (one attribute per mode,
# so Dynamo's guard on one mode's flag is not broken when another mode falls back)
INLINE_MODE_PREFIX = "_zerograph_unit_inline_mode_"


class UnitPath(enum.Enum):
    """The path a kind's units take, from the fastest to the most eager."""

    TEMPLATE = "template"  # every call runs the kind's template (in the graph: one node per unit)
    MODES_INLINE = "template, inline in some training-flag modes"  # UnitKind.inline_modes says which
    INLINE = "inline"  # the body runs inline, traced with the model, in every mode
    ISLAND = "island"  # the body runs eagerly between graphs, its parameters gathered once on entry

    @property
    def reported(self) -> str:
        """The path as ``explain``'s "Unit paths" and ``UnitKind.path`` name it: ``"template"``,
        ``"inline"`` or ``"island"`` (the inline modes are listed beside it)."""
        return "template" if self is UnitPath.MODES_INLINE else self.value

    def inline(self, every_mode: bool) -> UnitPath:
        """The path after the kind runs inline in one training-flag mode more, or in every mode:
        an island stays one, and so does a kind already inline in every mode."""
        if self in (UnitPath.INLINE, UnitPath.ISLAND):
            return self
        return UnitPath.INLINE if every_mode else UnitPath.MODES_INLINE


# from a path -> the paths a kind on it may move to (itself included: an exit that keeps it)
TRANSITIONS: dict[UnitPath, frozenset[UnitPath]] = {
    UnitPath.TEMPLATE: frozenset(UnitPath),
    UnitPath.MODES_INLINE: frozenset({UnitPath.MODES_INLINE, UnitPath.INLINE, UnitPath.ISLAND}),
    UnitPath.INLINE: frozenset({UnitPath.INLINE, UnitPath.ISLAND}),
    UnitPath.ISLAND: frozenset({UnitPath.ISLAND}),
}
