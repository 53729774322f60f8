"""The process-wide state of zerograph's forwards and traces: one object, ``TRACE``.

What a parameter attribute returns (its shard, its full tensor, its flat shard's cut, what its
slot holds), and which path a templated unit's call takes, depend on where the read happens: in
the compiled model's forward or outside it, in a unit template's trace, in ``init_weights``, in a
forward over substituted parameters. Each of those is one field of ``TraceState``, set for a scope
with ``TRACE.scope(...)`` by the code that owns it and read as ``TRACE.<field>`` by the rest.

Dynamo traces the reads of ``gathering``, ``grad_mode``, ``tracing_unit`` and ``substituted`` (in
the parameter properties and the templated units' forward) and guards on their values, so each
value traces, and caches, graphs of its own. ``inline_every_unit`` is read through
``templates.kinds.inlining_every_unit``, a constant of the trace with no guard. ``init_read`` is
read outside every forward only.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..graph.vocab import GRAD_MODES, GRAD_SYNC


@dataclasses.dataclass
class TraceState:
    """The flags of the forward or trace running now; set them with ``scope``.

    Attributes:
        gathering: True while a zerograph forward runs or is traced. Outside it a parameter
            attribute is the ``DTensor`` shard itself (FSDP2's behaviour), so reads run no
            collective that only some ranks would join, and writes (``nn.init``, ``weight.data``,
            ``requires_grad``) reach the real parameter; a unit's forward refuses to run.
        grad_mode: what the backward of the forwards that follow does with their gradients (one
            of ``graph.vocab.GRAD_MODES``), set by the compiled model's forward from its runtime.
        tracing_unit: True while a unit template's body is traced, or an island's body runs, with
            full parameters of its own in the parameter slots: the attributes return what the slot
            holds, and templated units run inline. Read only by the thread that set it (the
            compiling thread waits for a template's trace).
        substituted: True for a forward in which some parameter of a flat shard's unit is not the
            shard ``compile`` made (``torch.func.functional_call``, ``nn.utils.stateless``:
            another tensor in the module's slot); its graphs read those parameters from their
            slots, and their units run inline.
        inline_every_unit: True while the compiled forward traces the model again after a
            template met a dynamic shape (``errors.DynamicShapeTrace``): every templated unit runs
            inline in that trace.
        init_read: set while ``init_weights`` runs (``io.init``): called with the module and the
            parameter's name at each parameter attribute read outside forward, it materialises the
            parameter's unit and returns what the slot then holds, so that an init reaching
            another unit's parameters through attributes writes full tensors, not shards.
        breaks_at_forward_start: Dynamo's count of data-dependent graph breaks in this process
            when the running compiled forward started (``templates.parent_islands``: a unit called
            after one more, from eager code, sits in a routing loop).
    """

    gathering: bool = False
    grad_mode: str = GRAD_SYNC
    tracing_unit: bool = False
    substituted: bool = False
    inline_every_unit: bool = False
    init_read: Callable[[nn.Module, str], torch.Tensor] | None = None
    breaks_at_forward_start: int = 0

    @contextlib.contextmanager
    def scope(self, **flags: Any) -> Iterator[None]:
        """Set each field named in ``flags`` to its value for the ``with`` block, and put back the
        values it had on the way out (an exception included), so scopes nest.

        Raises:
            TypeError: a name that is not a field of ``TraceState``.
            ValueError: a ``grad_mode`` that is not one of ``GRAD_MODES``.
        """
        unknown = sorted(set(flags) - {field.name for field in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"TraceState has no field {unknown[0]!r}")
        if "grad_mode" in flags and flags["grad_mode"] not in GRAD_MODES:
            raise ValueError(f"grad_mode {flags['grad_mode']!r} is not one of {GRAD_MODES}")
        previous = {name: getattr(self, name) for name in flags}
        for name, value in flags.items():
            setattr(self, name, value)
        try:
            yield
        finally:
            for name, value in previous.items():
                setattr(self, name, value)


# the one instance every module reads (``from ..shard.trace_state import TRACE``)
TRACE = TraceState()
