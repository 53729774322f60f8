"""A unit's call and its output as a template sees them: tensors, and constants around them.

A template is traced per *call structure* (``describe``): the call's positional and keyword
arguments, and the autocast state it runs under, with each tensor replaced by a slot (``TENSOR``)
and every other leaf (``None``, ``bool``, ``int``, ``float``, ``str``, an enum, a dtype, a device,
a ``torch.Size``) kept as a constant, as Dynamo specialises on them; tuples, lists and dicts nest. So a Hugging
Face decoder layer called with ``attention_mask=None, position_embeddings=(cos, sin),
use_cache=False`` and a torchtitan block called with ``attention_masks=None, positions=None`` take
their templates. The body's output is described the same way (``flatten_output``): its tensors
are the op's outputs, in order, and ``rebuild`` puts them back into the body's structure (a
tensor, a tuple such as ``(hidden, None)``, a dict).

``describe`` and ``rebuild`` run under Dynamo at every unit call, so they are plain recursion
over the containers Dynamo traces cheaply; the structures are registered outside the trace
(``call_key``: ``assume_constant_result``), the key an int the unit op carries.
Source: Dynamo's own specialisation on non-tensor arguments, and ``torch.utils._pytree``'s view of
containers as nodes and everything else as leaves.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import torch

TENSOR = "<tensor>"  # a tensor leaf's place in a structure
# leaves a structure keeps as constants of the template's key
CONSTANT_TYPES = (type(None), bool, int, float, str, enum.Enum, torch.dtype, torch.device, torch.Size)
UNSUPPORTED = "?"  # tag of a leaf no template can take (an object: a KV cache, a dataclass)

# the structure of every call traced in this process (an index is the op's ``call`` argument)
_STRUCTURES: list[tuple] = []
_KEYS: dict[tuple, int] = {}


def describe(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value``'s structure: ``TENSOR`` for a tensor (appended to ``tensors``), ``("c", value)``
    for a constant leaf (``("c", (type name, value))``), ``("tuple" | "list", items)`` and ``("dict", ((key, item), ...))`` for
    containers (exact types only: a namedtuple or a dict subclass is an object), and
    ``("?", type name)`` for anything else (``unsupported``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TENSOR
    if isinstance(value, CONSTANT_TYPES):  # by type too: True, 1 and 1.0 are equal keys otherwise
        return ("c", (type(value).__name__, value))
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind.__name__, tuple([describe(item, tensors) for item in value]))
    if kind is dict:
        return ("dict", tuple([(key, describe(item, tensors)) for key, item in value.items()]))
    return (UNSUPPORTED, kind.__name__)


def unsupported(structure: Any) -> str | None:
    """The type name of the first leaf of ``structure`` no template can take, or ``None``."""
    if structure == TENSOR:
        return None
    tag, body = structure
    if tag == UNSUPPORTED:
        return body
    if tag == "c":
        return None
    for item in body:
        found = unsupported(item[1] if tag == "dict" else item)
        if found is not None:
            return found
    return None


def rebuild(structure: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """The value ``structure`` describes, its tensor slots filled from ``tensors`` in order."""
    if structure == TENSOR:
        return next(tensors)
    tag, body = structure
    if tag == "c":
        return body[1]
    if tag == "dict":
        return {key: rebuild(item, tensors) for key, item in body}
    items = [rebuild(item, tensors) for item in body]
    return tuple(items) if tag == "tuple" else items


def flatten_output(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """A body's output as ``(structure, tensors)``.

    Raises:
        TypeError: the output holds a leaf no template can return (an object), or no tensor.
    """
    tensors: list[torch.Tensor] = []
    structure = describe(value, tensors)
    bad = unsupported(structure)
    if bad is not None or not tensors:
        raise TypeError(f"it returned {type(value).__name__}" + (f" holding a {bad}" if bad else " without a tensor")
                        + "; a template returns tensors in tuples, lists and dicts, beside constants")
    return structure, tensors


@torch._dynamo.assume_constant_result
def call_key(structure: tuple) -> int:
    """The int naming ``structure`` in this process: ``(positional arguments' structure, keyword
    arguments' structure, autocast dtype or None)``, the unit op's ``call`` argument. Dynamo runs
    this while it traces, its result a constant of the graph."""
    key = _KEYS.get(structure)
    if key is None:
        key = _KEYS[structure] = len(_STRUCTURES)
        _STRUCTURES.append(structure)
    return key


def call_structure(key: int) -> tuple[Any, Any, torch.dtype | None]:
    """``(args' structure, kwargs' structure, autocast dtype or None)`` registered as ``key``."""
    return _STRUCTURES[key]


def call_arguments(key: int, tensors: list[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
    """The ``(args, kwargs)`` of call ``key`` with its tensor slots filled from ``tensors``."""
    args_structure, kwargs_structure, _ = call_structure(key)
    slots = iter(tensors)
    return rebuild(args_structure, slots), rebuild(kwargs_structure, slots)
