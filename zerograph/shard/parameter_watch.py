"""Parameter changes after ``compile`` that the captured graphs cannot follow (``ParameterWatch``):
a ``requires_grad`` flipped, a parameter or a submodule with parameters registered on the model.

The registrations are seen through ``torch.nn``'s process-wide registration hooks, installed once
(``_install_registration_hooks``) and finding each model's watch through a weak dictionary of its
modules. Split out of sharding.py, which re-exports ``ParameterWatch``.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ..errors import ModelChangedError


class ParameterWatch:
    """Notices the parameter changes made after ``compile`` that the captured graphs cannot follow.

    - ``requires_grad`` flipped: which gradients are reduced, and which parameters an optimizer
      updates, was decided when the graphs were captured. Dynamo guards on ``requires_grad``, so a
      flip recompiles the forward; ``check_trainable`` runs then (from the backend), so the steady
      state costs nothing per step.
    - a parameter registered (added or replaced) on a module of the model, or a submodule with
      parameters added: ``torch.nn``'s global registration hooks record it as it happens
      (``torch.nn.modules.module.register_module_parameter_registration_hook``), and
      ``check_unchanged`` raises at the next forward (one list test per forward).

    Freezing parameters *before* compile (the LoRA pattern) is recorded as the compiled state and
    stays legal.
    """

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_parameters())  # a tied parameter once, under its first name
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.trainable = tuple(p.requires_grad for p in self.params)
        self.shard_ids = {id(p) for p in self.params}
        self.changes: list[str] = []  # what changed since compile, in the order it happened
        for fqn, mod in model.named_modules():
            _WATCHED.setdefault(mod, (self, fqn))
        _install_registration_hooks()

    def check_unchanged(self) -> None:
        """Raise ``ModelChangedError`` if a parameter or submodule was registered since compile."""
        if self.changes:
            raise ModelChangedError(
                f"{'; '.join(self.changes)} after zerograph.compile. The compiled model only knows the "
                "parameters it sharded at compile time; add or replace parameters (e.g. LoRA adapters) "
                "before calling zerograph.compile, or compile a fresh model. To load weights, use "
                "load_state_dict without assign=True, which copies into the existing shards")

    def check_trainable(self) -> None:
        """Raise ``ModelChangedError`` if a parameter's ``requires_grad`` differs from compile time."""
        now = tuple(p.requires_grad for p in self.params)
        if now == self.trainable:
            return
        changed = [(n, was) for n, was, is_ in zip(self.names, self.trainable, now) if was != is_]
        listed = ", ".join(f"{n!r} ({'trainable -> frozen' if was else 'frozen -> trainable'})"
                           for n, was in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise ModelChangedError(
            f"requires_grad changed after zerograph.compile for {listed}{more}. Which gradients are "
            "reduced and which parameters the optimizer shards is fixed when the model is compiled: set "
            "requires_grad before zerograph.compile (as for LoRA), or compile a fresh model. To stop "
            "updating a parameter for a while, leave it out of the optimizer step instead (e.g. a param "
            "group with lr=0)")


# module -> (its model's watch, its qualified name); weak, so a dropped model leaves no trace
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, tuple[ParameterWatch, str]]" = weakref.WeakKeyDictionary()
_HOOKS_INSTALLED = False


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# Both hooks return at once while Dynamo traces: a forward may build modules (slicing an
# nn.ModuleList creates one), and tracing into the weak dictionary would make Dynamo guard on it.
def _on_parameter_registered(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if torch.compiler.is_compiling():
        return
    entry = _WATCHED.get(module)
    if entry is None or param is module._parameters.get(name):  # not ours, or the same object again
        return
    watch, prefix = entry
    verb = "replaced" if module._parameters.get(name) is not None else "added"
    watch.changes.append(f"parameter {_qualified(prefix, name)!r} was {verb}")


def _on_module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if torch.compiler.is_compiling():
        return
    entry = _WATCHED.get(module)
    if entry is None or submodule is None:
        return
    watch, prefix = entry
    new = [n for n, p in submodule.named_parameters() if id(p) not in watch.shard_ids]
    if new:
        watch.changes.append(f"submodule {_qualified(prefix, name)!r} with parameters zerograph did not "
                             f"shard ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''}) was added")


def _install_registration_hooks() -> None:
    """Register the two process-wide hooks once; they cost a weak-dict lookup per registration."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook

    register_module_parameter_registration_hook(_on_parameter_registered)
    register_module_module_registration_hook(_on_module_registered)
    _HOOKS_INSTALLED = True
