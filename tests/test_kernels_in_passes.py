"""``zerograph::pack_shards`` and ``zerograph::unpack_gathered`` (zerograph.kernels.ops) and their
use as the passes' copy-in and the all-gather's copy-out.

- bitwise: the ops' CPU kernels, and the copy-in / copy-out of ``zerograph.runtime.collectives``, equal the copy-in
  and copy-out the passes traced before the ops existed (cast, ``F.pad``, ``reshape``, ``cat``;
  ``view``, column slice, ``reshape``, ``[:rows]``; copied below as ``old_*``), on odd shapes,
  empty and non-contiguous shards, padding, fp32 and bf16 (and a cast for the copy-in);
- the ops' CUDA kernels (the Triton pack and unpack kernels) equal their CPU kernels, run on CPU
  tensors under the Triton interpreter in fresh subprocesses (``python -m tests.test_kernels_in_passes
  <check>``);
- graph structure: a stage-3 GPT compiled on 2 ranks holds one ``pack_shards`` node per
  multi-parameter collective, in that collective's issue chain, one ``unpack_gathered`` node per
  multi-parameter all-gather, in its finish chain, and neither for single parameters; at stage 1
  the forward saves each unpacked buffer once, not its views (and, on the default build's flat
  shards, each block's gathered buffer once).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tests import subprocess_checks
from tests.subprocess_checks import assert_check_passed, start_checks, stop_checks
from zerograph.kernels.ops import PACK_SHARDS, UNPACK_GATHERED, pack_shards_numel, unpack_gathered_numel
from zerograph.runtime.buffer_pool import PACK_SHARDS_OUT
from zerograph.runtime.collectives import gather_copy_in, gather_copy_out, reduce_copy_in
from zerograph.runtime.state import graphs_of, state_of
from zerograph.shard.sharding import ParamLayout

# the pass modules (zerograph.passes re-exports each pass function under its module's name)

# (full shape, world size) pairs: odd rows so the last ranks are short or empty, 1-D and 3-D
SHAPES = [(7, 3), (5,), (1, 9), (4, 2, 3), (3, 5)]
CASTS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.bfloat16, torch.bfloat16)]


def layout_of(key: int, shape, world: int, dtype: torch.dtype, moved: torch.dtype) -> ParamLayout:
    chunk = -(-shape[0] // world)
    rank_rows = tuple(max(0, min(chunk, shape[0] - r * chunk)) for r in range(world))
    return ParamLayout(key, f"p{key}", 0, tuple(shape), dtype, world, True, rank_rows, chunk,
                       param_dtype=moved, reduce_dtype=moved)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (so -0.0 and 0.0, or two NaNs, are told apart)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(bits(got), bits(want))


# ---------------------------------------------------------------- the copy-in before pack_shards

def old_gather_copy_in(shards, layouts):
    flat = []
    for shard, layout in zip(shards, layouts):
        shard = shard.to(layout.param_dtype)
        missing = layout.chunk_rows - shard.shape[0]
        padded = F.pad(shard, [0, 0] * (shard.dim() - 1) + [0, missing]) if missing else shard
        flat.append(padded.reshape(-1))
    return torch.cat(flat) if len(flat) > 1 else flat[0]


def old_reduce_copy_in(grads, layouts, world, scatter):
    grads = tuple(g.to(layout.reduce_dtype) for g, layout in zip(grads, layouts))
    if not scatter:
        return torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
    blocks = []
    for grad, layout in zip(grads, layouts):
        missing = world * layout.chunk_rows - grad.shape[0]
        padded = F.pad(grad, [0, 0] * (grad.dim() - 1) + [0, missing]) if missing else grad
        blocks.append(padded.reshape(world, layout.shard_numel))
    return torch.cat(blocks, dim=1).reshape(-1) if len(blocks) > 1 else blocks[0].reshape(-1)


def local_shards(params, layouts, rank):
    """Rank ``rank``'s rows of each parameter (short or empty on the last ranks), with one
    non-contiguous shard so the op must not assume dense inputs."""
    out = []
    for p, layout in zip(params, layouts):
        c = layout.chunk_rows
        shard = p[rank * c : rank * c + layout.rank_rows[rank]]
        out.append(shard)
    if out[0].dim() == 2:  # same values, transposed storage
        out[0] = out[0].t().contiguous().t()
    return out


def make_params(world, src, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(src) for s in SHAPES]
    params[0][0, 0] = -0.0  # a signed zero survives the cast and the copy
    return params


# ------------------------------------------------------------------------------- bitwise, on CPU

@pytest.mark.parametrize("src,dst", CASTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gather_copy_in_is_bitwise_the_old_one(src, dst, world):
    params = make_params(world, src, seed=world)
    layouts = [layout_of(k, s, world, src, dst) for k, s in enumerate(SHAPES)]
    for rank in range(world):
        shards = local_shards(params, layouts, rank)
        want = old_gather_copy_in(shards, layouts)
        assert want.numel() == sum(layout.shard_numel for layout in layouts)
        op = PACK_SHARDS(shards, [layout.chunk_rows for layout in layouts], 1, dst)
        assert_bitwise(op, want)
        assert_bitwise(gather_copy_in(tuple(shards), layouts), want)
        for i in range(len(shards)):  # single-parameter buckets keep the plain ops, same numbers
            assert_bitwise(gather_copy_in((shards[i],), [layouts[i]]),
                           old_gather_copy_in([shards[i]], [layouts[i]]))


@pytest.mark.parametrize("src,dst", CASTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_copy_in_is_bitwise_the_old_one(src, dst, world):
    grads = make_params(world, src, seed=10 + world)
    grads[0] = grads[0].t().contiguous().t()
    layouts = [layout_of(k, s, world, src, dst) for k, s in enumerate(SHAPES)]
    want = old_reduce_copy_in(grads, layouts, world, scatter=True)
    assert want.numel() == world * sum(layout.shard_numel for layout in layouts)
    assert_bitwise(PACK_SHARDS(grads, [layout.chunk_rows for layout in layouts], world, dst), want)
    assert_bitwise(reduce_copy_in(tuple(grads), layouts, world, True), want)
    # all-reduce buckets (stage 0, 0-d parameters): flattened and concatenated
    with_scalar = grads + [torch.tensor(1.25, dtype=src)]
    flat_layouts = layouts + [ParamLayout(99, "s", 0, (), src, world, False, (1,) * world, 1, dst, dst)]
    assert_bitwise(reduce_copy_in(tuple(with_scalar), flat_layouts, world, False),
                   old_reduce_copy_in(with_scalar, flat_layouts, world, scatter=False))
    for i in range(len(grads)):
        assert_bitwise(reduce_copy_in((grads[i],), [layouts[i]], world, True),
                       old_reduce_copy_in([grads[i]], [layouts[i]], world, scatter=True))


def test_rank_rows_of_the_reduce_layout():
    """Rank r's row of the buffer is rows [r*c, (r+1)*c) of each tensor, zero-padded: checked on
    values that name their position, independently of any copy-in code."""
    a = torch.arange(1, 6, dtype=torch.float32).reshape(5, 1)   # 5 rows -> c = 3 at N = 2
    b = torch.arange(10, 14, dtype=torch.float32)                # 4 rows -> c = 2
    out = PACK_SHARDS([a, b], [3, 2], 2, torch.float32).view(2, -1)  # (N, 3 + 2)
    assert out.tolist() == [[1, 2, 3, 10, 11], [4, 5, 0, 12, 13]]


def test_fake_kernel_gives_shape_and_dtype_and_traces_to_one_node():
    shards = [torch.randn(3, 4), torch.randn(2), torch.randn(0, 5)]
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(s) for s in shards]
        out = PACK_SHARDS(fakes, [3, 4, 2], 2, torch.bfloat16)
        assert out.shape == (pack_shards_numel(shards, [3, 4, 2], 2),) == (2 * (12 + 4 + 10),)
        assert out.dtype == torch.bfloat16
        gm = make_fx(lambda *xs: PACK_SHARDS(list(xs), [3, 4, 2], 2, torch.bfloat16))(*fakes)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [PACK_SHARDS]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rows"):
        PACK_SHARDS([torch.zeros(5, 2)], [2], 2, torch.float32)   # 5 rows > 2 x 2
    with pytest.raises(ValueError, match="0-d"):
        PACK_SHARDS([torch.tensor(1.0)], [1], 1, torch.float32)
    with pytest.raises(ValueError, match="chunk_rows"):
        PACK_SHARDS([torch.zeros(2), torch.zeros(2)], [2], 1, torch.float32)


# ------------------------------------------------------- the copy-out before unpack_gathered

def old_gather_copy_out(gathered, layouts, world):
    gathered = gathered.view(world, -1)
    outs, offset = [], 0
    for layout in layouts:
        block = gathered[:, offset : offset + layout.shard_numel]
        offset += layout.shard_numel
        full = block.reshape(world * layout.chunk_rows, *layout.shape[1:])
        outs.append(full[: layout.shape[0]])
    return outs


def unpack_args(layouts):
    return ([layout.chunk_rows for layout in layouts], [layout.shape[0] for layout in layouts],
            [layout.row_numel for layout in layouts])


def make_gathered(layouts, world, dtype, seed):
    """An all-gathered buffer ``(N * sum shard_numel,)`` of random values, padding included (so
    a copy-out that kept a padding row would be seen), with a signed zero in it."""
    gen = torch.Generator().manual_seed(seed)
    gathered = torch.randn(world * sum(layout.shard_numel for layout in layouts), generator=gen).to(dtype)
    gathered[1] = -0.0
    return gathered


def split_params(flat, layouts):
    """The per-parameter views of ``unpack_gathered``'s parameter-major output."""
    outs, offset = [], 0
    for layout in layouts:
        outs.append(flat[offset : offset + layout.numel].view(layout.shape))
        offset += layout.numel
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gather_copy_out_is_bitwise_the_old_one(dtype, world):
    layouts = [layout_of(k, s, world, dtype, dtype) for k, s in enumerate(SHAPES)]
    gathered = make_gathered(layouts, world, dtype, seed=30 + world)
    gathered[-1] = float("nan")  # a NaN's bits are copied too
    want = old_gather_copy_out(gathered, layouts, world)
    flat = UNPACK_GATHERED(gathered, world, *unpack_args(layouts))
    assert flat.shape == (sum(layout.numel for layout in layouts),) and flat.is_contiguous()
    for got, old in zip(split_params(flat, layouts), want):
        assert_bitwise(got, old)
    outs = gather_copy_out(gathered, layouts, world)
    for got, old in zip(outs, want):
        assert_bitwise(got, old)
    # one allocation, not the gathered buffer: every parameter is a view of it, in order
    base = outs[0].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() == base for o in outs)
    assert base != gathered.untyped_storage().data_ptr()
    assert [o.storage_offset() for o in outs] == [sum(lay.numel for lay in layouts[:i]) for i in range(len(layouts))]
    for i, layout in enumerate(layouts):  # a single parameter: views of the gathered buffer, same numbers
        alone = make_gathered([layout], world, dtype, seed=40 + i)
        (got,) = gather_copy_out(alone, [layout], world)
        assert_bitwise(got, old_gather_copy_out(alone, [layout], world)[0])
        assert got.untyped_storage().data_ptr() == alone.untyped_storage().data_ptr()


