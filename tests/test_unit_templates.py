"""``Config(unit_templates=True)``: each kind of unit is traced, partitioned and lowered
once and every unit calls it, with the same collectives placed around it and the same numbers.

Parity against single-process eager training (fp32, 1e-5) on two gloo ranks; structure in one
rank of a fake world (the collective schedule equals the untemplated build's, one template per
kind); look-alike blocks and untraceable blocks in a world of one."""
from __future__ import annotations

import copy
import functools
import gc
import operator
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerograph
from zerograph.dump.report import build_report, summary_markdown
from zerograph.errors import ShardingError
from zerograph.graph.ops import UNIT_BACKWARD, UNIT_CALL, UNIT_CALL_BACKWARD, UNIT_FORWARD
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.runtime.runtime import schedule_of
from zerograph.runtime.state import graphs_of, runtime_of_model, state_of

from .distributed import fake_rank
from .models import reference_training
from .test_parity import LR, STEPS, check_parity
from .workers_classes import unused_case

TEMPLATES = zerograph.Config(unit_templates=True)


@pytest.mark.parametrize("stage", [0, 3])
def test_templated_units_match_single_process_at_stages_0_and_3(training_run, stage: int) -> None:
    """Two gloo ranks, the tiny GPT, three AdamW steps: losses and parameters equal eager
    training on the global batch, and its two blocks were traced once. Templates are the default
    build's (``TEMPLATES`` is ``Config()``), so these are the session's ``training_run`` spawns,
    shared with tests/test_parity.py, not a spawn of their own."""
    assert TEMPLATES == zerograph.Config()
    reference = reference_training("gpt", STEPS, 4, LR)
    for result in training_run("gpt", stage):
        check_parity(result, reference)
        assert result["templates"] == 1, stage
        facts = result["graphs"][0]
        if stage == 3:
            assert {g["unit"] for g in facts["forward"]["gathers"]} >= {1, 2}  # each block's all-gather
            assert "reduce_scatter" in facts["backward"]["collectives"]
            assert facts["forward"]["saved_gathered"] == []  # released after forward, gathered again


def _gpt(blocks: int, templates: bool) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=blocks, n_embd=32, n_head=2, block_size=16))
    model = zerograph.compile(model, 3, config=zerograph.Config(unit_templates=templates))
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx).backward()
    return model


def _gpt_of_8(templates: bool) -> nn.Module:
    """Rank 0 of a fake world of 2: the stage-3 GPT of 8 identical blocks after one step."""
    with fake_rank(2):
        return _gpt(8, templates)


@pytest.fixture(scope="module")
def gpt_of_8():
    """``_gpt_of_8``, each build once for this file's tests (the templated one's for two)."""
    return functools.lru_cache(maxsize=None)(_gpt_of_8)


