"""The saved activations ``zerograph.plan`` predicts: eager autograd's (``saved_activation_bytes``)
and the compiled step's (``compiled_saved_activation_bytes``), both from one forward on fake tensors.

Fake tensors of the device the model will run on, not ``meta``: on ``meta`` attention takes the
math path and saves the (B, heads, T, T) probabilities that CPU's and CUDA's fused kernels do not.
Source: ``torch.autograd.graph.saved_tensors_hooks``; AOTAutograd's joint trace and
``min_cut_rematerialization_partition``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..errors import ConfigError
from ..templates.unit_trace import template_min_cut
from ..templates.unit_writes import functional_joint, save_random_values


def saved_activation_bytes(model: nn.Module, example_inputs: Sequence[object],
                           param_dtype: torch.dtype | None = None) -> int:
    """Bytes of the tensors eager autograd saves for backward in one ``model(*example_inputs)``.

    Runs the forward on fake tensors (``FakeTensorMode``: no storage allocated, no values read)
    of the device the model will run on (the first of the inputs' and parameters' devices that
    is not ``meta``; ``cpu`` when all are): each parameter and buffer is replaced by a fake
    tensor of its shape (floating parameters in ``param_dtype`` when given, as mixed precision
    computes), tensor inputs by fake tensors of theirs (floating ones in ``param_dtype``), through
    ``torch.func.functional_call``; a ``saved_tensors_hooks`` pack hook records every saved
    tensor's storage, each counted once, leaving out the parameters' and buffers' own storages
    (stage 3 saves only shards of them and gathers again).

    Raises:
        ConfigError: ``example_inputs`` is not a sequence, or the forward fails on fake tensors (a
            model that reads tensor values, e.g. ``.item()``), with the error it raised.
    """
    fake_mode, state, args = _fake_call(model, example_inputs, param_dtype)
    own = {t.untyped_storage()._cdata for t in state.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in own:
            saved[storage._cdata] = storage.nbytes()
        return t

    with _refused("forward"), fake_mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.func.functional_call(model, state, tuple(args), tie_weights=True, strict=False)
    return sum(saved.values())


def compiled_saved_activation_bytes(model: nn.Module, example_inputs: Sequence[object],
                                    param_dtype: torch.dtype | None = None) -> int:
    """Bytes of the activations a compiled step's forward saves for backward in one
    ``model(*example_inputs)``: the forward and backward traced into one joint graph (``make_fx``
    on the fake tensors ``saved_activation_bytes`` builds), cut as a unit template is cut
    (``unit_trace.template_min_cut``: views, cheap pointwise ops and layer norms recomputed in
    backward); the storages of the saved values, each once, the primals (parameters, buffers,
    inputs) left out. Below eager's; what the default build saves where every unit is a template. Units that run
    inline (autocast, a dynamic shape, a body that writes a buffer in place) are cut with the
    partitioner's defaults in the model's graph and save more (up to eager's).

    Raises:
        ConfigError: as ``saved_activation_bytes``; also when the joint trace or the partition fails.
    """
    fake_mode, state, args = _fake_call(model, example_inputs, param_dtype)
    names = list(state)
    tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(primals: list[torch.Tensor]) -> list[torch.Tensor]:
        values = list(args)
        for i, t in zip(tensor_args, primals[len(names):]):
            values[i] = t
        out = torch.func.functional_call(model, dict(zip(names, primals)), tuple(values), tie_weights=True,
                                         strict=False)
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> tuple[list, list]:
        outs = call(primals)
        wanted = [p for p in primals if p.requires_grad]
        return outs, list(torch.autograd.grad(outs, wanted, tangents, allow_unused=True))

    primals = [*state.values(), *(args[i] for i in tensor_args)]
    with _refused("joint trace"), fake_mode:
        tangents = [torch.empty_like(o) for o in call(primals)]
        graph = make_fx(joint)(primals, tangents)
    with _refused("partition"):  # functional and with random values saved, as a template's joint is
        graph = functional_joint(graph, primals, tangents, fake_mode)
        save_random_values(graph.graph)
        fwd, _ = template_min_cut(graph, primals, tangents)
    saved: dict[int, int] = {}
    for node in fwd.graph.output_node().args[0][len(tangents):]:
        val = node.meta.get("val") if node.op != "placeholder" else None
        if isinstance(val, torch.Tensor):
            saved[val.untyped_storage()._cdata] = val.untyped_storage().nbytes()
    return sum(saved.values())


def _fake_call(model: nn.Module, example_inputs: Sequence[object], param_dtype: torch.dtype | None):
    """A fake mode, fake parameters and buffers by name, and fake arguments (``saved_activation_bytes``)."""
    if isinstance(example_inputs, (str, bytes, torch.Tensor)) or not isinstance(example_inputs, Sequence):
        raise ConfigError(f"example_inputs must be a sequence of model arguments, got {type(example_inputs).__name__}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)] + list(model.parameters())
    device = next((t.device for t in tensors if t.device.type != "meta"), torch.device("cpu"))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def to_fake(t: torch.Tensor, cast: bool) -> torch.Tensor:
        dtype = param_dtype if cast and param_dtype is not None and t.is_floating_point() else t.dtype
        with fake_mode:
            return torch.empty(t.shape, dtype=dtype, device=device).requires_grad_(t.requires_grad and cast)

    state = {name: to_fake(p, True) for name, p in model.named_parameters()}
    state.update({name: to_fake(b, False) for name, b in model.named_buffers()})
    args = [to_fake(a, True).requires_grad_(False) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    return fake_mode, state, args


@contextlib.contextmanager
def _refused(what: str) -> Iterator[None]:
    """Re-raise any failure of a user's model in ``what`` as ``ConfigError``."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"example_inputs: the model's {what} failed on fake tensors, so its activations "
                          f"cannot be estimated ({type(exc).__name__}: {exc}); leave example_inputs out") from exc