def test_gather_copy_out_inverts_the_copy_in():
    """Rank-major in, parameter-major out: the all-gather of every rank's ``pack_shards`` send
    buffer unpacks to the full parameters (padding dropped), on values that name their position."""
    world = 3
    layouts = [layout_of(k, s, world, torch.float32, torch.float32) for k, s in enumerate(SHAPES)]
    params = [torch.arange(layout.numel, dtype=torch.float32).reshape(layout.shape) + 100 * k
              for k, layout in enumerate(layouts)]
    chunks = [layout.chunk_rows for layout in layouts]
    gathered = torch.cat([PACK_SHARDS(local_shards(params, layouts, r), chunks, 1, torch.float32)
                          for r in range(world)])
    flat = UNPACK_GATHERED(gathered, world, *unpack_args(layouts))
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in params]))


def test_unpack_fake_kernel_gives_shape_and_dtype_and_traces_to_one_node():
    args = ([3, 4, 2], [5, 7, 0], [4, 1, 5])  # chunk_rows, rows, row_numels at N = 2
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2 * (12 + 4 + 10), dtype=torch.bfloat16))
        out = UNPACK_GATHERED(fake, 2, *args)
        assert out.shape == (unpack_gathered_numel(args[1], args[2]),) == (5 * 4 + 7 * 1 + 0,)
        assert out.dtype == torch.bfloat16
        gm = make_fx(lambda g: UNPACK_GATHERED(g, 2, *args))(fake)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [UNPACK_GATHERED]


