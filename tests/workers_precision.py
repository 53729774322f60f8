"""Rank workers and single-process references for mixed precision and gradient accumulation.
Workers run on ranks spawned by ``tests.distributed.spawn``, train a fresh model per case one
after the other (``torch._dynamo.reset()`` between them) and return plain data; a case that
raises returns its traceback instead, so it fails only its own tests.

Mixed precision references:
- the GPT against single-process fp32 training (``tests.models.reference_training``), within bf16
  tolerance (``test_precision`` says why);
- the batch-norm model and the graph-break MLP against a single-process *emulation* of
  zerograph's mixed precision (``mixed_reference``), which casts the fp32 master weights to bf16
  for each rank's forward (batch norms excepted, ``MixedPrecisionPolicy.full_precision_classes``), keeps each
  rank's own batch-norm statistics (no SyncBatchNorm, DDP's semantics, as in
  ``workers_patterns2``), sums the ranks' gradients in fp32 and divides by the world size: the
  same arithmetic, so it can be compared tightly, buffers included.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.func import functional_call

import zerograph
from tests.distributed import run_case_in_step
from zerograph.graph.ops import ACCUMULATE_UNSYNCED, TAKE_UNSYNCED
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG
from zerograph.runtime.state import graphs_of, runtime_of_model

from .models import build as build_named
from .models import global_batch, rank_slice
from .training import train_steps

MIXED = zerograph.Config(mixed_precision=zerograph.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32))
STEPS, LR, BATCH = 3, 1e-3, 4  # as the parity tests: 3 AdamW steps on a global batch of 4


def _guarded(fn: Callable[..., dict], *args: object) -> dict | str:
    torch._dynamo.reset()  # a fresh model per case: Dynamo keeps at most 8 graphs per code object
    return run_case_in_step((fn.__name__, *args[2:]), fn, *args)


def collectives(gm: fx.GraphModule) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(kind, dtype moved, units)`` of every collective of a captured graph, in graph order:
    an all-gather's output, a reduction's input (the dtype it reduces in)."""
    found = []
    for node in gm.graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target)
        if kind is not None:
            val = node.meta["val"] if kind == "all_gather" else node.args[0].meta["val"]
            found.append((kind, str(val.dtype).removeprefix("torch."), tuple(node.meta[TAG]["units"])))
    return found


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor as a copy of its own: ``full_tensor()`` of a replicated DTensor (a 0-d
    parameter) returns the local tensor itself, which the next optimizer step changes in place."""
    return t.full_tensor().clone()


def _dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def _optimizer_state_dtypes(opt: torch.optim.Optimizer) -> list[str]:
    return _dtypes(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())


# == mixed precision: the GPT ======================================================================

def train_gpt(rank: int, world_size: int, stage: int, config: zerograph.Config) -> dict:
    model = zerograph.compile(build_named("gpt"), stage=stage, config=config)
    seen: dict = {}

    def read_grads(step: int, opt: torch.optim.Optimizer) -> None:
        if step == 0:
            seen["first_grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        if step == STEPS - 1:
            seen["stats"] = zerograph.stats(model, opt)
            seen["grad_dtypes"] = _dtypes(p.grad for p in model.parameters())

    def loss_of(step: int) -> torch.Tensor:
        loss = model(*rank_slice(global_batch("gpt", step, BATCH), rank, world_size))
        seen["loss_dtype"] = str(loss.dtype).removeprefix("torch.")
        return loss

    opt, losses = train_steps(model, loss_of, STEPS, LR, after_backward=read_grads)
    first_grads, stats, grad_dtypes = seen["first_grads"], seen["stats"], seen["grad_dtypes"]
    record = graphs_of(model)[0]
    return {
        "losses": losses,
        "loss_dtype": seen["loss_dtype"],
        "first_grads": first_grads,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "param_dtypes": _dtypes(model.parameters()),
        "grad_dtypes": grad_dtypes,
        "optimizer_state_dtypes": _optimizer_state_dtypes(opt),
        "stats": stats,
        "collectives": {kind: collectives(record[kind]) for kind in ("forward", "backward")},
    }


# == mixed precision: batch norm and a constant buffer =============================================

class BatchNormNet(nn.Module):
    """Linear(7, 8) -> BatchNorm1d(8) -> tanh -> Linear(8, 3), one unit each, then the output is
    scaled by a registered constant buffer (fp32) in an fp32 loss. The caller passes ``x`` in the
    compute dtype: zerograph, like the model, leaves input dtypes alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        self.register_buffer("out_scale", torch.tensor([0.5, 2.0, 1.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)  # (B, 3) in param_dtype
        return ((out.float() * self.out_scale - y) ** 2).mean()


BN_BATCH = 8  # 4 rows per rank: batch statistics over more than one row


def build_bn() -> BatchNormNet:
    torch.manual_seed(0)
    return BatchNormNet()


def bn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(BN_BATCH, 7, generator=g), torch.randn(BN_BATCH, 3, generator=g)


def full_precision_names(model: nn.Module) -> set[str]:
    """Parameters ``MixedPrecisionPolicy.full_precision_classes`` (batch norms, by default) keep in fp32."""
    classes = zerograph.Config().mixed_precision.full_precision_classes
    return {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, classes)
            for n, _ in mod.named_parameters(recurse=False)}


def mixed_reference(build: Callable[[], nn.Module], batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                    world_size: int) -> dict:
    """Single-process emulation of a mixed-precision run (module docstring): ``STEPS`` AdamW
    steps; ``x`` is passed in bf16, as the workers do. ``buffers``: each rank's, after training."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    keep = full_precision_names(model)
    buffers = [{n: b.detach().clone() for n, b in model.named_buffers()} for _ in range(world_size)]
    losses = []
    for step in range(STEPS):
        total = 0.0
        for rank in range(world_size):
            x, y = rank_slice(batch(step), rank, world_size)
            # a fresh bf16 copy per rank: its gradient reaches the fp32 master as fp32 (the sum of
            # the ranks' gradients happens in fp32, as in the reduction)
            params = {n: p if n in keep else p.to(torch.bfloat16) for n, p in model.named_parameters()}
            # floating-point targets in bf16 too: MixedPrecisionPolicy.cast_forward_inputs (default on)
            y = y.to(torch.bfloat16) if y.is_floating_point() else y
            loss = functional_call(model, {**params, **buffers[rank]}, (x.to(torch.bfloat16), y))
            loss.backward()
            total += loss.item()
        for p in model.parameters():
            p.grad.div_(world_size)
        opt.step()
        opt.zero_grad()
        losses.append(total / world_size)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": buffers}


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch("mlp", step, BATCH)


def train_mixed(rank: int, world_size: int, name: str, stage: int) -> dict:
    """``"bn"`` (BatchNormNet) or ``"mlp_break"`` (a graph break: eager frames gather and reduce
    through the runtime's fallback), mixed precision, ``x`` passed in bf16."""
    build, batch = (build_bn, bn_batch) if name == "bn" else (lambda: build_named(name), mlp_batch)
    model = zerograph.compile(build(), stage=stage, config=MIXED)
    seen: dict = {}

    def loss_of(step: int) -> torch.Tensor:
        x, y = rank_slice(batch(step), rank, world_size)
        return model(x.to(torch.bfloat16), y)

    def read_grads(step: int, opt: torch.optim.Optimizer) -> None:
        if step == STEPS - 1:
            seen["grad_dtypes"] = _dtypes(p.grad for p in model.parameters())

    _, losses = train_steps(model, loss_of, STEPS, LR, after_backward=read_grads)
    grad_dtypes = seen["grad_dtypes"]
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "param_dtypes": _dtypes(model.parameters()),
        "grad_dtypes": grad_dtypes,
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "units": [unit.name for unit in runtime_of_model(model).units],
        "collectives": {kind: collectives(graphs_of(model)[0][kind])
                        for kind in ("forward", "backward")},
    }


def precision_runs(rank: int, world_size: int, stages: tuple[int, ...]) -> dict:
    """Every mixed-precision case of ``test_precision`` on this rank, keyed by (case, stage)."""
    out: dict = {}
    for stage in stages:
        out["gpt", stage] = _guarded(train_gpt, rank, world_size, stage, MIXED)
        out["bn", stage] = _guarded(train_mixed, rank, world_size, "bn", stage)
    out["mlp_break", 3] = _guarded(train_mixed, rank, world_size, "mlp_break", 3)
    return out


# == gradient accumulation =========================================================================

D = 9  # odd: every (D, ...) parameter is padded at world size 2


class AccumNet(nn.Module):
    """Three Linear(9, 9) units, the last one's weight and bias tied to the first's (gradients of
    two uses summed before one reduction), and a 0-d learned scale in the root unit (all-reduced)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)])
        self.layers[2].weight = self.layers[0].weight
        self.layers[2].bias = self.layers[0].bias
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h))
        return ((self.scale * self.layers[2](h) - y) ** 2).mean()


MICRO, MICRO_BATCH, ACC_STEPS = 4, 4, 2  # micro-batches per optimizer step, global rows each, steps


def _scale_accumulated(param: torch.Tensor) -> None:
    """A post-accumulate-grad hook that edits ``.grad`` in place: eager scales the sum accumulated
    so far after every micro-batch, so the step's gradient weighs earlier micro-batches less."""
    param.grad.mul_(0.5)


def build_acc(name: str) -> nn.Module:
    if name in ("accum", "accum_hooked"):
        torch.manual_seed(0)
        model = AccumNet()
        if name == "accum_hooked":  # registered before compile: the shards carry them
            model.layers[1].weight.register_post_accumulate_grad_hook(_scale_accumulated)
            model.layers[1].bias.register_hook(lambda grad: grad.clamp(-0.01, 0.01))  # nonlinear: per micro-batch
        return model
    return build_named(name)  # "mlp_break": a graph break, so eager frames accumulate too


def micro_batch(name: str, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + 10 * step + micro)
    d_in, d_out = (D, D) if name.startswith("accum") else (7, 3)
    return torch.randn(MICRO_BATCH, d_in, generator=g), torch.randn(MICRO_BATCH, d_out, generator=g)


def accumulation_reference(name: str) -> dict:
    """Single process, eager: each step's loss is the mean of its micro-batch losses (so the
    gradient of the full batch), accumulated micro-batch by micro-batch into ``.grad``."""
    model = build_acc(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    grads, params = [], []
    for step in range(ACC_STEPS):
        for micro in range(MICRO):
            (model(*micro_batch(name, step, micro)) / MICRO).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"grads": grads, "params": params}


def _count(gm: fx.GraphModule, target: object) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


def train_accumulating(rank: int, world_size: int, name: str, stage: int, sync_every_micro_batch: bool) -> dict:
    """``ACC_STEPS`` optimizer steps of ``MICRO`` micro-batches. Without sync on the inner
    micro-batches, step 0 uses ``set_requires_gradient_sync`` and step 1 the ``no_sync()`` context."""
    model = zerograph.compile(build_acc(name), stage=stage)
    runtime = runtime_of_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    grads, params, comm, unsynced, warned = [], [], [], [], []
    for step in range(ACC_STEPS):
        for micro in range(MICRO):
            inner = micro < MICRO - 1 and not sync_every_micro_batch
            if step == 0:
                model.set_requires_gradient_sync(not inner)
            context = model.no_sync() if step == 1 and inner else contextlib.nullcontext()
            with context, warnings.catch_warnings(record=True) as caught:  # the mode is fixed by the forward
                warnings.simplefilter("always")
                loss = model(*rank_slice(micro_batch(name, step, micro), rank, world_size)) / MICRO
            warned.append([str(w.message) for w in caught if issubclass(w.category, zerograph.SyncedForHooksWarning)])
            loss.backward()
            comm.append(dict(zerograph.stats(model).comm_elements))
            unsynced.append(runtime.grad_buffers.unsynced_bytes())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        params.append({n: _full(p) for n, p in model.named_parameters()})
    backward = [rec["backward"] for rec in graphs_of(model) if "backward" in rec]
    return {
        "grads": grads,
        "params": params,
        "comm": comm,
        "unsynced_bytes": unsynced,
        "synced_for_hooks_warnings": warned,
        "trainable_bytes": sum(p.numel() * 4 for p in model.parameters()),  # full fp32 gradients
        "graphs": len(graphs_of(model)),
        "backward": [{"collectives": collectives(gm), "accumulate": _count(gm, ACCUMULATE_UNSYNCED),
                      "take": _count(gm, TAKE_UNSYNCED)} for gm in backward],
        "num_params": len(list(model.parameters())),
    }


def accumulation_runs(rank: int, world_size: int, cases: tuple[tuple[str, int, bool], ...]) -> dict:
    """Every accumulation case of ``test_accumulation``: ``(model name, stage, sync every micro-batch)``."""
    return {case: _guarded(train_accumulating, rank, world_size, *case) for case in cases}
