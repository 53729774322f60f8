"""Unit templates take the call conventions of real model code: keyword arguments, ``None`` and
other constants, tuples of tensors in and tuples or dicts out (Hugging Face decoder layers,
torchtitan blocks), autocast, dropout in training, a new batch size in eval. Per convention: the
unit ran its template (``UnitKind.path``: no exit from the fast path) and training matches
single-process eager (loss, every gradient and its ``None``-ness, parameters after AdamW with
weight decay). One rank, in process; ``strict_templates`` turns an exit into an error."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import zerograph
from zerograph.errors import TemplateFallbackError
from zerograph.runtime.state import state_of

WIDTH = 16


class KeywordBlock(nn.Module):
    """A block called as Hugging Face and torchtitan call theirs: keyword arguments, ``None``, a
    tuple of tensors, flags; ``returns`` picks its output convention."""

    def __init__(self, returns: str = "tensor") -> None:
        super().__init__()
        self.attn, self.mlp, self.unused = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)
        self.returns = returns

    def forward(self, x, attention_mask=None, position_embeddings=None, use_cache=False, scale=1.0, **kwargs):
        cos, sin = position_embeddings
        h = self.attn(x) * cos + sin
        if attention_mask is not None:
            h = h + attention_mask
        out = x + scale * self.drop(self.mlp(torch.relu(h)))
        if self.returns == "tuple":
            return out, None
        if self.returns == "dict":
            return {"hidden": out, "aux": h.detach()}
        if self.returns == "dataclass":
            return _Output(out)
        return out


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor


class KeywordModel(nn.Module):
    def __init__(self, returns: str = "tensor", blocks: int = 3, mask: bool = False) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)
        self.layers = nn.ModuleDict({str(i): KeywordBlock(returns) for i in range(blocks)})
        self.mask = mask

    def forward(self, x):
        h = self.stem(x)
        rope = (torch.cos(x), torch.sin(x))
        mask = torch.zeros_like(x) if self.mask else None
        for layer in self.layers.values():
            out = layer(h, attention_mask=mask, position_embeddings=rope, use_cache=False, scale=0.5)
            h = out[0] if isinstance(out, tuple) else out["hidden"] if isinstance(out, dict) else out
            h = out.hidden if isinstance(out, _Output) else h
        return self.head(h).square().mean()


def _grads_match(reference: nn.Module, compiled: nn.Module, where: object = None) -> None:
    """Every gradient of ``compiled`` equals ``reference``'s at 1e-5, ``None`` where it is ``None``."""
    for (name, p), q in zip(reference.named_parameters(), compiled.parameters()):
        assert (p.grad is None) == (q.grad is None), (where, name)
        if p.grad is not None:
            torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-5, msg=name)


