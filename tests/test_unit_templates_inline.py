"""Templated units that run inline instead (bad input for a template): a kind whose body a template
cannot stand for (shapes that change, autocast, data-dependent control flow, dropout, batch norm's
running statistics in training, a write to its own parameter) runs its body in the graph, keeps
eager's numbers and says why (``UnitKind.inline_reason``), and the graphs traced before the
fallback keep their templates. Split from tests/test_unit_templates.py, which covers the templates
themselves. Worlds of one, or rank 0 of a fake world of 2 for the collective schedules."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerograph
from zerograph.capture import compiled_model
from zerograph.errors import ShardingError
from zerograph.graph.ops import UNIT_FORWARD
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.runtime.runtime import schedule_of
from zerograph.runtime.state import graphs_of, state_of

from .distributed import fake_rank
from .test_unit_templates import TEMPLATES, _Block, _grads_equal


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
@pytest.mark.parametrize("static_shapes", [compiled_model.STATIC_SHAPES, 1])
def test_shapes_that_change_keep_parity(static_shapes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence length that changes between steps: within ``STATIC_SHAPES`` distinct shapes each
    is traced static with a template of its own; past them (here after one), Dynamo makes the
    length dynamic and the kind runs inline (a template is traced for static shapes). Eager's
    numbers either way."""
    monkeypatch.setattr(compiled_model, "STATIC_SHAPES", static_shapes)
    torch.manual_seed(0)
    reference = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    for length in (16, 8, 12):
        idx = torch.randint(0, 256, (2, length))
        model.zero_grad()
        reference.zero_grad()
        loss, expected = model(idx, idx), reference(idx, idx)
        loss.backward()
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    (kind,) = state_of(model).unit_kinds
    if static_shapes == 1:
        assert "dynamic shape" in kind.inline_reason
    else:
        assert kind.inline_reason is None and kind.exits == {} and len(kind.templates) == 3


class _ReadsUnreached(nn.Module):
    """A block whose ``extra`` its output never reaches (no gradient), read all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + self.extra.detach().sum() * 0


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_second_fallback_in_the_every_unit_inline_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic shape runs the forward again with every unit inline, where the inline body reads
    ``extra`` through its flat shard (which the template left without a gradient): the kind falls
    back a second time and the forward is traced a third time, still every unit inline. That third
    trace once failed entering the inline context it had used up (``AttributeError`` from
    ``contextlib``). Eager's numbers, and both exits counted."""
    monkeypatch.setattr(compiled_model, "STATIC_SHAPES", 1)
    torch.manual_seed(0)
    reference = nn.Sequential(_ReadsUnreached(), _ReadsUnreached(), _ReadsUnreached())
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    for length in (16, 8):
        x = torch.randn(2, length, 8)
        model.zero_grad()
        reference.zero_grad()
        loss, expected = model(x).sum(), reference(x).sum()
        loss.backward()
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if q.grad is None:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    (kind,) = state_of(model).unit_kinds
    assert kind.path()["path"] == "inline" and len(kind.exits) == 2
    assert any("dynamic shapes" in reason for reason in kind.exits)


def _symbolic(graph: torch.fx.Graph) -> bool:
    """Whether any input of a Dynamo graph has a symbolic size (Dynamo made a dim dynamic)."""
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        sizes = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return True
    return False


def _gpt_on_lengths(config: GPTConfig, templates: bool, lengths: tuple[int, ...],
                    evaluate_around: bool = False) -> nn.Module:
    """Rank 0 of a fake world of 2: ``config``'s GPT at stage 3, one training step at each of
    ``lengths``. With ``evaluate_around``: a GPT of other shapes trained first (Dynamo keeps shape
    history per code location), and an eval at the first length before and after the steps."""
    with fake_rank(2):
        if evaluate_around:
            other = zerograph.compile(GPT(GPTConfig(n_layer=1, n_embd=8, n_head=2, block_size=4)), 3,
                                      config=TEMPLATES)
            other(*[torch.randint(0, 256, (3, 4))] * 2).backward()
        torch.manual_seed(0)
        model = zerograph.compile(GPT(config), 3, config=zerograph.Config(unit_templates=templates))
        first = torch.randint(0, 256, (2, lengths[0]))

        def evaluate() -> None:
            model.eval()
            with torch.no_grad():
                model(first, first)
            model.train()

        if evaluate_around:
            evaluate()
        for length in lengths:
            idx = first if length == lengths[0] else torch.randint(0, 256, (2, length))
            model(idx, idx).backward()
        if evaluate_around:
            evaluate()
    return model