def test_unpack_rejects_bad_arguments():
    g = torch.zeros(2 * (3 * 2 + 2))  # N = 2; (5, 2) at chunk 3 and (3,) at chunk 2
    assert UNPACK_GATHERED(g, 2, [3, 2], [5, 3], [2, 1]).shape == (13,)
    with pytest.raises(ValueError, match="rows"):
        UNPACK_GATHERED(g, 2, [3, 2], [7, 3], [2, 1])       # 7 rows > 2 x 3
    with pytest.raises(ValueError, match="per parameter"):
        UNPACK_GATHERED(g, 2, [3, 2], [5], [2, 1])
    with pytest.raises(ValueError, match="elements"):
        UNPACK_GATHERED(g, 3, [3, 2], [5, 3], [2, 1])       # 16 elements are not 3 x 8
    with pytest.raises(ValueError, match="1-D"):
        UNPACK_GATHERED(g.view(2, -1), 2, [3, 2], [5, 3], [2, 1])
    with pytest.raises(ValueError, match="world_size"):
        UNPACK_GATHERED(g, 0, [3, 2], [5, 3], [2, 1])
    with pytest.raises(ValueError, match="at least one"):
        UNPACK_GATHERED(g[:0], 2, [], [], [])
    with pytest.raises(ValueError, match="negative"):
        UNPACK_GATHERED(g, 2, [3, 2], [5, -1], [2, 1])


