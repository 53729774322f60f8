"""A templated unit's shards in one flat buffer (``zerograph/shard/flat.py``): one graph input and one
marker per unit, with the parameters, optimizer, checkpoints and gradient accumulation unchanged.

In process: the structure as rank 0 of a fake world of 2 (where a parameter's cut out of the
gathered buffer is a copy), the numbers at world size 1 against eager training of a copy. One
spawn of two gloo ranks: accumulation without sync, AdamW, ``zero_grad(set_to_none=True)`` and a
``zerograph.checkpoint`` round trip against single-process eager training on the global batch."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import zerograph
from zerograph.capture import compiled_model
from zerograph.errors import ModelChangedError, ShardingError
from zerograph.graph.ops import UNSHARD
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.runtime.runtime import schedule_of
from zerograph.runtime.state import graphs_of, runtime_of_model, state_of

from .distributed import fake_rank, spawn
from .models import global_batch, rank_slice

TEMPLATES = zerograph.Config(unit_templates=True)


def _gpt(blocks: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=blocks, n_embd=32, n_head=2, block_size=16))


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_each_block_is_one_input_and_one_marker_and_backward_gathers_it_again() -> None:
    with fake_rank(2):
        model = zerograph.compile(_gpt(4), 3, config=TEMPLATES)
        idx = torch.randint(0, 256, (2, 16))
        model(idx, idx).backward()
        runtime = runtime_of_model(model)
        record = graphs_of(model)[0]
        flats = list(runtime.flat_shards.values())
        assert [flat.layout.unit for flat in flats] == [1, 2, 3, 4]
        root_params = sum(1 for layout in runtime.layouts.values() if layout.unit == 0)
        keys = {n.args[1] for n in record["dynamo"].graph.nodes if "unshard" in str(n.target)}
        assert len(keys) == root_params + 4  # per parameter at the root, per unit in the blocks
        assert keys >= {flat.layout.key for flat in flats}
        markers = Counter(n.args[1] for n in record["dynamo"].graph.nodes if "unshard" in str(n.target))
        root_keys = {key for key, layout in runtime.layouts.items() if layout.unit == 0}
        assert markers.keys() == root_keys | {flat.layout.key for flat in flats}  # no marker of a block parameter
        assert [markers[flat.layout.key] for flat in flats] == [1] * 4  # (the root's tied wte/lm_head reads twice)
        for flat in flats:
            assert flat.layout.shape == (2 * sum(layout.shard_numel for layout in flat.layouts),)
            for shard in flat.shards:  # every block parameter lives in its unit's buffer
                assert shard.to_local().untyped_storage().data_ptr() == flat.param.untyped_storage().data_ptr()
        # the template hands backward the gathered flat primal (index 1: after the block's input),
        # not parameters cut out of it, so backward gathers each block again
        (template,) = state_of(model).captured.templates
        assert template.saved_primals == [0, 1]
        backward = schedule_of(record["backward"].graph, "backward", "").entries
        assert {e.units for e in backward if e.kind == "all_gather"} >= {(1,), (2,), (3,), (4,)}
        assert all(n.target is not UNSHARD for n in record["backward"].graph.nodes)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


def _blocks(n: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(n)])


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_parameters_of_flat_units_stay_autograds_leaves() -> None:
    """A flat unit's parameters are autograd's leaves (``flat.ShardsAsFlat``): ``backward(inputs=...)``
    reaches only the named ones and ``autograd.grad`` returns theirs, with eager's numbers (``None``
    where eager's is); a full backward gives each unit's parameters views of one flat gradient; one
    graph serves every call. World of one."""
    reference = _gpt(2)
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    assert len(runtime_of_model(model).flat_shards) == 2
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    named = [name for name in theirs if name.startswith(("blocks.1.attn", "blocks.0.mlp", "wte"))]
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        model(idx, idx).backward(inputs=[ours[name] for name in named])
        reference(idx, idx).backward(inputs=[theirs[name] for name in named])
        for name, expected in theirs.items():
            assert (ours[name].grad is None) == (expected.grad is None), name
            if expected.grad is not None:
                torch.testing.assert_close(ours[name].grad.full_tensor(), expected.grad, rtol=1e-5, atol=1e-6)
        got = torch.autograd.grad(model(idx, idx), [ours[name] for name in named])
        want = torch.autograd.grad(reference(idx, idx), [theirs[name] for name in named])
        for name, grad, expected in zip(named, got, want):
            torch.testing.assert_close(grad.full_tensor(), expected, rtol=1e-5, atol=1e-6, msg=name)
    model.zero_grad(set_to_none=True)
    model(idx, idx).backward()
    for flat in runtime_of_model(model).flat_shards.values():
        assert len({shard.grad.to_local().untyped_storage().data_ptr() for shard in flat.shards}) == 1
    assert len(graphs_of(model)) == 1


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_accumulation_optimizer_and_checkpoint_match_eager() -> None:
    """World size 1: three AdamW steps of two micro-batches each (the second with sync off and
    on, as with DDP's ``no_sync``), ``zero_grad(set_to_none=True)`` between them, equal eager's;
    a state dict loaded back after the parameters were overwritten is what the next forward
    reads (the flat buffer, not stale values)."""
    reference = _blocks()
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    assert len(runtime_of_model(model).flat_shards) == 3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [torch.randn(4, 8) for _ in range(6)]
    for step in range(3):
        first, second = batches[2 * step], batches[2 * step + 1]
        with model.no_sync():
            model(first).square().mean().backward()
        model(second).square().mean().backward()
        for x in (first, second):
            reference(x).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-6, msg=name)

    x = torch.randn(4, 8)
    expected = reference(x).square().mean().item()
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(3.0)  # in place: reaches the flat buffer the graph reads
    assert model(x).square().mean().item() != pytest.approx(expected, rel=1e-3)
    model.load_state_dict(saved)
    assert model(x).square().mean().item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_ema_of_the_state_dicts_deepcopy_follows_eager(stage) -> None:
    """An EMA kept as ``copy.deepcopy(model.state_dict())`` of the default build (flat shards, whose
    parameters' local tensors are views at offsets of one buffer): the copy holds DTensors of the same
    placements and values on storage of its own, training does not move it, ``lerp_`` updates it as
    eager's, and ``load_state_dict`` of it puts eager's averages back. World of one."""
    reference = _blocks()
    model = zerograph.compile(copy.deepcopy(reference), stage)
    assert len(runtime_of_model(model).flat_shards) == 3
    state = model.state_dict()
    assert any(v.to_local().storage_offset() != 0 for v in state.values())  # views inside the flat buffers
    ema, ref_ema = copy.deepcopy(state), copy.deepcopy(reference.state_dict())
    for name, value in state.items():
        assert type(ema[name]) is type(value) and ema[name].placements == value.placements, name
        assert torch.equal(ema[name].to_local(), value.to_local()), name
        assert ema[name].to_local().untyped_storage().data_ptr() != value.to_local().untyped_storage().data_ptr()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for x in [torch.randn(4, 8) for _ in range(3)]:
        before = {k: v.full_tensor().clone() for k, v in ema.items()}
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert all(torch.equal(ema[k].full_tensor(), v) for k, v in before.items())  # the step left it alone
        with torch.no_grad():
            for (name, value), ref_value in zip(model.state_dict().items(), reference.state_dict().values()):
                ema[name].lerp_(value, 0.25)
                ref_ema[name].lerp_(ref_value, 0.25)
    for name, value in ema.items():
        torch.testing.assert_close(value.full_tensor(), ref_ema[name], rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(value.full_tensor(), model.get_parameter(name).full_tensor()), name
    model.load_state_dict(ema)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), ref_ema[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_parameter_moved_out_of_its_flat_buffer_is_refused() -> None:
    model = zerograph.compile(_blocks(2), 3, config=TEMPLATES)
    model(torch.randn(2, 8)).sum().backward()
    shard = model[1].fc.weight
    shard._local_tensor = shard._local_tensor.clone()  # what a `.data =` swap leaves behind
    with pytest.raises(ModelChangedError, match=r"1\.fc\.weight.*flat shard"):
        model(torch.randn(2, 8))


class _Writer(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc.weight.data.clamp_(-1, 1)
        return super().forward(x)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_unit_run_inline_that_writes_its_parameter_is_refused() -> None:
    """Under autocast a templated unit runs inline and reads its parameters cut out of the
    gathered flat buffer; at world size 2 the cut is a copy, and writing it is still refused."""
    with fake_rank(2):
        torch.manual_seed(0)
        model = zerograph.compile(nn.Sequential(_Writer(), _Writer()), 3, config=TEMPLATES)
        assert len(runtime_of_model(model).flat_shards) == 2
        with pytest.raises(ShardingError, match=r"'0\.fc\.weight' is written in place"), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8))


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_kind_with_a_frozen_parameter_keeps_one_input_per_parameter() -> None:
    """A frozen parameter has no gradient to hand over: its kind is not flattened, says why,
    and trains as eager does (world size 1)."""
    reference = _blocks(2)
    for block in reference:
        block.fc.bias.requires_grad_(False)
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    (kind,) = state_of(model).unit_kinds
    assert kind.flat_shards == [] and "frozen" in kind.flat_reason
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert (param.grad is None) == (ref.grad is None)
        if ref.grad is not None:
            torch.testing.assert_close(param.grad.full_tensor(), ref.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_freezing_a_flattened_parameter_after_compile_is_refused_by_name() -> None:
    """The graph's guards see the flat leaf, not the parameters, so the per-forward view check
    asks the watch: a freeze after compile is refused as without templates."""
    model = zerograph.compile(_blocks(2), 3, config=TEMPLATES)
    model(torch.randn(2, 8)).sum().backward()
    model[1].out.bias.requires_grad_(False)
    with pytest.raises(ModelChangedError, match=r"'1\.out\.bias' \(trainable -> frozen\)"):
        model(torch.randn(2, 8))


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_an_inline_write_names_the_parameter_cut_out_of_the_flat_shard() -> None:
    """Embedding(max_norm=...) renormalises its weight in place: its kind cannot be a template
    and runs inline, where the refusal names the parameter, not the unit's flat shard."""
    model = zerograph.compile(nn.Sequential(nn.Embedding(11, 8, max_norm=1.0), nn.Linear(8, 3)), 3, config=TEMPLATES)
    assert len(runtime_of_model(model).flat_shards) == 2
    with pytest.raises(ShardingError, match=r"'0\.weight'.*max_norm"):
        model(torch.arange(11))


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_meta_built_model_with_flat_shards_initialises_like_an_ordinary_build() -> None:
    """Meta-device construction: shards moved into flat buffers hold no values until
    ``init_weights`` writes them (the forward refuses before), then equal an ordinary build;
    an ``fn`` writing another unit's shards directly is still refused, though a unit's shards
    share one version counter."""
    config = GPTConfig(vocab_size=251, block_size=15, n_layer=2, n_head=2, n_embd=10)  # rows uneven
    torch.manual_seed(0)
    ordinary = GPT(config)
    with torch.device("meta"):
        model = zerograph.compile(GPT(config), 3, config=TEMPLATES)
    assert len(runtime_of_model(model).flat_shards) == 2
    idx = torch.randint(0, 251, (2, 15))
    with pytest.raises(ShardingError, match="never initialised"):
        model(idx, idx)
    torch.manual_seed(0)
    assert zerograph.init_weights(model, model.init_passes()) == []  # GPT.__init__'s random stream
    full = zerograph.checkpoint.full_state_dict(model, cpu_offload=False)
    for name, value in ordinary.state_dict().items():
        assert torch.equal(full[name], value), name
    assert model(idx, idx).item() == pytest.approx(ordinary(idx, idx).item(), rel=1e-6)

    with torch.device("meta"):
        other = zerograph.compile(GPT(config), 3, config=TEMPLATES)

    def root_loop(module: nn.Module) -> None:  # writes the blocks' shards while only the root's are open
        if isinstance(module, GPT):
            for p in module.blocks.parameters():
                nn.init.zeros_(p)

    with pytest.raises(ShardingError, match="blocks.0"):
        zerograph.init_weights(other, root_loop)


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_mixed_precision_gradients_equal_the_per_parameter_build() -> None:
    """bf16 ``param_dtype``, fp32 ``reduce_dtype``: the flat shard is cast as a whole where each
    parameter was cast alone, and the gradients are bitwise those of the build without templates."""
    reference = _blocks()
    x = torch.randn(4, 8)
    grads = []
    for templates in (False, True):
        config = zerograph.Config(unit_templates=templates, mixed_precision=zerograph.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        model = zerograph.compile(copy.deepcopy(reference), 3, config=config)
        assert len(runtime_of_model(model).flat_shards) == (3 if templates else 0)
        model(x).float().square().mean().backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    for plain, flat in zip(*grads):
        torch.testing.assert_close(flat, plain, rtol=0, atol=0)


def _tied_blocks() -> nn.Sequential:
    model = _blocks(3)
    model[1].fc.weight = model[0].fc.weight
    return model


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
def test_a_kind_with_a_parameter_tied_across_blocks_keeps_one_input_per_parameter() -> None:
    """A weight two blocks share cannot live in both units' flat buffers: the kind (all three
    blocks: one structure) is not flattened, says why, and three AdamW steps equal eager's
    (world size 1), the tie kept."""
    reference = _tied_blocks()
    model = zerograph.compile(copy.deepcopy(reference), 3, config=TEMPLATES)
    (kind,) = state_of(model).unit_kinds
    assert kind.flat_shards == [] and "'0.fc.weight'" in kind.flat_reason and "tied" in kind.flat_reason
    assert runtime_of_model(model).flat_shards == {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8)
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    assert model[1].fc.weight is model[0].fc.weight
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _swap_in_a_copy(param: nn.Parameter) -> None:
    torch.utils.swap_tensors(param, nn.Parameter(param.detach().clone()))


def _set_the_local_storage(param: nn.Parameter) -> None:
    with torch.no_grad():
        param._local_tensor.set_(param._local_tensor.clone())


@pytest.mark.slow  # compiles models: the fast lane keeps to checks without one
@pytest.mark.parametrize("replace", [_swap_in_a_copy, _set_the_local_storage], ids=["swap_tensors", "set_"])
def test_replacing_a_parameter_through_torch_is_refused(replace) -> None:
    """What torch offers to replace a parameter's data (``torch.utils.swap_tensors``, which
    ``nn.Module._apply`` uses for tensor subclasses; ``set_`` on its local tensor) leaves it
    outside the flat buffer the graph reads: the next forward refuses it by name, at world 2."""
    with fake_rank(2):
        model = zerograph.compile(_blocks(2), 3, config=TEMPLATES)
        model(torch.randn(2, 8)).sum().backward()
        replace(model[0].out.bias)
        with pytest.raises(ModelChangedError, match=r"'0\.out\.bias' no longer lives in its unit's flat shard"):
            model(torch.randn(2, 8))


# -- two gloo ranks against single-process eager training ------------------------------------------

STEPS, MICRO, LR, PROBE, EXTRA = 3, 4, 1e-3, 99, 100  # PROBE, EXTRA: global-batch seeds of the checkpoint part
ATOL = RTOL = 1e-5  # as tests/test_accumulation.py and tests/test_parity.py (fp32, gloo sums in another order)
BATCH = 4  # global batch: 2 rows per rank


def _uneven_gpt() -> GPT:
    """Two blocks of width 9: all their parameters but the MLP's first layer (36 rows) have an odd
    number of rows, so over 2 ranks their chunks in the flat shard are padded and the cuts of the
    gathered buffer drop padding (checked to fail when a cut keeps the wrong rows)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, n_layer=2, n_head=3, n_embd=9))  # vocab and length as global_batch("gpt")


def _full(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    return {n: (p.grad if grads else p).full_tensor().detach().clone() for n, p in model.named_parameters()}


def flat_training(rank: int, world_size: int, path: str) -> dict:
    """Stage 3 with flat shards on this rank: ``STEPS`` AdamW steps of ``MICRO`` micro-batches,
    the first under ``no_sync()``, the second with ``set_requires_gradient_sync(False)``, the
    other two synced (the held sum reduced with the third; the fourth adds to ``.grad`` in place);
    ``zero_grad(set_to_none=True)`` after each step. Then a checkpoint saved,
    one more step taken, the checkpoint loaded, and that step taken again."""
    model = zerograph.compile(_uneven_gpt(), 3, config=TEMPLATES)
    flats = list(runtime_of_model(model).flat_shards.values())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def loss(seed: int) -> torch.Tensor:
        return model(*rank_slice(global_batch("gpt", seed, BATCH), rank, world_size))

    def in_flat_buffers() -> bool:
        return all(s.to_local().untyped_storage().data_ptr() == f.param.untyped_storage().data_ptr()
                   for f in flats for s in f.shards)

    out: dict = {"flat_units": [f.layout.unit for f in flats], "zero_while_unsynced": [], "grads": [],
                 "cleared": [], "params": []}
    for step in range(STEPS):
        with model.no_sync():
            loss(MICRO * step).backward()
        model.set_requires_gradient_sync(False)
        loss(MICRO * step + 1).backward()
        model.set_requires_gradient_sync(True)
        # documented: unsynced backwards leave zeros in .grad, the held sum comes with the synced one
        out["zero_while_unsynced"].append(all(not p.grad.to_local().any() for p in model.parameters()))
        for micro in range(2, MICRO):
            loss(MICRO * step + micro).backward()
        out["grads"].append(_full(model, grads=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["cleared"].append(all(p.grad is None for p in model.parameters()) and all(f.param.grad is None for f in flats))
        out["params"].append(_full(model))

    with torch.no_grad():
        out["probe_saved"] = loss(PROBE).item()
    zerograph.checkpoint.save(model, opt, path)
    loss(EXTRA).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["params_extra"] = _full(model)
    with torch.no_grad():
        out["probe_moved"] = loss(PROBE).item()
    zerograph.checkpoint.load(model, opt, path)
    out["in_flat_buffers_after_load"] = in_flat_buffers()
    out["params_loaded"] = _full(model)
    with torch.no_grad():
        out["probe_loaded"] = loss(PROBE).item()  # read from the flat buffers
    loss(EXTRA).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["params_extra_again"] = _full(model)
    # a shorter sequence past the static shapes (one, here): Dynamo traces it with a symbolic
    # length, the blocks' kind runs inline, each parameter cut out of its unit's gathered flat
    # shard (padding dropped) by the unit's one marker
    compiled_model.STATIC_SHAPES = 1
    short = model(*rank_slice(_short_batch(), rank, world_size))
    short.backward()
    out["short"] = (short.item(), _full(model, grads=True), state_of(model).unit_kinds[0].inline_reason)
    return out


def _short_batch() -> tuple[torch.Tensor, ...]:
    return tuple(t[:, :8].contiguous() for t in global_batch("gpt", PROBE, BATCH))


def _eager_reference() -> dict:
    """The same schedule in one process on the global batch (loss: the mean over all rows, as the
    mean of the ranks' equal-sized slices)."""
    model = _uneven_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict = {"grads": [], "params": []}
    for step in range(STEPS):
        for micro in range(MICRO):
            model(*global_batch("gpt", MICRO * step + micro, BATCH)).backward()
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    with torch.no_grad():
        out["probe"] = model(*global_batch("gpt", PROBE, BATCH)).item()
    model(*global_batch("gpt", EXTRA, BATCH)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["params_extra"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    short = model(*_short_batch())
    short.backward()
    out["short"] = (short.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def _close(result: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert result.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(result[name], value, rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")


@pytest.mark.distributed
def test_two_ranks_accumulate_step_and_resume_like_eager(tmp_path) -> None:
    """Two gloo ranks, a GPT of two blocks (each one flat shard, padded chunks): the gradients
    accumulated over 4 micro-batches (2 unsynced) and the parameters after each of 3 AdamW steps
    equal eager's to 1e-5; ``zero_grad(set_to_none=True)`` leaves no gradient behind, on the
    parameters or the flat shards; a ``zerograph.checkpoint`` loaded after one more step restores
    what the next forward reads (its loss, not the moved one's) and the optimizer state (that step
    again lands on the same parameters, bit for bit); a shorter sequence, run inline (each
    parameter cut out of the gathered flat shard), has eager's loss and gradients."""
    per_rank = spawn(flat_training, 2, str(tmp_path / "ckpt"))
    reference = _eager_reference()
    for result in per_rank:
        assert result["flat_units"] == [1, 2]
        assert result["zero_while_unsynced"] == [True] * STEPS
        assert result["cleared"] == [True] * STEPS
        for step in range(STEPS):
            _close(result["grads"][step], reference["grads"][step], f"gradient after step {step}'s micro-batches")
            _close(result["params"][step], reference["params"][step], f"parameter after step {step}")
        assert result["probe_moved"] != pytest.approx(result["probe_saved"], rel=1e-6)  # the extra step moved it
        assert result["in_flat_buffers_after_load"]
        for name, value in result["params_loaded"].items():
            assert torch.equal(value, result["params"][-1][name]), name
        assert result["probe_loaded"] == result["probe_saved"]
        _close(result["params_extra"], reference["params_extra"], "parameter after the extra step")
        for name, value in result["params_extra_again"].items():
            assert torch.equal(value, result["params_extra"][name]), name
    probe = sum(result["probe_saved"] for result in per_rank) / 2  # each rank's loss is its half's mean
    assert probe == pytest.approx(reference["probe"], rel=RTOL, abs=ATOL)
    short = sum(result["short"][0] for result in per_rank) / 2
    assert short == pytest.approx(reference["short"][0], rel=RTOL, abs=ATOL)
    for result in per_rank:
        assert "dynamic shape" in result["short"][2]
        _close(result["short"][1], reference["short"][1], "gradient of the inline (shorter) step")
    for name, value in per_rank[0]["params_extra_again"].items():  # both ranks hold the same model
        assert torch.equal(value, per_rank[1]["params_extra_again"][name]), name