def _inline_gpt_config(dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16, dropout=dropout)


@pytest.fixture(scope="module")
def templated_gpt_on_two_lengths() -> nn.Module:
    """The templated GPT at lengths 16 then 8 (dynamic: one static shape allowed, not
    ``STATIC_SHAPES``), evaluated around its steps: one compile of each graph for
    test_a_dynamic_shape_leaves_the_static_graphs_their_templates and the dynamic-shapes case of
    test_units_that_run_inline_gather_again_in_backward (its evals add an inference graph, no
    backward one)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_model, "STATIC_SHAPES", 1)
        return _gpt_on_lengths(_inline_gpt_config(), True, (16, 8), evaluate_around=True)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_dynamic_shape_leaves_the_static_graphs_their_templates(templated_gpt_on_two_lengths) -> None:
    """A length change makes Dynamo trace a dynamic graph, in which every unit runs inline; the
    graphs traced before, for static shapes, keep their templates and stay valid: an eval at the
    first length after it is not traced again (the fallback set a flag every graph guarded on,
    so each was traced once more). A GPT of other shapes trained first in this process: Dynamo
    keeps shape history per code location, and the model's first graph is static all the same
    (before, it was traced with symbolic sizes, and so without templates). Rank 0 of a fake
    world of 2 (``templated_gpt_on_two_lengths``)."""
    model = templated_gpt_on_two_lengths
    records = graphs_of(model)
    assert [sorted(k for k in r if k != "dynamo") for r in records] == [
        ["inference"], ["backward", "forward", "joint", "partitioned"], ["backward", "forward", "joint", "partitioned"]]
    templated = [any(n.target is UNIT_FORWARD for n in r["inference" if "inference" in r else "forward"].graph.nodes)
                 for r in records]
    assert templated == [True, True, False]
    assert [_symbolic(r["dynamo"].graph) for r in records] == [False, False, True]
    (kind,) = state_of(model).unit_kinds
    assert "dynamic shape" in kind.inline_reason


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class _BrokenStack(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Residual(width) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[1](self.blocks[0](x))
        torch._dynamo.graph_break()
        return self.blocks[3](self.blocks[2](x)).sum()


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_after_a_graph_break_a_second_models_first_trace_is_static_too() -> None:
    """The frame Dynamo resumes in after a graph break keeps a shape history of its own, shared
    by every model of the class: a second model of other widths is static and templated on both
    sides of the break."""
    with fake_rank(2):
        for width, batch in ((4, 3), (8, 5)):
            model = zerograph.compile(_BrokenStack(width), 3, config=zerograph.Config(unit_classes=(_Residual,)))
            model(torch.randn(batch, width)).backward()
            records = graphs_of(model)
            assert [_symbolic(r["dynamo"].graph) for r in records] == [False, False], width
            assert all(any(n.target is UNIT_FORWARD for n in r["forward"].graph.nodes) for r in records), width


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_models_whose_forward_dynamo_skips_each_keep_their_own_graphs() -> None:
    """``nn.Sequential.forward`` lives in torch/nn, which Dynamo does not take as a top frame:
    ``torch.compile`` would run it through one shared wrapper, so every such model in the process
    shared one cache entry of at most 8 graphs and the ninth model ran eagerly, without passes.
    Each model has a wrapper of its own: nine models, nine graphs with their all-gathers, and each
    first graph static although the models' input widths differ."""
    with fake_rank(2):
        for width in range(2, 11):
            model = zerograph.compile(nn.Sequential(nn.Linear(width, 4), nn.ReLU(), nn.Linear(4, 1)), 3)
            model(torch.randn(2, width)).sum().backward()
            (record,) = graphs_of(model)
            assert not _symbolic(record["dynamo"].graph), width
            gathers = [e for e in schedule_of(record["forward"].graph, "forward", "").entries if e.kind == "all_gather"]
            assert len(gathers) == 2, width  # one per Linear


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_autocast_runs_units_inline() -> None:
    """Under ``torch.autocast`` a unit runs inline (its template was traced without autocast):
    bf16 autocast numbers equal the untemplated build's."""
    torch.manual_seed(0)
    reference = nn.Sequential(_Block(), _Block())
    x = torch.randn(4, 16)
    grads = []
    for templates in (False, True):
        model = zerograph.compile(copy.deepcopy(reference), 3, config=zerograph.Config(unit_templates=templates))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    for plain, templated in zip(*grads):
        torch.testing.assert_close(templated, plain, rtol=0, atol=0)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: no fake-tensor trace can take it
            return self.fc(x)
        return x


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_block_that_cannot_be_traced_runs_inline() -> None:
    """Data-dependent control flow (a graph break inside the block, untemplated): the kind falls
    back to running inline, with eager's numbers, and says why."""
    torch.manual_seed(0)
    reference = nn.Sequential(_Branchy(), _Branchy())
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(2, 8).abs()
    loss, expected = model(x).sum(), reference(x).sum()
    loss.backward()
    expected.backward()
    assert loss.item() == expected.item()
    _grads_equal(model, reference)
    (kind,) = state_of(model).unit_kinds
    assert kind.inline_reason is not None and state_of(model).captured.templates == []