# ---------------------------------------------------- Triton (interpreter) vs CPU, in subprocesses

def check_triton_matches_cpu() -> None:
    """The CUDA kernel's code path (the Triton pack kernel) on CPU tensors under the interpreter
    vs. the op's CPU kernel: bitwise, except fp32 -> bf16 within 1 ulp (the interpreter truncates
    that cast where compiled Triton rounds to nearest even, see tests/test_kernels.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    from tests.test_kernels import assert_matches, cast_ulp
    from zerograph.kernels import _triton_kernels, ops, packing

    assert isinstance(_triton_kernels._pack_kernel, InterpretedFunction)

    def refuse(*args, **kwargs):
        raise AssertionError("pack dispatched to its torch reference, not the Triton kernel")

    packing.pack_reference = refuse  # ops.pack_reference (the CPU kernel) keeps the real one
    for world in (1, 2, 3):
        for src, dst in CASTS:
            params = make_params(world, src, seed=20 + world)
            layouts = [layout_of(k, s, world, src, dst) for k, s in enumerate(SHAPES)]
            chunks = [layout.chunk_rows for layout in layouts]
            cases = [(local_shards(params, layouts, r), 1) for r in range(world)] + [(params, world)]
            for tensors, n in cases:
                got = ops._pack_shards_cuda(tensors, chunks, n, dst)
                want = PACK_SHARDS(tensors, chunks, n, dst)
                assert_matches(got, want, f"pack_shards N={n} {src}->{dst}", max_ulp=cast_ulp(src, dst))
                if cast_ulp(src, dst) == 0:
                    assert_bitwise(got, want)
    print("ok triton_matches_cpu")


def check_unpack_triton_matches_cpu() -> None:
    """``unpack_gathered``'s CUDA kernel code path (the Triton unpack kernel, one launch per
    parameter) on CPU tensors under the interpreter vs. the op's CPU kernel: bitwise (no cast)."""
    from triton.runtime.interpreter import InterpretedFunction

    from zerograph.kernels import _triton_kernels, ops, packing

    assert isinstance(_triton_kernels._unpack_kernel, InterpretedFunction)

    def refuse(*args, **kwargs):
        raise AssertionError("unpack dispatched to its torch reference, not the Triton kernel")

    packing.unpack_reference = refuse  # ops.unpack_reference (the CPU kernel) keeps the real one
    for world in (1, 2, 3, 4):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            layouts = [layout_of(k, s, world, dtype, dtype) for k, s in enumerate(SHAPES)]
            gathered = make_gathered(layouts, world, dtype, seed=50 + world)
            args = unpack_args(layouts)
            got = ops._unpack_gathered_cuda(gathered, world, *args)
            want = UNPACK_GATHERED(gathered, world, *args)
            assert_bitwise(got, want)
            for out, old in zip(split_params(got, layouts), old_gather_copy_out(gathered, layouts, world)):
                assert_bitwise(out, old)
    print("ok unpack_triton_matches_cpu")


CHECKS = {"triton_matches_cpu": check_triton_matches_cpu, "unpack_triton_matches_cpu": check_unpack_triton_matches_cpu}


@pytest.mark.slow
def test_triton_kernel_matches_cpu_kernel():
    procs = start_checks("tests.test_kernels_in_passes", CHECKS, interpreted=CHECKS)
    try:
        for name in CHECKS:
            assert_check_passed(procs[name], name)
    finally:
        stop_checks(procs)


# ----------------------------- graph structure, stage 3: ranks 0 and 1 of a fake world of 2, in process