def _train_both(model: nn.Module, stage: int, batches: list[torch.Tensor], strict: bool = True,
                autocast: bool = False) -> nn.Module:
    """Train ``model`` eagerly and through ``zerograph.compile`` side by side (AdamW, weight
    decay), the same seed before each forward (dropout's masks); every loss, gradient (``None``
    kept) and parameter equal at 1e-5. Returns the compiled model."""
    reference = model
    compiled = zerograph.compile(copy.deepcopy(model), stage, config=zerograph.Config(
        lowering="eager", unit_classes=(KeywordBlock,), strict_templates=strict))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (reference, compiled)]
    for step, x in enumerate(batches):
        losses = []
        for net, optimizer in zip((reference, compiled), optimizers):
            torch.manual_seed(100 + step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = net(x)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        _grads_match(reference, compiled, step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for (name, p), q in zip(reference.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.detach().full_tensor(), p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    return compiled


def _on_template(model: nn.Module, templates: int) -> None:
    """Every kind of unit ran its template, with ``templates`` traced, and left the path never."""
    (kind,) = state_of(model).unit_kinds
    path = kind.path()
    assert path["path"] == "template" and path["exits"] == {} and path["inline_modes"] == {}, path
    assert path["templates"] == templates, path
    assert zerograph.stats(model).template_exits == {}


@pytest.mark.parametrize("returns", ["tensor", "tuple", "dict"])
@pytest.mark.parametrize("stage", [1, 3])
def test_keyword_calls_run_their_template_with_eagers_numbers(stage: int, returns: str) -> None:
    """Keyword arguments (a ``None`` mask, a tuple of tensors, a bool, a float) and three output
    conventions, dropout in training: one template per kind (the first block's input needs no
    gradient: two), eager's numbers."""
    torch.manual_seed(0)
    compiled = _train_both(KeywordModel(returns), stage, [torch.randn(4, WIDTH) for _ in range(2)])
    _on_template(compiled, templates=1)
    assert "## Unit paths" in zerograph.explain(compiled)


def test_a_tensor_keyword_argument_and_autocast_take_the_template() -> None:
    """A mask tensor passed by keyword is a template input; under autocast (bfloat16) the
    template is traced with autocast's casts in it."""
    torch.manual_seed(0)
    compiled = _train_both(KeywordModel(mask=True), 3, [torch.randn(4, WIDTH) for _ in range(2)], autocast=True)
    _on_template(compiled, templates=1)
    (template,) = state_of(compiled).unit_kinds[0].templates.values()
    assert "bfloat16" in str(template.forward_graph.graph)


def test_a_new_batch_size_in_eval_keeps_the_template() -> None:
    """Training at batch size 4, evaluation at 3 and 6, training at 8: each shape a template of
    its own (no trace with dynamic shapes), the eval outputs equal eager's."""
    torch.manual_seed(0)
    model = KeywordModel()
    compiled = _train_both(model, 3, [torch.randn(4, WIDTH)])
    for batch in (3, 6):
        x = torch.randn(batch, WIDTH)
        model.eval()
        compiled.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        model.train()
        compiled.train()
    x = torch.randn(8, WIDTH)  # a third shape, in training
    torch.manual_seed(7)
    model(x).backward()
    torch.manual_seed(7)
    compiled(x).backward()
    _grads_match(model, compiled)
    _on_template(compiled, templates=4)


def test_an_object_output_leaves_the_path_by_name() -> None:
    """A block returning a dataclass cannot be a template: the kind runs inline with eager's
    numbers, the exit named in ``stats`` and ``explain``; under ``strict_templates`` the same
    model refuses with ``TemplateFallbackError``."""
    torch.manual_seed(0)
    compiled = _train_both(KeywordModel("dataclass"), 3, [torch.randn(4, WIDTH)], strict=False)
    (kind,) = state_of(compiled).unit_kinds
    (reason,) = kind.exits
    assert "_Output" in reason and kind.path()["path"] == "inline"
    assert list(zerograph.stats(compiled).template_exits) == [f"{kind.name}: {reason}"]
    assert "_Output" in zerograph.explain(compiled)
    strict = zerograph.compile(KeywordModel("dataclass"), 3, config=zerograph.Config(
        lowering="eager", unit_classes=(KeywordBlock,), strict_templates=True))
    with pytest.raises(TemplateFallbackError, match="_Output"):
        strict(torch.randn(4, WIDTH))


class _Checkpointed(nn.Module):
    """Three dropout blocks, each under ``torch.utils.checkpoint`` (eager restores the generator's
    state when it recomputes a block; a template recomputed would draw another mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([KeywordBlock() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        rope = (torch.cos(x), torch.sin(x))
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, position_embeddings=rope, use_reentrant=False)
        return self.head(x).square().mean()


def test_a_checkpointed_dropout_block_keeps_its_forward_mask() -> None:
    """Under an activation checkpoint a templated block with dropout is not run again in
    backward (its activations are handed over), so its gradients are eager's, whose checkpoint
    replays the same mask."""
    torch.manual_seed(0)
    compiled = _train_both(_Checkpointed(), 3, [torch.randn(4, WIDTH) for _ in range(2)])
    _on_template(compiled, templates=2)  # the first block's input needs no gradient


class _Cache:
    """An object argument no template can take (a KV cache stands for it): the block records
    each call's width in it, a side effect the inline body keeps."""

    def __init__(self) -> None:
        self.seen: list[int] = []


class _CachedBlock(KeywordBlock):
    def forward(self, x, cache=None, position_embeddings=None):
        cache.seen.append(x.shape[-1])
        return super().forward(x, position_embeddings=position_embeddings)


class _CachedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_CachedBlock() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)
        self.cache = _Cache()

    def forward(self, x):
        rope = (torch.cos(x), torch.sin(x))
        for layer in self.layers:
            x = layer(x, cache=self.cache, position_embeddings=rope)
        return self.head(x).square().mean()


def test_an_object_argument_sends_the_kind_to_the_per_parameter_path() -> None:
    """A call with an object argument comes again at every step: its kind leaves its templates in
    that training-flag mode, and its flat shards, at once (the per-parameter build's path, not
    inline on flat shards), with eager's numbers and side effects; the exit is counted once and
    named."""
    torch.manual_seed(0)
    model = _CachedModel()
    compiled = zerograph.compile(copy.deepcopy(model), 3, config=zerograph.Config(
        lowering="eager", unit_classes=(_CachedBlock,)))
    x = torch.randn(4, WIDTH)
    for net in (model, compiled):
        torch.manual_seed(3)
        net(x).backward()
    _grads_match(model, compiled)
    assert compiled.cache.seen[-3:] == [WIDTH] * 3
    (kind,) = state_of(compiled).unit_kinds
    path = kind.path()
    assert list(path["inline_modes"]) and not path["flat_shards"], path  # in training mode, off its flat shards
    assert list(path["exits"].values()) == [1] and "_Cache" in next(iter(path["exits"]))
