"""Which instance attributes of a unit's modules its body reads while traced (``recording_reads``).

``template_keys`` keys a template by the unit's plain attributes; one its body never reads need
not match for two units to share a trace. torchtitan's ``TransformerBlock`` keeps a per-layer
init constant (``weight_init_std``) that ``forward`` never reads: keyed by every attribute, each
layer of its Llama would be traced, partitioned and held as a template of its own.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

from torch import nn

from ..graph.vocab import GENERATED_CLASS

# a read of this makes every attribute count as read (the code may look at any of them)
EVERY_ATTRIBUTE = "__dict__"
_MODULE_FILE = nn.Module.__getattr__.__code__.co_filename


@contextlib.contextmanager
def recording_reads(modules: Sequence[nn.Module], reads: set[tuple[int, str]]) -> Iterator[None]:
    """While active, module ``i`` of ``modules`` is an instance of a subclass of its class that
    adds ``(i, name)`` to ``reads`` for every attribute looked up on it (through the instance,
    ``getattr`` included; ``object.__getattribute__`` called directly is not seen). The classes
    are put back on exit, whatever the body raised."""
    previous = [type(m) for m in modules]
    try:
        for i, (module, cls) in enumerate(zip(modules, previous)):
            object.__setattr__(module, "__class__", _recording_class(cls, i, reads))
        yield
    finally:
        for module, cls in zip(modules, previous):
            object.__setattr__(module, "__class__", cls)


def _recording_class(cls: type, index: int, reads: set[tuple[int, str]]) -> type:
    def __getattribute__(self: nn.Module, name: str) -> object:  # noqa: N807 (the hook's own name)
        # nn.Module's own methods read the dict for its parameter, buffer and submodule tables
        if name != EVERY_ATTRIBUTE or sys._getframe(1).f_code.co_filename != _MODULE_FILE:
            reads.add((index, name))
        return cls.__getattribute__(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, GENERATED_CLASS: True,
                                       "__module__": cls.__module__})


def instance_reads(modules: Sequence[nn.Module], reads: set[tuple[int, str]]) -> frozenset[tuple[int, str]] | None:
    """The ``(module index, name)`` of ``reads`` that name an instance attribute (methods, class
    attributes and properties are the class's code, keyed apart); ``None`` when the dict itself
    was read (every attribute counts)."""
    if any(name == EVERY_ATTRIBUTE for _, name in reads):
        return None
    return frozenset((i, name) for i, name in reads if name in vars(modules[i]))