# the copy-in of a multi-parameter bucket: pack_shards, or its out= form once buffer_reuse pools the
# send buffer (the same kernel writing into a pooled buffer)
PACK_OPS = (PACK_SHARDS, PACK_SHARDS_OUT)


def pack_nodes_per_collective(rank: int, world_size: int, unit_classes=None) -> dict:
    """Per graph, per collective: (kind, parameters it moves, pack nodes in its issue chain), and
    the graph's total of pack nodes; and the all-gathers' copy-outs (``copy_outs``)."""
    import zerograph
    from tests.models import build, global_batch, rank_slice
    from zerograph.passes._fx import find_collectives

    # the per-parameter build: a unit on a flat shard (the default) is one parameter to the
    # collectives, its shard the send buffer, so it packs nothing
    model = zerograph.compile(build("gpt"), stage=3, config=zerograph.Config(unit_classes=unit_classes,
                                                                             unit_templates=False))
    model(*rank_slice(global_batch("gpt", 0, 4), rank, world_size)).backward()
    state = state_of(model)
    layouts = state.runtime.layouts
    facts = {}
    for kind in ("forward", "backward"):
        graph = state.captured.graphs[0][kind].graph
        rows = []
        for c in find_collectives(graph):
            params = sum(1 for layout in layouts.values() if layout.unit in c.units and layout.sharded)
            packs = [n for n in c.issue if n.target in PACK_OPS]
            rows.append((c.kind, c.role, params, len(packs), all(n.meta["zerograph"]["role"] == c.role for n in packs)))
        total = sum(1 for n in graph.nodes if n.target in PACK_OPS)
        facts[kind] = {"collectives": rows, "packs": total, "copy_outs": copy_outs(graph, layouts)}
    return facts


def copy_outs(graph, layouts) -> dict:
    """Per all-gather: (parameters it moves, unpack nodes in its finish chain, whether they are
    tagged with its role and every user of theirs is in the chain too); the graph's total of
    unpack nodes; and whether a graph output is an unpack node or a view of one."""
    from zerograph.passes._fx import find_collectives, is_alias_of_input

    rows = []
    for c in find_collectives(graph):
        if c.kind != "all_gather":
            continue
        params = sum(1 for layout in layouts.values() if layout.unit in c.units and layout.sharded)
        unpacks = [n for n in c.finish if n.target is UNPACK_GATHERED]
        whole = all(n.meta["zerograph"]["role"] == c.role and set(n.users) <= set(c.finish) for n in unpacks)
        rows.append((params, len(unpacks), whole))
    saved = []
    for node in graph.find_nodes(op="output")[0].all_input_nodes:
        while is_alias_of_input(node):
            node = node.all_input_nodes[0]
        saved.append(node.target is UNPACK_GATHERED)
    total = sum(1 for n in graph.nodes if n.target is UNPACK_GATHERED)
    return {"gathers": rows, "unpacks": total, "saves_unpacked": any(saved)}


def graph_facts(rank: int, world_size: int, builds: tuple[str, ...] = ("blocks", "embeddings", "stage1_saved",
                                                                     "stage1_saved_flat")) -> dict:
    """The ``builds`` on this rank (``tests.distributed.run_as_rank``): the blocks (every bucket of
    several parameters), the embeddings (``wte``, tied to ``lm_head``, and ``wpe``: one
    parameter each; the blocks join the root's bucket) and stage 1's saved buffers."""
    from torch import nn

    make = {"blocks": lambda: pack_nodes_per_collective(rank, world_size),
            "embeddings": lambda: pack_nodes_per_collective(rank, world_size, (nn.Embedding,)),
            "stage1_saved": lambda: saved_unpacked(rank, world_size),
            "stage1_saved_flat": lambda: saved_unpacked(rank, world_size, unit_templates=None)}
    return {build: make[build]() for build in builds}


def saved_unpacked(rank: int, world_size: int, unit_templates: bool | None = False) -> dict:
    """Stage 1 (gathered parameters saved for backward), per-parameter build by default: the
    forward's unpack nodes, the targets of the forward outputs whose storage is an unpacked buffer,
    and, per all-gather's wait (the default build's flat shards are gathered with no unpack), how
    many forward outputs alias its buffer."""
    import zerograph
    from tests.models import build, global_batch, rank_slice
    from zerograph.graph.vocab import WAIT
    from zerograph.passes._fx import is_alias_of_input

    model = zerograph.compile(build("gpt"), stage=1, config=zerograph.Config(unit_templates=unit_templates))
    model(*rank_slice(global_batch("gpt", 0, 4), rank, world_size)).backward()
    graph = graphs_of(model)[0]["forward"].graph
    saved, saved_per_wait = [], {str(n): 0 for n in graph.nodes if n.target is WAIT}
    for out in graph.find_nodes(op="output")[0].all_input_nodes:
        node = out
        while is_alias_of_input(node):
            node = node.all_input_nodes[0]
        if node.target is UNPACK_GATHERED:
            saved.append(str(out.target))
        if node.target is WAIT:
            saved_per_wait[str(node)] += 1
    return {"unpacks": sum(1 for n in graph.nodes if n.target is UNPACK_GATHERED), "saved": saved,
            "saved_per_wait": saved_per_wait}


