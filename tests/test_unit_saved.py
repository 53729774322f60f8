"""unit_saved: a template's forward hands each saved storage over once, so a templated
unit saves no more activation bytes than eager autograd.

A GPT block in rank 0 of a fake world, by bytes against ``zerograph.planning.plan.saved_activation_bytes``
(eager's saved set, each storage once); two tiny partitioned graphs for the two rewrites (views of
one base saved as the base and re-viewed in backward; a small view of a dead storage saved as a
compact copy), each checked against eager autograd's gradients."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

import zerograph
from zerograph.capture.capture import input_storages, measured_bytes
from zerograph.models.gpt import GPT, Block, GPTConfig
from zerograph.planning.plan import saved_activation_bytes
from zerograph.runtime.state import state_of
from zerograph.templates.unit_saved import SavedViews, rebase_saved_views, recompute_norms

from .distributed import fake_rank

aten = torch.ops.aten


def test_a_templated_gpt_block_saves_no_more_bytes_than_eager() -> None:
    """The block's template, run on real tensors: the storages of the activations its forward
    returns for backward (each once) plus its input when the backward reads it, against the
    storages eager autograd saves in the same block (parameters left out of both). A template
    that saves q as a view of the whole qkv projection, k and v as clones, or the attention
    output twice saves more than eager; the template saves the qkv projection and the attention
    output once each, gelu's input without its output, and the two layer norms' inputs without
    their outputs."""
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    with fake_rank(2):
        torch.manual_seed(0)
        model = zerograph.compile(GPT(cfg), 3, config=zerograph.Config(unit_templates=True))
        model(idx, idx).backward()
        (template,) = state_of(model).captured.templates
    primals = [torch.randn(shape).as_strided(shape, stride) for shape, stride, _ in template.input_metas]
    with torch.no_grad():
        outs = template.forward(primals)
    x_bytes = primals[0].numel() * primals[0].element_size()  # the block's one argument, (B, T, C)
    templated = measured_bytes(outs[template.n_outputs:], input_storages(primals))
    templated += x_bytes if 0 in template.saved_primals else 0
    eager = saved_activation_bytes(Block(cfg), (primals[0],))
    assert 0 < templated <= eager, (templated, eager)
    # ten (B, T, C) widths (x, qkv, the attention output, the residual, gelu's input) and the
    # attention's log-sum-exp; the layer norms' outputs (two more widths) are recomputed
    assert templated < 11 * x_bytes, (templated / x_bytes, eager / x_bytes)


def _partitioned(fn, *shapes: tuple[int, ...], norms: bool = False) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``fn``'s joint graph (one output) cut by the min-cut partitioner as ``unit_trace`` cuts it
    (``norms``: its layer norms marked for recompute first, as ``unit_trace`` marks them)."""
    fake = FakeTensorMode()
    with fake:
        primals = [torch.empty(s).requires_grad_() for s in shapes]
        tangents = [torch.empty_like(fn(*primals))]

    def joint(primals, tangents):
        out = fn(*primals)
        return [out], list(torch.autograd.grad([out], primals, tangents))

    with fake:
        graph = make_fx(joint)(primals, tangents)
    if norms:
        assert recompute_norms(graph) == 1
    with torch._functorch.config.patch(recompute_views=True):
        return min_cut_rematerialization_partition(graph, (primals, tangents), num_fwd_outputs=1)


def _saved(fwd: fx.GraphModule) -> list[fx.Node]:
    """The saved activations the forward returns (the primals it also hands over left out)."""
    return [n for n in fwd.graph.output_node().args[0][1:] if n.op != "placeholder"]


def _storage(node: fx.Node) -> StorageWeakRef:
    return StorageWeakRef(node.meta["val"].untyped_storage())


def _check_gradients(fn, fwd: fx.GraphModule, bwd: fx.GraphModule, *shapes: tuple[int, ...]) -> None:
    """The rewritten graphs' output and gradients equal eager autograd's."""
    torch.manual_seed(0)
    inputs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    out, *saved = fwd(*inputs)
    tangent = torch.randn_like(out)
    grads = bwd(*saved, tangent)
    leaves = [t.clone().requires_grad_() for t in inputs]
    expected = fn(*leaves)
    expected_grads = torch.autograd.grad(expected, leaves, tangent)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def _qk(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, k = (x @ w).split(3, dim=1)  # 2 x (4, 3), views of one (4, 6) projection
    return q.transpose(0, 1) @ k  # (3, 3)


def test_views_of_one_base_are_saved_as_the_base_once_and_re_viewed_in_backward() -> None:
    fwd, bwd = _partitioned(_qk, (4, 5), (5, 6))
    before = _saved(fwd)
    assert len(before) == 2 and _storage(before[0]) == _storage(before[1])  # q^T and k: one storage
    done = rebase_saved_views(fwd, bwd, 1)
    assert len(done.rebased) == 2 and not done.copied
    (base,) = set(_saved(fwd))
    assert base.target is aten.mm.default
    assert [n.target for n in bwd.graph.nodes].count(aten.split.Tensor) == 2  # one replay per view
    _check_gradients(_qk, fwd, bwd, (4, 5), (5, 6))


def _corner(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    s = (x @ w)[:, :1].transpose(0, 1)  # (1, 8): an eighth of the (8, 8) product
    return s * s


def test_a_small_view_of_an_otherwise_dead_storage_is_saved_as_a_compact_copy() -> None:
    fwd, bwd = _partitioned(_corner, (8, 4), (4, 8))
    (view,) = _saved(fwd)
    val = view.meta["val"]
    assert val.untyped_storage().nbytes() == 8 * val.numel() * val.element_size()
    done = rebase_saved_views(fwd, bwd, 1)
    assert done.copied == (view.name,) and not done.rebased
    (copy,) = _saved(fwd)
    assert copy.target is aten.clone.default
    assert copy.meta["val"].untyped_storage().nbytes() == val.numel() * val.element_size()
    _check_gradients(_corner, fwd, bwd, (8, 4), (4, 8))


def test_nothing_to_rewrite_leaves_both_graphs_unchanged() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    fwd, bwd = _partitioned(fn, (4, 5), (5, 6))
    codes = fwd.code, bwd.code
    assert rebase_saved_views(fwd, bwd, 1) == SavedViews()
    assert (fwd.code, bwd.code) == codes


def _norm_then_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (8,)) @ w  # the matmul's weight gradient reads the norm's output


def test_a_layer_norm_is_run_again_in_backward_and_its_output_not_saved() -> None:
    """Unmarked, the partitioner saves the norm's output beside its input and statistics (its
    own backward's); marked, only the input (a primal here: nothing) and the norm runs again."""
    fwd, _ = _partitioned(_norm_then_matmul, (4, 8), (8, 6))
    assert any(n.target is operator.getitem and n.args[0].target is aten.native_layer_norm.default
               for n in _saved(fwd))
    fwd, bwd = _partitioned(_norm_then_matmul, (4, 8), (8, 6), norms=True)
    assert _saved(fwd) == []
    assert [n.target for n in bwd.graph.nodes].count(aten.native_layer_norm.default) == 1
    _check_gradients(_norm_then_matmul, fwd, bwd, (4, 8), (8, 6))