def test_the_traces_see_one_node_per_unit_and_the_partitioned_graphs_hand_each_units_activations_over(gpt_of_8) -> None:
    """Until the partition a block is one ``unit_call`` with one output (the joint holds no
    ``unit_forward`` and none of its 16 outputs); after it, the forward holds one ``unit_forward``
    per block, the backward one ``unit_backward`` per block that reads exactly its own block's
    saved activations (the blocks' backwards in reverse order), handed over as forward outputs in
    the backward's input order, and no saved tensor goes unread."""
    model = gpt_of_8(True)
    record = graphs_of(model)[0]
    (template,) = state_of(model).captured.templates
    joint, fwd, bwd = (record[kind].graph for kind in ("joint", "forward", "backward"))
    joint_targets = [n.target for n in joint.nodes]
    assert joint_targets.count(UNIT_CALL) == 8 and joint_targets.count(UNIT_CALL_BACKWARD) == 8
    assert UNIT_FORWARD not in joint_targets and UNIT_BACKWARD not in joint_targets
    assert not any(n.target in (UNIT_CALL, UNIT_CALL_BACKWARD) for g in (fwd, bwd) for n in g.nodes)
    forwards = [n for n in fwd.nodes if n.target is UNIT_FORWARD]
    backwards = [n for n in bwd.nodes if n.target is UNIT_BACKWARD]
    assert len(forwards) == len(backwards) == 8
    saved_inputs = [n for n in bwd.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    outputs = list(fwd.output_node().args[0])
    handed = outputs[len(outputs) - len(saved_inputs):]
    assert [n.meta["val"].shape for n in saved_inputs] == [n.meta["val"].shape for n in handed]
    assert all(n.users for n in saved_inputs)
    n_saved = len(template.output_metas) - template.n_outputs
    for backward, forward in zip(backwards, reversed(forwards)):
        producers = [handed[saved_inputs.index(n)] for n in backward.args[2]]
        assert [(p.target, p.args[0]) for p in producers] == [(operator.getitem, forward)] * n_saved
        assert [p.args[1] for p in producers] == list(range(template.n_outputs, template.n_outputs + n_saved))


class _ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _CheckpointedStack(nn.Module):
    """Three residual blocks, each under ``torch.utils.checkpoint`` (non-reentrant), as a user
    trades activation memory for a second forward. A block's output is the next one's input, so
    backward has it anyway: only the block's inner activations are the checkpoint's to recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


def test_checkpointed_units_recompute_their_activations_in_backward() -> None:
    """A unit under an activation checkpoint hands its backward no saved activation: the backward
    runs its ``unit_forward`` again (one per block), the forward saves no ``unit_forward`` output,
    and losses, gradients and parameters equal eager's exactly over two AdamW steps."""
    model, _ = _train_against_eager(_CheckpointedStack)
    assert len(state_of(model).captured.templates) >= 1
    record = graphs_of(model)[0]
    fwd, bwd = record["forward"].graph, record["backward"].graph
    assert sum(n.target is UNIT_FORWARD for n in bwd.nodes) == 3
    assert sum(n.target is UNIT_BACKWARD for n in bwd.nodes) == 3
    forwards = {n for n in fwd.nodes if n.target is UNIT_FORWARD}
    saved = list(fwd.output_node().args[0])[1:]
    assert not any(n.target is operator.getitem and n.args[0] in forwards and n.args[1] > 0 for n in saved)


class _WrittenOutputStack(nn.Module):
    """A block's output written in place before the next block reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x.mul_(2)
        return self.blocks[1](x).square().mean()


class _TwiceOnOneInput(nn.Module):
    """One block called twice on the same input (the two calls are identical: the partitioner
    merges them), the second time under a checkpoint when ``checkpointed``."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualBlock() for _ in range(2))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.blocks[0](x)
        b = self.blocks[1](a)
        c = checkpoint(self.blocks[1], a, use_reentrant=False) if self.checkpointed else self.blocks[1](a)
        return (b * c).mean()


@pytest.mark.parametrize("build", [_WrittenOutputStack, lambda: _TwiceOnOneInput(False), lambda: _TwiceOnOneInput(True)],
                         ids=["output written in place", "one block twice on one input", "the second under a checkpoint"])
def test_unit_calls_pair_with_their_backwards_whatever_happens_to_their_outputs(build) -> None:
    """Each unit's backward finds its own forward's activations when user code writes the unit's
    output in place, and when two identical calls of one block are merged into one (the
    backwards then share its activations): losses and gradients equal eager's over two steps
    (fp32, 1e-6: a gradient that sums two paths may add them in another order)."""
    torch.manual_seed(0)
    reference = build()
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss, expected = model(x), reference(x)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7, msg=name)


class _GradientlessOutputs(nn.Module):
    """Blocks whose output gets no gradient: one's output unused, one's run under ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks[0](x)
        self.blocks[1](y)
        with torch.no_grad():
            constant = self.blocks[2](y)
        return (self.blocks[3](y) + constant).square().mean()


class _PassThrough(nn.Module):
    """A block whose input gradient is the incoming gradient itself (``fc(x) + y``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y


class _PassThroughStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_PassThrough() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, h)
        return h.square().mean()


@pytest.mark.parametrize("build", [_GradientlessOutputs, _PassThroughStack],
                         ids=["outputs without gradient", "gradient passed through"])
def test_units_whose_gradients_are_none_or_their_inputs_train_like_eager(build) -> None:
    """A unit whose output gets no gradient (unused, under ``no_grad``) leaves its parameters'
    ``.grad`` ``None`` as eager does (its flat shard's hook was handed ``None``: a TypeError
    before); a unit whose template returns the incoming gradient as an input's gradient returns
    a copy (a custom op's output may not alias its input: a RuntimeError before). Exact against
    eager over two AdamW steps."""
    _train_against_eager(build)