class _LSTMBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.rnn(x)[0])


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_blocks_holding_an_lstm_run_inline_with_eagers_numbers() -> None:
    """Found by trying it as a new user: an LSTM block's template failed at its first run
    ("Unable to cast ... list": the mkldnn layer's workspace, a tensor when traced, undefined under
    the op's no-grad forward). A kind holding an LSTM runs inline, says why, and trains as eager."""
    torch.manual_seed(0)
    reference = nn.Sequential(_LSTMBlock(), _LSTMBlock())
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(2, 3, 8)
    loss, expected = model(x).pow(2).mean(), reference(x).pow(2).mean()
    loss.backward()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    kinds = state_of(model).unit_kinds  # one per block: an LSTM's _flat_weights list differs per instance
    assert kinds and all(kind.inline_reason is not None for kind in kinds)
    assert any("nn.LSTM" in kind.inline_reason for kind in kinds)
    assert state_of(model).captured.templates == []


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_dropout_blocks_take_their_template_with_eagers_masks() -> None:
    """Dropout's in-place mask is made out-of-place for the partition and saved for backward:
    the kind runs its template, and with the same seed draws eager's masks (gradients equal)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)),
                              nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)))
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(4, 8)
    for net in (model, reference):
        torch.manual_seed(1)
        net(x).sum().backward()
    _grads_equal(model, reference)
    (kind,) = state_of(model).unit_kinds
    assert kind.inline_reason is None and kind.exits == {} and all(t.draws_random for t in kind.templates.values())


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
@pytest.mark.parametrize("why", ["dropout", "dynamic shapes"])
def test_units_that_run_inline_gather_again_in_backward(request: pytest.FixtureRequest, why: str) -> None:
    """At stage 3 a kind that runs inline reads its parameters out of its units' gathered flat
    shards. Those cuts are copies (a reshape of a column slice), which the partitioner used to
    save for backward: the units kept their gathered parameters from forward to backward (ZeRO-3's
    memory saving gone), and with per-rank sequence lengths a rank on the static templated graph
    and a rank on the dynamic inline one ran different collectives (``ScheduleMismatchError``).
    Rank 0 of a fake world of 2: every backward graph's schedule equals the untemplated build's,
    which gathers each block again."""
    config = _inline_gpt_config(dropout=0.1 if why == "dropout" else 0.0)
    lengths = (16, 8) if why == "dynamic shapes" else (16,)
    schedules = {}
    for templates in (False, True):
        if templates and why == "dynamic shapes":
            model = request.getfixturevalue("templated_gpt_on_two_lengths")
        else:
            model = _gpt_on_lengths(config, templates, lengths)
        schedules[templates] = [schedule_of(record["backward"].graph, "backward", "").entries
                                for record in graphs_of(model) if "backward" in record]
        if templates:
            (kind,) = state_of(model).unit_kinds
            assert kind.flat_shards
            # dropout takes its template; a dynamic shape runs the kind inline, on its flat shards
            assert (kind.inline_reason is not None) == (why == "dynamic shapes")
    assert len(schedules[True]) == len(lengths) and schedules[True] == schedules[False]
    for entries in schedules[True]:
        assert {e.units for e in entries if e.kind == "all_gather"} == {(0,), (1,), (2,)}


class _NormedUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.lin(x)))


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_kind_falls_back_in_training_only_and_keeps_its_eval_template() -> None:
    """Batch norm writes its running statistics in training, so the kind runs inline in training
    mode; in eval it keeps its template, and the eval graph compiled before the fallback is
    reused after it (one inference graph, not two). Outputs and gradients equal eager's."""
    torch.manual_seed(0)
    reference = nn.Sequential(_NormedUnit(), _NormedUnit())
    config = zerograph.Config(unit_templates=True, unit_classes=(_NormedUnit,))
    model = zerograph.compile(copy.deepcopy(reference), 3, config=config)
    x = torch.randn(4, 6)

    def evaluate(net: nn.Module) -> torch.Tensor:
        net.eval()
        with torch.no_grad():
            out = net(x)
        net.train()
        return out

    torch.testing.assert_close(evaluate(model), evaluate(reference), rtol=0, atol=0)
    model(x).sum().backward()
    reference(x).sum().backward()
    _grads_equal(model, reference)
    for _ in range(2):
        torch.testing.assert_close(evaluate(model), evaluate(reference), rtol=1e-6, atol=1e-6)
    (kind,) = state_of(model).unit_kinds
    train_mode = (1 << len(list(_NormedUnit().modules()))) - 1
    assert list(kind.inline_modes) == [train_mode] and "in place" in kind.inline_modes[train_mode]
    assert [(key.mode, key.arg_grads) for key in kind.templates] == [(0, 0)]  # the eval template, input without gradient
    graph_kinds = [sorted(k for k in record if k != "dynamo") for record in graphs_of(model)]
    assert graph_kinds == [["inference"], ["backward", "forward", "joint", "partitioned"]]


