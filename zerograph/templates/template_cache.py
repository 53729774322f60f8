"""The process-wide cache of traced unit templates, and the trace of a kind's body in a thread.

``shared_template`` hands a unit kind a template: a copy of one traced before in this process for
a unit with the same ``template_keys.trace_key`` (and the same values of the attributes that trace
read), or a new trace (``trace_template``), or why the trace failed (``TraceFailure``). Split
from ``templates/kinds.py``, which decides which units share a template, when one is asked for and
where a kind's units run after a failure; this module names a kind by what a trace reads of it
(``unit_trace.TracedKind``), so the two do not import each other.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.utils._sympy.symbol import SymT, symbol_is_type

from ..errors import ShardingError
from ..graph import registry
from .template_keys import read_values, trace_key
from .unit_trace import TensorMeta, TracedKind, UnitTemplate, trace_unit

# what a fake-tensor trace raises at a body's data-dependent control flow or output shape
DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


@dataclasses.dataclass(frozen=True)
class TraceFailure:
    """Why a body's trace failed, for its kind to leave the templates (``UnitKind.leave``).

    Attributes:
        reason: the error's type and first line (at most 300 characters).
        data_dependent: the trace met control flow or an output shape that depends on the data
            (``DATA_DEPENDENT``, ``made_data_dependent_values``): the kind's units run as islands.
        no_grad: the parameters (slot order) autograd's pass left without a gradient, where it
            ran before the failure (a partition or a write check failed); ``None`` where it did not.
    """

    reason: str
    data_dependent: bool
    no_grad: frozenset[int] | None


def made_data_dependent_values(shape_env: ShapeEnv | None) -> bool:
    """Whether a body's trace on ``shape_env`` made an unbacked symbol (a ``nonzero``'s length, an
    ``item()``, a ``tolist()``; the primals make none): a trace that then failed, whatever the
    error (a ``set`` of expert ids raises ``TypeError``), met control flow that depends on the data,
    which Dynamo would split where ranks differ."""
    if shape_env is None:
        return False
    return any(symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)) for s in shape_env.var_to_range)


# Templates any model in this process traced, by everything their trace reads: ``trace_key`` with
# attribute names only, and the values of the attributes the trace read (``read_values``). Another
# unit kind of the same structure (the next layer of a torchtitan Llama, whose init constant
# differs; another stage, a model built again, the next case of a test or of a benchmark) calls
# copies of their graphs instead of tracing again. Least recently used out first; an entry holds a
# forward and a backward graph of one unit. ``_READS``: per key, the attribute sets traces read.
_TRACED: collections.OrderedDict[tuple, UnitTemplate] = collections.OrderedDict()
_READS: dict[tuple, list[frozenset[tuple[int, str]] | None]] = {}
TRACED_LIMIT = 64


def shared_template(kind: TracedKind, metas: tuple[TensorMeta, ...], mode: int, arg_grads: int, call: int,
                    device: torch.device) -> UnitTemplate | TraceFailure:
    """``kind``'s template for ``metas``, ``mode``, ``arg_grads`` and ``call``: a copy of one this process
    traced before for a unit that matches ``trace_key`` in all but the values of the attributes
    that trace did not read (``_TRACED``; the same graphs and lowered callables,
    a template id and unit names of its own, ``reused_from`` naming the original), or a new trace
    (``trace_template``, which returns or raises as documented there). Source: the reuse Dynamo's cache gives
    FSDP2 + ``torch.compile`` of identical blocks, kept across models."""
    loose = trace_key(kind.module, kind.lowering, metas, mode, arg_grads, device, call, values=False)
    key = next((k for reads in _READS.get(loose, ()) if (k := (loose, read_values(kind.module, reads))) in _TRACED),
               None)
    if key is None:
        traced = trace_template(kind, metas, mode, arg_grads, call, device)
        if isinstance(traced, TraceFailure):
            return traced
        seen = _READS.setdefault(loose, [])
        if traced.read_attrs not in seen:
            seen.append(traced.read_attrs)
        _TRACED[loose, read_values(kind.module, traced.read_attrs)] = traced
        if len(_TRACED) > TRACED_LIMIT:
            (out, _), _ = _TRACED.popitem(last=False)
            if not any(k[0] == out for k in _TRACED):  # the attribute sets of a key no entry has
                del _READS[out]
        return traced
    traced = _TRACED[key]
    _TRACED.move_to_end(key)
    template = dataclasses.replace(traced, id=registry.next_template_id(), kind=kind.kind, units=kind.units,
                                   trace_seconds=0.0, reused_from=traced.id)
    registry.register_template_as(template.id, template)
    return template


def trace_template(kind: TracedKind, metas: tuple[TensorMeta, ...], mode: int, arg_grads: int, call: int,
                   device: torch.device) -> UnitTemplate | TraceFailure:
    """Trace ``kind``'s body for primals of ``metas`` passed as call ``call`` (``unit_calls``), with
    its submodules' training flags set from ``mode``, differentiating the floating-point arguments of ``arg_grads``'s bits and the
    trainable parameters: forward + backward on fake tensors, the min-cut partitioner, lowering. Runs in a
    thread of its own: it is called from the op's fake implementation inside Dynamo's and
    AOTAutograd's traces, below autograd and under their fake modes, and the trace needs autograd
    and a fake mode of its own.

    Returns the template, or a ``TraceFailure`` where the body cannot be a template (it returns
    an object other than tensors in tuples, lists and dicts beside constants, cannot be traced on
    fake tensors, e.g. data-dependent control flow, or writes an input or buffer in place).

    Raises:
        ShardingError: the body writes a parameter in place (refused inline as well).
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["template"] = trace_unit(kind, metas, mode, arg_grads, call, device, outcome)
        except BaseException as exc:  # handed to the calling thread
            outcome["error"] = exc

    worker = threading.Thread(target=run, name=f"zerograph-trace-{kind.name}")
    worker.start()
    worker.join()
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, ShardingError):  # refused inline too (an in-place parameter write)
            raise error
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        data_dependent = isinstance(error, DATA_DEPENDENT) or made_data_dependent_values(outcome.get("shape_env"))
        return TraceFailure(reason, data_dependent, outcome.get("no_grad"))
    return outcome["template"]