@pytest.mark.slow
def test_eight_identical_blocks_trace_one_template_and_keep_the_schedule(gpt_of_8) -> None:
    """A GPT of 8 blocks compiles the block's forward and backward once (one template, one
    unit_forward / unit_backward per block), and the forward's and backward's collectives, in
    order, with their sizes, dtypes and units, are exactly the untemplated build's."""
    model = gpt_of_8(True)
    templates = state_of(model).captured.templates
    record = graphs_of(model)[0]
    schedules = {kind: schedule_of(record[kind].graph, kind, "").entries for kind in ("forward", "backward")}
    calls = {kind: sum(n.target in (UNIT_FORWARD, UNIT_BACKWARD) for n in record[kind].graph.nodes)
             for kind in ("forward", "backward")}
    plain = graphs_of(gpt_of_8(False))[0]
    plain_schedules = {kind: schedule_of(plain[kind].graph, kind, "").entries for kind in ("forward", "backward")}
    assert len(templates) == 1
    assert calls == {"forward": 8, "backward": 8}
    assert schedules == plain_schedules
    assert sum(e.kind == "all_gather" for e in schedules["forward"]) >= 8


def _mlp_schedules(templates: bool) -> tuple[dict[str, list], int]:
    """Stage 3, rank 0 of a fake world of 2: the collective schedules of four identical
    Linear + ReLU units on an input that needs no gradient, and the number of templates traced."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(24, 24), nn.ReLU()) for _ in range(4)])
    config = zerograph.Config(unit_templates=templates, unit_classes=(nn.Sequential,))
    with fake_rank(2):
        model = zerograph.compile(model, 3, config=config)
        model(torch.randn(3, 24)).sum().backward()
        record = graphs_of(model)[0]
        schedules = {kind: schedule_of(record[kind].graph, kind, "").entries for kind in ("forward", "backward")}
    return schedules, len(state_of(model).captured.templates)


def test_an_input_without_gradient_is_not_differentiated() -> None:
    """The first unit's input needs no gradient, so its template computes none: its weight, which
    only that gradient reads, is not gathered again in backward (the untemplated build's schedule,
    three backward all-gathers for four units). Two templates: the first unit's, the others'."""
    schedules, n_templates = _mlp_schedules(templates=True)
    plain_schedules, _ = _mlp_schedules(templates=False)
    assert n_templates == 2
    assert schedules == plain_schedules
    assert sum(e.kind == "all_gather" for e in schedules["backward"]) == 3


class _MatmulBlock(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5, dtype=dtype) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class _MatmulChain(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_MatmulBlock(dtype), _MatmulBlock(dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.abs().float().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_complex_units_are_templated_and_match_eager(dtype: torch.dtype) -> None:
    """A complex unit keeps its template, and its gradients equal eager's, the first block's too:
    the second block's complex input needs a gradient, which the template once left out (complex
    is not floating point), so the first block's weight got none. World of one."""
    torch.manual_seed(0)
    reference = _MatmulChain(dtype)
    config = zerograph.Config(unit_templates=True, unit_classes=(_MatmulBlock,))
    model = zerograph.compile(copy.deepcopy(reference), 0, config=config)
    x = torch.randn(3, 5).to(dtype)
    model(x).backward()
    reference(x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    (kind,) = state_of(model).unit_kinds
    assert kind.inline_reason is None and len(kind.templates) == 2  # the first block's input needs no gradient


def test_the_flat_gradient_is_written_gradient_by_gradient_not_concatenated(gpt_of_8) -> None:
    """With a flat shard, the template's backward fills one buffer with each parameter's gradient
    right after the op that computes it (``unit_flat_grad``); autograd's ``cat`` of them all at the
    end, which held the unit's gradient twice, is gone. (Values: the parity tests.)"""
    model = gpt_of_8(True)
    (template,) = state_of(model).captured.templates
    graph = template.backward_graph.graph
    assert len(template.input_metas) == 2  # the block's primals: its input, then its flat shard
    flat_grad = graph.output_node().args[0][1]
    while flat_grad.target is torch.ops.aten.view.default:
        flat_grad = flat_grad.args[0]
    assert flat_grad.target is torch.ops.aten.empty.memory_format  # not a cat
    copies = [n for n in flat_grad.users if n.target is torch.ops.aten.slice.Tensor]
    assert len(copies) == sum(1 for _ in model.blocks[0].parameters())
    assert all([u.target for u in c.users] == [torch.ops.aten.copy_.default] for c in copies)


class _TaggedBlock(nn.Module):
    """``scale`` is read by ``forward``; ``tag`` (an init constant, as torchtitan's
    ``weight_init_std``) is not."""

    def __init__(self, scale: float, tag: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5) / 3)
        self.scale, self.tag = scale, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) * self.scale


