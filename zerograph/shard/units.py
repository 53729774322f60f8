"""Which modules become sharding units, and whether the choice leaves one unit too large.

Default discovery finds the model's *stacks* of repeated blocks wherever they sit, as FSDP's
transformer auto-wrap policy wraps every instance of a block class, but without being told the
class:

- A *stack* is an ``nn.ModuleList`` or ``nn.Sequential`` with two or more children (the model
  itself included), or an ``nn.ModuleDict`` of repeated blocks (not one of unrelated parts).
- A stack is *of repeated blocks* when its children that own parameters, two or more, are all of
  one class: the stack's *block class*.
- The largest stack of repeated blocks is taken (by parameter count; the first in module order on
  a tie), or, when the model has none, the largest stack of any kind.
- Every other stack of repeated blocks is taken too, largest first, when its block class is one
  already taken or when it holds at least as many parameters as the largest block taken so far;
  a stack inside a taken stack's child, or holding a taken stack, is not taken.
- The units are the children of the taken stacks, in module order, each module once.
Examples of each rule: docs/stages.md, section "Units and shards".

``Config(unit_classes=...)`` overrides all of it: the outermost instances of those classes.

Source: PyTorch FSDP's ``transformer_auto_wrap_policy`` / ``ModuleWrapPolicy`` (wrap every
instance of the block classes) and Hugging Face's ``_no_split_modules``.
"""
from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from ..errors import UnitSizeWarning

STACK_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# a unit (the root included) holding more than this share of the parameters is gathered whole at
# stage 3 while it is used: with four or more units none needs to
LARGE_UNIT_SHARE = 0.25
# ... and is worth a warning when repeated blocks holding at least this share could leave it
SPLITTABLE_SHARE = 0.125


def find_units(model: nn.Module, unit_classes: tuple[type[nn.Module], ...] | None) -> list[tuple[str, nn.Module]]:
    """Modules that become units, ``(qualified name, module)`` in module order (the root unit is
    implicit: every parameter outside them). ``unit_classes``: the outermost instances of those
    classes; ``None``: the children of the stacks of repeated blocks (module docstring).

    Raises ``TypeError`` when ``unit_classes`` is not a class or a tuple of classes (``isinstance``'s).
    """
    if unit_classes:
        found: list[tuple[str, nn.Module]] = []
        for name, mod in model.named_modules():
            if isinstance(mod, unit_classes) and mod is not model:
                if not any(name.startswith(f"{outer}.") for outer, _ in found):
                    found.append((name, mod))
        return found
    taken = _taken_stacks(model)
    units: list[tuple[str, nn.Module]] = []
    covered: set[int] = set()  # ids of modules in a unit already (a module shared by two stacks is one unit)
    for name, stack in sorted(taken, key=lambda s: _position(model, s[1])):
        prefix = f"{name}." if name else ""
        for child_name, child in stack.named_children():
            if id(child) not in covered:
                covered.update(id(m) for m in child.modules())
                units.append((f"{prefix}{child_name}", child))
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(units, key=lambda u: order[id(u[1])])


@dataclasses.dataclass(frozen=True)
class _Stack:
    name: str
    module: nn.Module
    size: int  # unique parameters under it, elements
    block_class: type[nn.Module] | None  # None: not a stack of repeated blocks
    largest_block: int  # elements of its largest child


def _numel(mod: nn.Module) -> int:
    return sum(p.numel() for p in mod.parameters())  # parameters() yields a tied parameter once


def _block_class(stack: nn.Module) -> type[nn.Module] | None:
    owners = [child for child in stack.children() if any(True for _ in child.parameters())]
    classes = {type(child) for child in owners}
    return classes.pop() if len(owners) >= 2 and len(classes) == 1 else None


def _stacks(model: nn.Module) -> list[_Stack]:
    found = []
    for name, mod in model.named_modules():
        if not isinstance(mod, STACK_TYPES) or len(mod) < 2:
            continue
        size = _numel(mod)
        if not size:
            continue  # nothing to shard
        block_class = _block_class(mod)
        if isinstance(mod, nn.ModuleDict) and block_class is None:
            continue  # a dict of unrelated parts (nanoGPT's ``transformer``) is no stack
        found.append(_Stack(name, mod, size, block_class, max(_numel(c) for c in mod.children())))
    return found


def _taken_stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    stacks = _stacks(model)
    if not stacks:
        return []
    repeated = [s for s in stacks if s.block_class is not None]
    # the largest first; on a tie the first in module order (max keeps the first maximum)
    first = max(repeated or stacks, key=lambda s: s.size)
    taken = [first]
    inside: set[int] = {id(m) for c in first.module.children() for m in c.modules()}
    classes = {first.block_class}
    largest_block = first.largest_block
    changed = True
    while changed:  # a stack taken for its size may bring others in by its class
        changed = False
        for stack in sorted(repeated, key=lambda s: -s.size):  # sorted is stable: module order on ties
            if any(stack is t for t in taken) or id(stack.module) in inside:
                continue
            if any(id(t.module) in {id(m) for m in stack.module.modules()} for t in taken):
                continue  # it holds a taken stack: the outer blocks would swallow the inner units
            if stack.block_class in classes or stack.size >= largest_block:
                taken.append(stack)
                inside.update(id(m) for c in stack.module.children() for m in c.modules())
                classes.add(stack.block_class)
                largest_block = max(largest_block, stack.largest_block)
                changed = True
    return [(s.name, s.module) for s in taken]


