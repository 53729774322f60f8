"""``zerograph::pack_shards`` (zerograph.kernels.ops) and its use as the passes' copy-in.

- bitwise: the op's CPU kernel, and the passes' ``_copy_in``, equal the copy-in the passes traced
  before the op existed (cast, ``F.pad``, ``reshape``, ``cat``; copied below as ``old_*``), on odd
  shapes, empty and non-contiguous shards, fp32 and a bf16 cast;
- the op's CUDA kernel (the Triton pack kernel) equals its CPU kernel, run on CPU tensors under the
  Triton interpreter in a fresh subprocess (``python -m tests.test_kernels_in_passes <check>``);
- graph structure: a stage-3 GPT compiled on 2 ranks holds one ``pack_shards`` node per
  multi-parameter collective, in that collective's issue chain, and none for single parameters.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tests.subprocess_checks import assert_check_passed, start_checks, stop_checks
from zerograph.kernels.ops import PACK_SHARDS, pack_shards_numel
from zerograph.sharding import ParamLayout

# the pass modules (zerograph.passes re-exports each pass function under its module's name)
insert_allgather = importlib.import_module("zerograph.passes.insert_allgather")
insert_reduce_scatter = importlib.import_module("zerograph.passes.insert_reduce_scatter")

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
        assert_bitwise(insert_allgather._copy_in(tuple(shards), layouts), want)
        for i in range(len(shards)):  # single-parameter buckets keep the plain ops, same numbers
            assert_bitwise(insert_allgather._copy_in((shards[i],), [layouts[i]]),
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
    assert_bitwise(insert_reduce_scatter._copy_in(tuple(grads), layouts, world, True), want)
    # all-reduce buckets (stage 0, 0-d parameters): flattened and concatenated
    with_scalar = grads + [torch.tensor(1.25, dtype=src)]
    flat_layouts = layouts + [ParamLayout(99, "s", 0, (), src, world, False, (1,) * world, 1, dst, dst)]
    assert_bitwise(insert_reduce_scatter._copy_in(tuple(with_scalar), flat_layouts, world, False),
                   old_reduce_copy_in(with_scalar, flat_layouts, world, scatter=False))
    for i in range(len(grads)):
        assert_bitwise(insert_reduce_scatter._copy_in((grads[i],), [layouts[i]], world, True),
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


# ---------------------------------------------------- Triton (interpreter) vs CPU, in subprocesses

def check_triton_matches_cpu() -> None:
    """The CUDA kernel's code path (the Triton pack kernel) on CPU tensors under the interpreter
    vs. the op's CPU kernel: bitwise, except fp32 -> bf16 within 1 ulp (the interpreter truncates
    that cast where compiled Triton rounds to nearest even, see tests/test_kernels.py)."""
    from tests.test_kernels import assert_matches, cast_ulp
    from zerograph.kernels import _triton_kernels, ops, packing

    from triton.runtime.interpreter import InterpretedFunction

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


CHECKS = {"triton_matches_cpu": check_triton_matches_cpu}


def test_triton_kernel_matches_cpu_kernel():
    procs = start_checks("tests.test_kernels_in_passes", CHECKS, interpreted=CHECKS)
    try:
        assert_check_passed(procs["triton_matches_cpu"], "triton_matches_cpu")
    finally:
        stop_checks(procs)


# -------------------------------------------------------------- graph structure, stage 3, 2 ranks

def pack_nodes_per_collective(rank: int, world_size: int) -> dict:
    """Per graph, per collective: (kind, parameters it moves, pack nodes in its issue chain), and
    the graph's total of pack nodes. Runs on each rank (tests.distributed.spawn)."""
    import zerograph
    from tests.models import build, global_batch, rank_slice
    from zerograph.passes._fx import find_collectives

    model = zerograph.compile(build("gpt"), stage=3)
    model(*rank_slice(global_batch("gpt", 0, 4), rank, world_size)).backward()
    state = model._zerograph
    layouts = state.runtime.layouts
    facts = {}
    for kind in ("forward", "backward"):
        graph = state.captured.graphs[0][kind].graph
        rows = []
        for c in find_collectives(graph):
            params = sum(1 for layout in layouts.values() if layout.unit in c.units and layout.sharded)
            packs = [n for n in c.issue if n.target is PACK_SHARDS]
            rows.append((c.kind, c.role, params, len(packs), all(n.meta["zerograph"]["role"] == c.role for n in packs)))
        total = sum(1 for n in graph.nodes if n.target is PACK_SHARDS)
        facts[kind] = {"collectives": rows, "packs": total}
    return facts


@pytest.fixture(scope="module")
def gpt_stage3_facts():
    from tests.distributed import spawn

    return spawn(pack_nodes_per_collective, 2)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_one_pack_node_per_multi_parameter_bucket(gpt_stage3_facts, kind):
    for facts in gpt_stage3_facts:  # both ranks trace the same graphs
        rows = facts[kind]["collectives"]
        kinds = {row[0] for row in rows}
        assert kinds == ({"all_gather"} if kind == "forward" else {"all_gather", "reduce_scatter"}), rows
        multi = [row for row in rows if row[2] > 1]
        assert multi, rows  # the GPT's blocks hold several parameters each
        for _, _, params, packs, tagged in rows:
            assert packs == (1 if params > 1 else 0), rows  # found by find_collectives, in the issue chain
            assert tagged
        assert facts[kind]["packs"] == len(multi)
    assert gpt_stage3_facts[0] == gpt_stage3_facts[1]


if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