@pytest.fixture(scope="module")
def gpt_facts():
    """Every build as rank 0 of a fake world of 2, and the blocks' build as rank 1 too: the
    GPT's shards are even at world 2, so rank 1 differs from rank 0 by its rank alone, which the
    one build with a pack and an unpack per bucket shows as well as four (a compile each)."""
    from tests.distributed import run_as_rank

    return [run_as_rank(graph_facts, 2, rank=0), run_as_rank(graph_facts, 2, ("blocks",), rank=1)]


def ranks_with(gpt_facts: list[dict], build: str) -> list[dict]:
    return [facts for facts in gpt_facts if build in facts]


@pytest.mark.slow
@pytest.mark.parametrize("units", ["blocks", "embeddings"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_one_pack_node_per_multi_parameter_bucket(gpt_facts, kind, units):
    for facts in ranks_with(gpt_facts, units):
        rows = facts[units][kind]["collectives"]
        kinds = {row[0] for row in rows}
        assert kinds == ({"all_gather"} if kind == "forward" else {"all_gather", "reduce_scatter"}), rows
        multi = [row for row in rows if row[2] > 1]
        assert multi, rows  # the GPT's blocks hold several parameters each
        for _, _, params, packs, tagged in rows:
            assert packs == (1 if params > 1 else 0), rows  # found by find_collectives, in the issue chain
            assert tagged
        assert facts[units][kind]["packs"] == len(multi)
    assert gpt_facts[1]["blocks"] == gpt_facts[0]["blocks"]  # both ranks trace the same graphs


@pytest.mark.slow
@pytest.mark.parametrize("units", ["blocks", "embeddings"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_one_unpack_node_per_multi_parameter_all_gather(gpt_facts, kind, units):
    """Forward gathers and backward's re-gathers (stage 3 recomputes the whole chain) alike; the
    forward saves no unpacked buffer for backward."""
    for facts in ranks_with(gpt_facts, units):
        copy_out = facts[units][kind]["copy_outs"]
        rows = copy_out["gathers"]
        multi = [row for row in rows if row[0] > 1]
        assert multi, rows
        if units == "embeddings":
            assert len(multi) < len(rows), rows  # and single-parameter gathers
        for params, unpacks, whole in rows:
            assert unpacks == (1 if params > 1 else 0), rows  # found by find_collectives, in the finish chain
            assert whole, rows
        assert copy_out["unpacks"] == len(multi)
        assert not copy_out["saves_unpacked"]


@pytest.mark.slow
def test_stage1_saves_each_unpacked_buffer_once(gpt_facts):
    """Stages 1-2 keep the gathered parameters for backward: the partitioner saves each unpacked
    buffer itself, once, and backward recomputes the parameters' views of it (so the memory
    accounting, which charges a saved tensor's whole storage, counts each buffer once)."""
    for facts in ranks_with(gpt_facts, "stage1_saved"):
        found = facts["stage1_saved"]
        assert found["unpacks"] == 3  # the root and the two blocks
        assert found["saved"] == [str(UNPACK_GATHERED)] * found["unpacks"], found


@pytest.mark.slow
def test_stage1_flat_shards_save_each_gathered_buffer_once(gpt_facts):
    """The default build at stage 1: each block's flat shard is gathered whole (no unpack) and the
    forward saves its gathered buffer once, a view of it as the template's input; the root's
    parameters are still one bucket with one unpack, saved once."""
    for facts in ranks_with(gpt_facts, "stage1_saved_flat"):
        found = facts["stage1_saved_flat"]
        assert found["unpacks"] == 1 and found["saved"] == [str(UNPACK_GATHERED)], found
        # one all-gather for the root's bucket (saved through its unpack) and one per block
        assert sorted(found["saved_per_wait"].values()) == [0, 1, 1], found


if __name__ == "__main__":
    subprocess_checks.main(CHECKS)