@pytest.mark.parametrize("differ", ["tag", "scale"])
def test_units_differing_only_in_attributes_their_body_never_reads_share_one_trace(differ: str) -> None:
    """Two kinds of unit that differ in an attribute: one trace when the body never reads it, two
    when it does (the second block's scale in its graph). Gradients equal eager's. World of one."""
    torch.manual_seed(0)
    blocks = [_TaggedBlock(0.5, 0.1), _TaggedBlock(0.5 if differ == "tag" else 2.0, 0.2 if differ == "tag" else 0.1)]
    reference = nn.Sequential(*blocks)
    config = zerograph.Config(unit_templates=True, unit_classes=(_TaggedBlock,))
    model = zerograph.compile(copy.deepcopy(reference), 3, config=config)
    x = torch.randn(3, 5, requires_grad=True)  # each block's input needs a gradient: one template per kind
    model(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    kinds = state_of(model).unit_kinds
    assert len(kinds) == 2  # the signatures differ either way
    (first,), (second,) = (list(k.templates.values()) for k in kinds)
    assert (second.reused_from == first.id) == (differ == "tag")


@pytest.mark.parametrize("call", ["direct", "torch_compile"])
def test_a_templated_unit_called_alone_is_refused_as_without_templates(call: str) -> None:
    """Outside the model's forward a templated unit runs its body, which refuses the call with
    ``ShardingError`` (its parameters are this rank's shards there), as without templates; the
    template path would gather them eagerly, a collective only this rank joins."""
    torch.manual_seed(0)
    config = zerograph.Config(unit_templates=True, unit_classes=(_MatmulBlock,))
    model = zerograph.compile(_MatmulChain(torch.float32), 3, config=config)
    x = torch.randn(3, 5)
    model(x).backward()
    block = model.blocks[0] if call == "direct" else torch.compile(model.blocks[0], backend="eager")
    with pytest.raises(ShardingError, match="called on its own"):
        block(x)


class _Block(nn.Module):
    def __init__(self, width: int = 32, bias: bool = True, extra: bool = False, squash: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, width, bias=bias)
        self.out = nn.Linear(width, 16)
        self.gate = nn.Parameter(torch.full((16,), 0.5)) if extra else None
        self.squash = squash  # changes the control flow, not the parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(torch.relu(self.fc(x)))
        if self.squash:
            y = torch.tanh(y)
        return x + (y * self.gate if self.gate is not None else y)


class _LookAlikes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(), _Block(width=48), _Block(bias=False), _Block(extra=True),
                                     _Block(squash=True), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_look_alike_blocks_get_templates_of_their_own_and_keep_parity() -> None:
    """Blocks of one class that differ in width, bias, an extra parameter or a flag are five
    kinds (the three plain blocks share one); gradients equal eager's exactly (world of one). The
    plain kind has two templates: blocks.0's input needs no gradient, the others' do."""
    torch.manual_seed(0)
    reference = _LookAlikes()
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(4, 16)
    loss = model(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    assert loss.item() == expected.item()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=0, msg=name)
    kinds = state_of(model).unit_kinds
    assert sorted(len(k.units) for k in kinds) == [1, 1, 1, 1, 3]
    templates = state_of(model).captured.templates
    assert len(templates) == 6
    plain = next(k for k in kinds if len(k.units) == 3)
    input_grads = sorted(t.grad_mask[0] for t in plain.templates.values())
    assert input_grads == [False, True]  # one template computes no input gradient: blocks.0's
    # the dump's summary says which units share a template
    summary = summary_markdown(build_report(runtime_of_model(model), state_of(model).captured, None))
    assert "## Unit templates" in summary
    assert "| blocks.0, blocks.1, blocks.6 (3) |" in summary


_SHIFT = 0.0  # read by _ScaledBlock.forward: a module-level flag, as a model's USE_FLASH would be


class _ScaledBlock(nn.Module):
    """A block whose output scale is a class attribute and whose shift is a module global: a patch
    of either between two compiles changes what its body computes without changing any instance."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.scale + _SHIFT


class _ScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _traces_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kinds traced from here on (``template_cache.trace_unit`` calls)."""
    from zerograph.templates import template_cache as templates_module

    traced, real = [], templates_module.trace_unit

    def counting(kind, *args, **kwargs):
        traced.append(kind.name)
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(templates_module, "trace_unit", counting)
    return traced


def _train_against_eager(build, steps: int = 2) -> tuple[nn.Module, list[float]]:
    """Compile ``build()`` at stage 3 (world of one) and train it ``steps`` AdamW steps beside an
    eager copy; losses, gradients and parameters must equal eager's exactly. Returns the model
    and its losses."""
    torch.manual_seed(0)
    reference = build()
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, reference))
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss, expected = model(x), reference(x)
        loss.backward()
        expected.backward()
        assert loss.item() == expected.item(), step
        _grads_equal(model, reference)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(loss.item())
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=0, msg=name)
    return model, losses


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_second_model_of_the_same_structure_reuses_the_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The templates a model traced serve the next model of the same structure in the process
    (``template_cache.shared_template``): it traces nothing, its templates are copies that name the
    original, and it trains exactly as eager does; a class attribute or a module global its
    ``forward`` reads, patched between two compiles (what its body computes changed), makes the
    next model trace again, and train as the patched eager model does."""
    torch._dynamo.reset()
    traced = _traces_counted(monkeypatch)
    first, first_losses = _train_against_eager(_ScaledStack)
    assert traced == ["blocks.0", "blocks.0"]  # one kind: blocks.0's input needs no gradient, the others' do
    originals = {t.id for t in state_of(first).captured.templates}
    traced.clear()
    second, second_losses = _train_against_eager(_ScaledStack)
    assert traced == []
    copies = state_of(second).captured.templates
    assert copies and {t.reused_from for t in copies} <= originals and all(t.trace_seconds == 0 for t in copies)
    assert second_losses == first_losses
    summary = summary_markdown(build_report(runtime_of_model(second), state_of(second).captured, None))
    assert "copy of" in summary
    monkeypatch.setattr(_ScaledBlock, "scale", 3.0)
    traced.clear()
    _, patched_losses = _train_against_eager(_ScaledStack)  # exact against the patched eager model
    assert traced and patched_losses != first_losses
    monkeypatch.setitem(globals(), "_SHIFT", 0.5)
    traced.clear()
    _, shifted_losses = _train_against_eager(_ScaledStack)
    assert traced and shifted_losses != patched_losses


SETTINGS = {"scale": 1.0}  # a settings dict read in _SettingsBlock.forward


def _scaled_tanh(alpha: float):
    def act(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * alpha
    return act


class _ClosureBlock(nn.Module):
    """Blocks that differ only in a closure's captured value (``self.act``)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = _scaled_tanh(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class _SettingsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * SETTINGS["scale"]


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _patched_forward(module: nn.Module, factor: float) -> nn.Module:
    """``module`` with a ``forward`` of its own instance: the class's, times ``factor`` (a bound
    method, so that a deep copy of the model calls its own copy of ``module``)."""
    cls_forward = type(module).forward
    module.forward = types.MethodType(lambda self, x: cls_forward(self, x) * factor, module)
    return module


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_what_a_body_reads_beyond_its_class_keeps_units_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by trying to break templates (each gave another unit's or model's numbers before):
    closures that differ only in a captured value, a settings dict read in ``forward`` and changed
    between two compiles, a submodule's ``forward`` set on its instance (in one block, then in
    every block of a later model), and a unit's own instance ``forward`` (not templated: inline).
    Each model trains exactly as its eager copy."""
    torch._dynamo.reset()
    _train_against_eager(lambda: _Stack([_ClosureBlock(1.0), _ClosureBlock(5.0), _ClosureBlock(1.0)]))
    _train_against_eager(lambda: _Stack([_ClosureBlock(7.0), _ClosureBlock(7.0)]))
    _train_against_eager(lambda: _Stack([_SettingsBlock(), _SettingsBlock()]))
    monkeypatch.setitem(SETTINGS, "scale", 4.0)
    _train_against_eager(lambda: _Stack([_SettingsBlock(), _SettingsBlock()]))
    _train_against_eager(lambda: _Stack([_ScaledBlock(), _ScaledBlock()]))
    _train_against_eager(lambda: _Stack([_ScaledBlock(), _ScaledBlock()]))
    _train_against_eager(lambda: _Stack([_ScaledBlock(), _patched_forward(_ScaledBlock(), -1.0), _ScaledBlock()]))
    _train_against_eager(lambda: _Stack([_ClosureBlock(1.0)] + [_ClosureBlock(1.0) for _ in range(2)]))
    for unit in range(3):  # a submodule's forward set on its instance, in every block
        def build(unit=unit):
            blocks = [_ClosureBlock(1.0) for _ in range(3)]
            _patched_forward(blocks[unit].fc, 2.0)
            return _Stack(blocks)
        _train_against_eager(build)


class _ModeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if self.training else 3.0)  # what dropout does, deterministically


def _grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:  # unused in this step (a branch not taken): no gradient, as in eager
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_train_and_eval_get_templates_of_their_own() -> None:
    """``model.eval()`` after a training step traces the eval body, and a backward in eval
    differentiates that body; one unit switched alone runs its own mode (the op carries each
    unit's training flags, so Dynamo guards on them)."""
    torch.manual_seed(0)
    reference = nn.Sequential(_ModeBlock(), _ModeBlock())
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    model.eval()
    reference.eval()
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    _grads_equal(model, reference)
    model[1].train()
    reference[1].train()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    # train and eval, each for an input without and with a gradient (unit 0's input needs none;
    # unit 1 back in train, under no_grad, reuses unit 0's train template)
    assert len(state_of(model).captured.templates) == 4
    keys = [(key.mode, key.arg_grads) for key in state_of(model).unit_kinds[0].templates]
    assert len({mode for mode, _ in keys}) == 2 and sorted(arg_grads for _, arg_grads in keys) == [0, 0, 1, 1]


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _ModeBlock()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.inner(x))


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_submodule_switched_alone_runs_its_own_mode() -> None:
    """The unit's mode is refreshed from every submodule's flag before each forward
    (``templates.kinds.refresh_unit_modes``): ``eval()`` of one submodule of one unit is seen."""
    torch.manual_seed(0)
    reference = nn.Sequential(_Outer(), _Outer())
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    model[0].inner.eval()
    reference[0].inner.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_backward_after_the_model_is_freed() -> None:
    """The graphs that call a template keep it alive: a backward may run after the compiled model
    itself was dropped."""
    torch.manual_seed(0)
    loss = zerograph.compile(nn.Sequential(_Block(), _Block()), 3, config=TEMPLATES)(torch.randn(4, 16)).sum()
    gc.collect()
    loss.backward()


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
@pytest.mark.parametrize("stage", [0, 3])  # one input per parameter; a flat shard per unit
def test_parameters_the_loss_never_reaches_keep_no_gradient(stage: int) -> None:
    """A unit that runs a layer and discards its output (``SideBlock.aux``): eager leaves that
    layer's ``.grad`` ``None``, so AdamW skips it; a template's backward gave it zeros, which
    AdamW's weight decay then shrank. Three steps, the second with an unsynced micro-batch
    (``test_correctness_classes``' case, here in a world of one): the ``None`` set of every step
    and the parameters equal eager's."""
    result = unused_case(0, 1, stage, TEMPLATES)
    ours, reference = result["ours"], result["reference"]

    def none_sets(run: dict) -> list[set[str]]:
        return [{name for name, grad in step.items() if grad is None} for step in run["grads"]]

    assert none_sets(ours) == none_sets(reference) and "blocks.0.aux.weight" in none_sets(reference)[0]
    assert result["inline_reasons"] and not any(result["inline_reasons"])  # the templates ran
    for name, value in reference["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-6, atol=1e-6, msg=name)


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_unit_without_parameters_keeps_its_template_under_no_grad() -> None:
    """Under ``torch.no_grad()`` nothing a parameterless unit takes needs a gradient: its
    template is forward only (before, its trace asked autograd for the gradient of nothing, and
    the kind fell back to running inline)."""
    model = zerograph.compile(nn.Sequential(nn.Linear(4, 4), _Scale(), nn.Linear(4, 4)), 0,
                              config=zerograph.Config(unit_templates=True, unit_classes=(_Scale, nn.Linear)))
    with torch.no_grad():
        model(torch.randn(2, 4))
    kinds = state_of(model).unit_kinds
    assert len(kinds) == 2 and all(kind.inline_reason is None for kind in kinds)


def test_templates_are_the_default_except_with_an_activation_budget() -> None:
    """The activation plan moves a unit's activations op by op; a templated unit is one op, and
    the budget was exceeded (measured): by default a budget turns templates off, and asking for
    both is refused before anything compiles."""
    assert zerograph.Config().unit_templates is True
    budget = zerograph.ActivationPolicy(budget_bytes=1 << 20)
    assert zerograph.Config(activations=budget).unit_templates is False
    assert zerograph.Config(unit_templates=False).unit_templates is False
    with pytest.raises(zerograph.ConfigError, match="unit_templates with activations.budget_bytes"):
        zerograph.Config(unit_templates=True, activations=budget)


def test_config_refuses_a_non_bool() -> None:
    with pytest.raises(zerograph.ConfigError, match="unit_templates"):
        zerograph.Config(unit_templates="yes")


class _BlocksGradient(torch.autograd.Function):
    """Identity forward whose backward returns no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        return None


class _CutAfterFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Block(), _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_BlocksGradient.apply(self.first(x)) + x).square().mean()


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_unit_whose_output_gets_no_gradient_trains_as_eager() -> None:
    """A frozen unit whose output no gradient reaches (a Function whose backward returns None):
    its backward gets None for every output and returns none (its saved activations carry no
    zero gradients since ``set_materialize_grads(False)``; all-None once raised StopIteration)."""
    torch.manual_seed(0)
    reference = _CutAfterFirst()
    reference.first.requires_grad_(False)
    model = zerograph.compile(copy.deepcopy(reference), 3, config=zerograph.Config(unit_classes=(_Block,)))
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model(x).backward()
    reference(x_ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    _grads_equal(model, reference)
    assert all(kind.inline_reason is None for kind in state_of(model).unit_kinds)


def test_a_unit_ops_fake_outputs_belong_to_its_inputs_fake_mode() -> None:
    """The unit ops' fake implementation makes its outputs as meta tensors wrapped into the
    inputs' fake mode (not through that mode's dispatch): each output is a ``FakeTensor`` of that
    very mode, on the inputs' device, with the shape, stride and dtype asked; without fake inputs
    (meta tensors) it makes plain tensors on their device."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from zerograph.graph.ops import _empty_like_meta

    metas = [((2, 3), (3, 1), torch.float32), ((3, 2), (1, 3), torch.bfloat16), ((), (), torch.int64)]
    mode = FakeTensorMode()
    with mode:
        like = torch.empty(4)
        outputs = _empty_like_meta(like, metas)
    for output, (shape, stride, dtype) in zip(outputs, metas, strict=True):
        assert isinstance(output, FakeTensor) and output.fake_mode is mode
        assert (tuple(output.shape), output.stride(), output.dtype, output.device) == (shape, stride, dtype, like.device)
    with mode:  # usable as the mode's own tensors
        assert (outputs[0] @ outputs[1].float()).shape == (2, 2)
    meta_outputs = _empty_like_meta(torch.empty(4, device="meta"), metas)
    assert [(type(t), t.device.type, tuple(t.shape), t.stride(), t.dtype) for t in meta_outputs] == [
        (torch.Tensor, "meta", shape, stride, dtype) for shape, stride, dtype in metas]