def _position(model: nn.Module, target: nn.Module) -> int:
    return next(i for i, m in enumerate(model.modules()) if m is target)


# ----------------------------------------------------------------------------- shares and the warning


def unit_shares(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, int]]:
    """``(name, elements)`` per unit, the root (``"<root>"``) first. Mirrors
    ``sharding.shard_module_``: a parameter belongs to the unit of the first module (in
    ``named_modules`` order) that owns it, so a tied parameter counts once."""
    owner: dict[int, int] = {}
    for index, (_, unit_mod) in enumerate(units, start=1):
        for mod in unit_mod.modules():
            owner.setdefault(id(mod), index)
    sizes = [0] * (len(units) + 1)
    seen: set[int] = set()
    for _, mod in model.named_modules():
        for param in mod._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                sizes[owner.get(id(mod), 0)] += param.numel()
    return [("<root>", sizes[0])] + [(name, size) for (name, _), size in zip(units, sizes[1:])]


def repeated_blocks_within(model: nn.Module, units: list[tuple[str, nn.Module]], index: int,
                           min_elements: int = 0) -> tuple[type[nn.Module], int] | None:
    """The block class that would split unit ``index`` (0: the root, the modules outside every
    unit) best, and how many instances of it the unit holds; ``None`` when none would.

    Candidates: classes with two or more instances in the unit, each instance a block (a module
    with a child that owns parameters, not a single layer or a container), whose instances hold
    at least ``min_elements`` of the unit's parameters together. Of those the class with the most instances
    (the finest split: a T5's ``T5Block`` rather than its two ``T5Stack``), then the one holding
    the most parameters (a Llama's ``TransformerBlock`` rather than its ``FeedForward``)."""
    if index == 0:
        in_units = {id(m) for _, u in units for m in u.modules()}
        own = [m for m in model.modules() if id(m) not in in_units]
    else:
        own = list(units[index - 1][1].modules())
    own_ids = {id(m) for m in own}

    def params_under(mods: list[nn.Module]) -> int:  # parameters of this unit under ``mods``, each once
        seen = {id(p): p.numel() for m in mods for sub in m.modules() if id(sub) in own_ids
                for p in sub._parameters.values() if p is not None}
        return sum(seen.values())

    per_class: dict[type[nn.Module], list[nn.Module]] = {}
    for mod in own:
        if mod is model or isinstance(mod, STACK_TYPES):
            continue
        if any(any(True for _ in c.parameters()) for c in mod.children()):
            per_class.setdefault(type(mod), []).append(mod)
    best = None
    for cls, mods in per_class.items():  # dict order: the outermost class first
        size = params_under(mods)
        if len(mods) < 2 or size < min_elements:
            continue
        if best is None or (len(mods), size) > (best[1], best[2]):
            best = (cls, len(mods), size)
    return None if best is None else (best[0], best[1])


def warn_large_units(model: nn.Module, units: list[tuple[str, nn.Module]], stage: int) -> None:
    """At stage 3, warn (``UnitSizeWarning``) for each unit, the root included, that holds more
    than ``LARGE_UNIT_SHARE`` of the parameters while it holds two or more repeated blocks that
    could be units of their own and hold ``SPLITTABLE_SHARE`` of the parameters or more together
    (``repeated_blocks_within``); the message names the fix, ``Config(unit_classes=(Block,))``.

    A large unit without repeated blocks inside (a tiny model's embedding in the root, one of two
    blocks) has no such fix, and stays silent: the rule fires on the models whose blocks
    discovery missed, not on every small test model."""
    if stage != 3:
        return
    shares = unit_shares(model, units)
    total = sum(size for _, size in shares)
    for index, (name, size) in enumerate(shares):
        if not total or size <= LARGE_UNIT_SHARE * total:
            continue
        fix = repeated_blocks_within(model, units, index, min_elements=int(SPLITTABLE_SHARE * total))
        if fix is None:
            continue
        cls, count = fix
        what = "the root unit (parameters outside every unit)" if index == 0 else f"unit {name!r}"
        warnings.warn(
            f"zerograph.compile: {what} holds {size / total:.0%} of the model's parameters at stage 3, so "
            f"it is gathered whole while in use; it holds {count} {cls.__name__} blocks that could be units "
            f"of their own: pass config=zerograph.Config(unit_classes=({cls.__name__},)) to zerograph.compile "
            "(with the other block classes of the model, if any; a module that calls them from a loop over the "
            "data, such as a router over experts, then runs eagerly with all of them gathered while it runs)",
            UnitSizeWarning, stacklevel=3)
