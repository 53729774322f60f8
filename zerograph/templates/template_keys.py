"""What must match for two units, in any models, to share a traced template: the unit's structure
(``unit_signature``, which groups a model's units into kinds) and everything else a trace reads
(``trace_key``, the key of the process-wide template cache, ``template_cache.shared_template``).

Two units with equal keys trace to the same graphs: a key that left out something a trace reads
would hand one unit another's graphs. Split out of templates/kinds.py, which groups units and caches
their templates by these keys.
"""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from ..passes._fx import layout_template
from ..shard.sharding import original_class
from .unit_record import UNIT_ATTR
from .unit_trace import TensorMeta


def unit_signature(module: nn.Module, values: bool = True) -> tuple:
    """What must match for two units to share a template: for every submodule, its path, original
    class and plain attributes (numbers, strings, flags, dtypes; containers by value; functions,
    closures included, and other objects by identity), a ``forward`` set on a submodule instance
    (by identity), and its parameters' and buffers' names, full shapes, dtypes and
    ``requires_grad``. (A unit whose own instance has a ``forward`` is not templated at all.)
    ``values=False``: the attributes' names only (``read_values`` then says which values count)."""
    parts = []
    for path, mod in module.named_modules():
        attrs = tuple(sorted((k, _attribute_key(v) if values else None) for k, v in vars(mod).items()
                             if _keyed(k, path)))
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mod._parameters.items() if p is not None)
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in mod._buffers.items() if b is not None)
        parts.append((path, original_class(mod), attrs, params, buffers))
    return tuple(parts)


def _keyed(name: str, path: str) -> bool:
    """Whether ``unit_signature`` keys the instance attribute ``name`` of the submodule at ``path``."""
    return (name not in _MODULE_INTERNALS or (name == "forward" and bool(path))) and not name.startswith("_zerograph")


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "forward"}) | {
    k for k in vars(nn.Module()) if k.endswith("hooks") or "hooks_" in k or k.endswith("_hooks_with_kwargs")}


def _attribute_key(value: Any, depth: int = 0) -> Any:
    """``value`` as part of a signature: plain values and containers by value; an object of a
    Python class that holds no tensor, parameter or submodule (a Hugging Face layer's kernel
    wrapper, a settings object) by its class and its attributes' keys, two levels deep; anything
    else (functions, closures, bound methods, tensors, deeper objects) by identity (``_Identity``)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (tuple, list, frozenset)):
        return (type(value).__name__, tuple(_attribute_key(v, depth) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _attribute_key(v, depth)) for k, v in value.items())))
    if depth < 2 and _plain_object(value):
        attrs = tuple(sorted((k, _attribute_key(v, depth + 1)) for k, v in vars(value).items() if _keyed(k, "sub")))
        return ("object", type(value), attrs)
    return _Identity(value)


def _plain_object(value: Any) -> bool:
    """An instance of a Python class with a ``__dict__`` and no tensor state of its own (a module
    without parameters, buffers or submodules); not a function, class or module."""
    if isinstance(value, (torch.Tensor, type, types.FunctionType, types.MethodType, types.ModuleType,
                          types.BuiltinFunctionType)) or not hasattr(value, "__dict__"):
        return False
    if isinstance(value, nn.Module):
        return not (value._parameters or value._buffers or value._modules)
    return True


class _Identity:
    """An object compared by identity, and held: a key of the process-wide template cache that
    held only an ``id`` could match a new object allocated where a freed one was."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


def read_values(module: nn.Module, reads: frozenset[tuple[int, str]] | None) -> tuple:
    """The values (as ``unit_signature`` keys them) of the instance attributes ``reads`` names,
    ``(module index, name)`` in ``modules()`` order (``UnitTemplate.read_attrs``); every plain
    attribute's for ``None``. ``training`` is left out: the trace sets it from its ``mode``."""
    if reads is None:
        return unit_signature(module)
    modules = getattr(module, UNIT_ATTR).modules
    return tuple((i, name, _attribute_key(vars(modules[i]).get(name))) for i, name in sorted(reads)
                 if name != "training" and _keyed(name, "" if modules[i] is module else "sub"))


def trace_key(module: nn.Module, lowering: str, metas: tuple[TensorMeta, ...], mode: int, arg_grads: int,
              device: torch.device, call: int, values: bool = True) -> tuple:
    """What a template's trace reads besides its primals' values, so that two units with equal
    keys, in any models, trace to the same graphs: the unit's structure (``unit_signature``), the
    code its modules run (``_class_key``: each class's methods, class attributes and the globals
    its methods name, so a class or flag patched between two compiles traces again), how its flat
    shard, if any, cuts the
    parameters out, the primals' shapes, strides and dtypes, the training-flag ``mode``, the
    arguments differentiated, the call's structure and autocast state (``unit_calls.call_key``),
    the device and lowering, and the settings a trace, the partitioner or
    Inductor read (default dtype, deterministic algorithms, matmul precision, their configs).
    ``module``: the kind's first unit; ``lowering``: ``"eager"`` or ``"inductor"``; ``values=False``:
    the plain attributes by name only (``template_cache.shared_template`` adds ``read_values``)."""
    record = getattr(module, UNIT_ATTR)
    modules, flat = record.modules, record.flat
    code = tuple(_class_key(original_class(m)) for m in modules)
    cuts = None
    if flat is not None:
        cuts = (layout_template(flat.layouts), flat.offsets, flat.layout.shape, flat.layout.sharded)
    settings = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                torch.get_float32_matmul_precision(), _config_key(torch._functorch.config))
    if lowering == "inductor":
        import torch._inductor.config as inductor_config

        settings += (_config_key(inductor_config),)
    return (unit_signature(module, values), code, cuts, metas, mode, arg_grads, call, str(device), lowering, settings)


def _class_key(cls: type) -> tuple:
    """A module class as a trace sees it: the class, and what its own and its bases' dicts hold
    (below ``nn.Module``) as ``_attribute_key`` sees them, and for each method the module-level
    globals its code names, modules left out (a flag such as ``USE_FLASH = True``, a settings dict
    by value, a helper function by identity). A global read one call deeper, inside a helper
    function, is not seen."""
    parts: list[Any] = [cls]
    for base in cls.__mro__:
        if base in (nn.Module, object):
            break
        for name, value in sorted(vars(base).items()):
            if name.startswith("__"):
                continue
            parts.append((name, _attribute_key(value)))
            if isinstance(value, types.FunctionType):
                named = [(n, value.__globals__[n]) for n in value.__code__.co_names if n in value.__globals__]
                parts.append(tuple((n, _attribute_key(v)) for n, v in named if not isinstance(v, types.ModuleType)))
    return tuple(parts)


def _config_key(config: Any) -> str:
    """A torch config module's current values (``torch.utils._config_module``), as one string."""
    return repr(sorted(config.get_config_copy().items(), key=lambda item: item[0]))