class _Writer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc.weight.data.clamp_(-1, 1)
        return self.fc(x)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_block_that_writes_its_parameter_is_refused() -> None:
    """It cannot be a template (its inputs are copies), and inline it meets the check that refuses
    an in-place parameter write in any zerograph forward."""
    model = zerograph.compile(nn.Sequential(_Writer(), _Writer()), 3, config=TEMPLATES)
    with pytest.raises(ShardingError, match="in place"):
        model(torch.randn(2, 8))


class _Scaled(nn.Module):
    shift = 0.0  # a class attribute an instance may shadow

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x)) * self.scale + self.shift


_CHANGES = {  # (what changes in the second unit after the first step, what the third step changes)
    "attribute": (lambda block: setattr(block, "scale", 0.5), lambda block: setattr(block, "scale", 0.25)),
    "submodule": (lambda block: setattr(block, "act", nn.ReLU()), lambda block: setattr(block, "act", nn.GELU())),
    "shadowed class attribute": (lambda block: setattr(block, "shift", 1.0), lambda block: setattr(block, "shift", 2.0)),
}


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_unit_changed_after_compile_runs_inline_with_eagers_numbers(change: str) -> None:
    """Found by trying it as a new user: a template is called as one op, so Dynamo's guards never
    saw what its body read, and a plain attribute set, a parameterless submodule swapped, or a
    class attribute shadowed after the first step left the units on the old graphs (eager's loss
    0.55, zerograph's 0.38). Now the kind runs inline from the next forward (its reason names the
    unit), with eager's numbers, and Dynamo's guards follow later changes."""
    torch.manual_seed(0)
    reference = nn.Sequential(_Scaled(), _Scaled())
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    x = torch.randn(4, 8)
    (kind,) = state_of(model).unit_kinds
    for step, edit in enumerate((None, *_CHANGES[change])):
        if edit is not None:
            edit(model[1])
            edit(reference[1])
        model.zero_grad()
        reference.zero_grad()
        loss, expected = model(x).pow(2).mean(), reference(x).pow(2).mean()
        loss.backward()
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6), step
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
        if step == 0:  # unchanged: the template stands
            assert kind.inline_reason is None and state_of(model).captured.templates
    assert kind.inline_reason is not None and "'1'" in kind.inline_reason, kind.inline_reason
