"""Quantized collectives (ZeRO++ qwZ and qgZ): ``Config(gather_quantization="int8")``
(qwZ) and ``Config(reduce_quantization="int8")`` (qgZ, one-hop all-to-all + fp32 sum).

- Kernels: the Triton quantize / dequantize / dequantize-sum kernels against their torch
  references, under the Triton interpreter in fresh subprocesses (``python -m tests.test_quantize
  <check>``, as ``tests/test_kernels.py``); the references against the error bound of symmetric
  absmax int8, ``|x - q * scale| <= absmax / 254`` per block (plus fp32 rounding, plus one
  rounding of the output dtype).
- Layout and accounting: ``wire_layout`` by hand; ``zerograph.stats`` of one rank of a fake world
  counts the bytes on the wire: ``N * (payload + scales + raw small shards)`` per collective,
  against the formula.
- Training (one spawn, 2 gloo ranks): the GPT with quantized gathers, quantized reductions or
  both, and a model with an eager (graph-break) frame, against a single-process emulation of the
  same arithmetic (``tests/workers_quantize.py``): first-step loss and gradients to fp32 accuracy
  (qwZ: the gradient is the exact reduction of the full-precision gradient at the dequantized
  weights; qgZ: the fp32 sum in rank order of each rank's dequantized chunks), later steps within
  ``LATER_RTOL``; and each option's stage-3 losses within ``VS_UNQUANTIZED_RTOL`` of the
  unquantized run's.

Tolerances: step 0 is the same arithmetic up to fp32 summation order (``RTOL`` = 1e-5). After an
update a master weight that differs by an ulp may round to the neighbouring int8 value (one
step, absmax/127), so later steps get ``LATER_RTOL`` = 1e-4. Against the unquantized run the
forward sees weights off by at most absmax/254 per block (or gradients off by the mean of the
ranks' absmax/254), far below ``VS_UNQUANTIZED_RTOL`` = 1e-3 on the tiny GPT's loss.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import zerograph
from tests import subprocess_checks
from tests.subprocess_checks import assert_check_passed, start_checks, stop_checks
from zerograph.errors import ConfigError
from zerograph.graph.vocab import COLLECTIVE_KINDS
from zerograph.kernels.quantize import (
    BLOCK,
    PACK_QUANTIZED,
    UNPACK_DEQUANTIZED,
    pack_quantized_reference,
    quantize_reference,
    quantizes,
    unpack_dequantized_reference,
    wire_layout,
)
from zerograph.runtime.state import graphs_of

from .distributed import run_as_rank, spawn
from .workers_quantize import CASES, emulated_training, plain_first_grads, quantize_runs

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
RTOL = ATOL = 1e-5
LATER_RTOL = 1e-4
VS_UNQUANTIZED_RTOL = 1e-3
EPS = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}  # relative, per rounding


def shards_of(params: list[torch.Tensor], world: int) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Per rank, its ``torch.chunk`` row shard of every parameter (maybe short or empty); and the
    padded shard numels."""
    chunks = [-(-p.shape[0] // world) for p in params]
    per_rank = [[p[r * c : (r + 1) * c] for p, c in zip(params, chunks)] for r in range(world)]
    return per_rank, [c * p[0].numel() if p.dim() > 1 else c for p, c in zip(params, chunks)]


def sample_params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(37, 50, generator=gen) * 0.02
    big[3, :] = 0.0  # an all-zero stretch: blocks of zeros have scale 0 and decode to exact zeros
    big[20, 7] = 5.0  # an outlier: its block's scale is large, the others keep theirs
    return [t.to(dtype) for t in (big, torch.randn(700, generator=gen), torch.randn(9, 3, generator=gen),
                                  torch.randn(5, generator=gen) + 1.0, torch.randn(300, 2, generator=gen))]


# ------------------------------------------------------------------------- references, in process

def test_wire_layout_by_hand() -> None:
    # shards of 300 (quantized: 2 blocks), 9 (raw), 256 (quantized: 1 block), 3 (raw) fp32 elements
    layout = wire_layout([300, 9, 256, 3], itemsize=4)
    assert layout.quantized == (True, False, True, False)
    # raw: 9 * 4 bytes at 0, 3 * 4 at 36; scales from 48: 2 + 1 fp32; payload from 60: 300 + 256 int8
    assert layout.offsets == (60, 0, 360, 36)
    assert layout.scale_offsets == (48, -1, 56, -1)
    assert layout.rank_bytes == 616
    bf16 = wire_layout([300, 9], itemsize=2)  # 18 raw bytes, padded to 20 before the fp32 scales
    assert (bf16.offsets, bf16.scale_offsets, bf16.rank_bytes) == ((28, 0), (20, -1), 328)
    assert quantizes([BLOCK], torch.bfloat16) and not quantizes([BLOCK - 1, 3], torch.float32)
    assert not quantizes([10_000], torch.float64) and not quantizes([10_000], torch.int64)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_round_trip_within_the_error_bound(dtype: torch.dtype, world: int) -> None:
    """pack per rank -> concatenate (the all-gather) -> unpack: raw shards come back bitwise,
    quantized ones within absmax/254 of their block (+ fp32 rounding + one rounding to ``dtype``)."""
    params = sample_params(dtype)
    per_rank, numels = shards_of(params, world)
    layout = wire_layout(numels, dtype.itemsize)
    gathered = torch.cat([pack_quantized_reference(shards, layout, dtype) for shards in per_rank])
    assert gathered.dtype == torch.uint8 and gathered.numel() == world * layout.rank_bytes
    outs = unpack_dequantized_reference(gathered, world, layout, dtype,
                                        [torch.full((p.numel(),), 7.0, dtype=dtype) for p in params])
    for i, (p, out) in enumerate(zip(params, outs)):
        if not layout.quantized[i]:
            assert torch.equal(out, p.reshape(-1)), i
            continue
        for r in range(world):  # block by block of each rank's shard
            x = per_rank[r][i].reshape(-1).float()
            got = out[r * numels[i] : r * numels[i] + x.numel()].float()
            for start in range(0, x.numel(), BLOCK):
                xb, gb = x[start : start + BLOCK], got[start : start + BLOCK]
                absmax = xb.abs().max().item()
                bound = absmax / 254 * (1 + 1e-5) + absmax * EPS[dtype] + 1e-30
                assert (xb - gb).abs().max().item() <= bound, (i, r, start)
                if absmax == 0:
                    assert torch.equal(gb, torch.zeros_like(gb))
    assert not torch.equal(outs[0], params[0].reshape(-1)), "the big parameter was not quantized"


def test_quantize_reference_is_symmetric_absmax_int8() -> None:
    x = torch.tensor([0.5, -1.0, 0.25, 0.0] + [0.1] * 252)
    q, scales = quantize_reference(x, 256)
    assert scales.tolist() == [pytest.approx(1.0 / 127)]
    assert q[:4].tolist() == [64, -127, 32, 0]  # 63.5 rounds half up; absmax -> -127
    q, scales = quantize_reference(torch.zeros(3), 300)  # padding and zeros: scale 0, all zero
    assert q.shape == (300,) and not q.any() and scales.tolist() == [0.0, 0.0]


def test_ops_trace_to_one_node_each_with_the_wire_shapes() -> None:
    shards = [torch.randn(150, 512), torch.randn(150)]
    send = make_fx(lambda a, b: PACK_QUANTIZED([a, b], [150, 150], 1, torch.bfloat16, BLOCK), tracing_mode="fake")(*shards)
    (node,) = [n for n in send.graph.nodes if n.op == "call_function"]
    layout = wire_layout([150 * 512, 150], 2)
    assert node.meta["val"].dtype == torch.uint8 and node.meta["val"].shape == (layout.rank_bytes,)
    gathered = torch.zeros(2 * layout.rank_bytes, dtype=torch.uint8)
    out = make_fx(lambda g: UNPACK_DEQUANTIZED(g, 2, [150, 150], [300, 300], [512, 1], torch.bfloat16, BLOCK),
                  tracing_mode="fake")(gathered)
    (node,) = [n for n in out.graph.nodes if n.op == "call_function"]
    assert node.meta["val"].dtype == torch.bfloat16 and node.meta["val"].shape == (300 * 512 + 300,)
    with pytest.raises(ValueError, match="world_size x"):
        UNPACK_DEQUANTIZED(gathered[:-4], 2, [150, 150], [300, 300], [512, 1], torch.bfloat16, BLOCK)


@pytest.mark.parametrize("field", ["gather_quantization", "reduce_quantization"])
@pytest.mark.parametrize("value", ["int4", "fp8", True, "INT8"])
def test_config_rejects_unknown_quantization(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be one of \(None, 'int8'\)"):
        zerograph.Config(**{field: value})
    assert getattr(zerograph.Config(**{field: "int8"}), field) == "int8"
    assert getattr(zerograph.Config(), field) is None


@pytest.mark.parametrize("field", ["gather_quantization", "reduce_quantization"])
def test_compile_refuses_quantization_at_stage_0(field: str) -> None:
    with pytest.raises(ConfigError, match="stages 1-3"):
        zerograph.compile(nn.Linear(4, 4), stage=0, config=zerograph.Config(**{field: "int8"}))


# ------------------------------------------------------------- accounting: one rank of a fake world

def one_step_stats(rank: int, world: int, quantization: str | None, param_dtype: torch.dtype | None,
                   reduce_quantization: str | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 300), nn.Linear(300, 2))  # shards: 150 x 512 (quantized), 150 (raw), ...
    model = zerograph.compile(model, stage=3, config=zerograph.Config(
        gather_quantization=quantization, reduce_quantization=reduce_quantization,
        mixed_precision=zerograph.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)))
    model(torch.randn(4, 512)).sum().backward()
    record = graphs_of(model)[0]
    gathers = [n for n in record["forward"].graph.nodes if COLLECTIVE_KINDS.get(n.target) == "all_gather"]
    reductions = [n for n in record["backward"].graph.nodes if COLLECTIVE_KINDS.get(n.target) == "reduce_scatter"]
    return {"stats": zerograph.stats(model), "gather_dtypes": [str(n.meta["val"].dtype) for n in gathers],
            "reduce_dtypes": [str(n.args[0].meta["val"].dtype) for n in reductions],
            "reduce_ops": [str(n.target) for n in reductions]}


def wire_bytes(shard_numel: int, raw_numel: int, itemsize: int) -> int:
    """One rank's quantized buffer of a quantized shard and a raw one, 4-byte aligned sections."""
    raw = -(-raw_numel * itemsize // 4) * 4
    return raw + 4 * -(-shard_numel // BLOCK) + -(-shard_numel // 4) * 4


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_stats_count_the_bytes_on_the_wire(param_dtype: torch.dtype | None) -> None:
    """Stage 3 at N = 2: every all-gather of ``Linear(512, 300)`` moves N x (150 x 512 int8 +
    300 fp32 scales + 150 raw bias elements) bytes; ``Linear(300, 2)``'s shards (300 and 1
    elements per rank: a weight of one block plus a few, and a raw bias) N x (300 int8 + 2 scales +
    1 raw). ``comm_bytes`` is what a rank sends in a ring, (N-1)/N of it; gradients stay fp32."""
    world, itemsize = 2, (param_dtype or torch.float32).itemsize
    plain = run_as_rank(one_step_stats, world, None, param_dtype)
    quant = run_as_rank(one_step_stats, world, "int8", param_dtype)
    assert set(quant["gather_dtypes"]) == {"torch.uint8"} and set(quant["reduce_dtypes"]) == {"torch.float32"}

    gathered = {1: world * wire_bytes(150 * 512, 150, itemsize), 2: world * wire_bytes(1 * 300, 1, itemsize)}
    full = {1: (300 * 512 + 300) * itemsize, 2: (2 * 300 + 2) * itemsize}
    # unit 1 is gathered in forward only (its backward needs no weight: the input wants no
    # gradient), unit 2 in forward and again in backward
    times = {1: 1, 2: 2}
    assert plain["stats"].comm_bytes["all_gather"] == sum(times[u] * full[u] for u in times) * (world - 1) // world
    assert quant["stats"].comm_bytes["all_gather"] == sum(times[u] * gathered[u] for u in times) * (world - 1) // world
    ratio = quant["stats"].comm_bytes["all_gather"] / plain["stats"].comm_bytes["all_gather"]
    assert ratio == pytest.approx(0.25 if param_dtype is None else 0.5, abs=0.01)
    assert quant["stats"].comm_bytes["reduce_scatter"] == plain["stats"].comm_bytes["reduce_scatter"]


def test_quantized_reductions_count_the_bytes_on_the_wire() -> None:
    """qgZ at stage 3, N = 2: each unit's reduction is one all-to-all of N quantized chunks (each
    a rank's rows of every gradient: int8 + fp32 scales, sub-block shards raw in fp32); a rank
    sends (N-1)/N of it. The all-gathers are untouched."""
    world = 2
    plain = run_as_rank(one_step_stats, world, None, None)
    quant = run_as_rank(one_step_stats, world, None, None, "int8")
    assert quant["reduce_ops"] == ["_c10d_functional.all_to_all_single.default"] * 2
    assert set(quant["reduce_dtypes"]) == {"torch.uint8"}
    sent = world * (wire_bytes(150 * 512, 150, 4) + wire_bytes(300, 1, 4)) * (world - 1) // world
    assert quant["stats"].comm_bytes["reduce_scatter"] == sent
    assert plain["stats"].comm_bytes["reduce_scatter"] == (300 * 512 + 300 + 600 + 2) * 4 * (world - 1) // world
    assert quant["stats"].comm_bytes["reduce_scatter"] / plain["stats"].comm_bytes["reduce_scatter"] == pytest.approx(
        0.25, abs=0.01)
    assert quant["stats"].comm_bytes["all_gather"] == plain["stats"].comm_bytes["all_gather"]


# ------------------------------------------------------------------------ training, 2 gloo ranks

@pytest.fixture(scope="module")
def runs() -> dict:
    per_rank = spawn(quantize_runs, 2, timeout_s=600)
    out = {}
    for case in CASES:
        for rank, result in enumerate(r[case] for r in per_rank):
            if isinstance(result, str):
                pytest.fail(f"{case} raised on rank {rank}:\n{result}", pytrace=False)
        out[case] = per_rank[0][case]
    return out


def case_id(case) -> str:
    name, stage, gather, reduce = case
    return f"{name}-stage{stage}" + (f"-gather_{gather}" if gather else "") + (f"-reduce_{reduce}" if reduce else "")


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in CASES if c[2] or c[3]], ids=case_id)
def test_quantized_training_matches_the_emulation(runs, case) -> None:
    name, _, gather, reduce = case
    result, emulated = runs[case], emulated_training(name, 2, gather is not None, reduce is not None)
    plain = plain_first_grads(name)  # the tolerance below tells quantized arithmetic from exact
    assert max((g - plain[n]).norm() / g.norm() for n, g in emulated["first_grads"].items()) > 100 * RTOL
    assert result["losses"][0] == pytest.approx(emulated["losses"][0], rel=RTOL, abs=ATOL)
    for pname, grad in emulated["first_grads"].items():  # the same reduction, of the same gradients
        torch.testing.assert_close(result["first_grads"][pname], grad, rtol=RTOL, atol=ATOL, msg=pname)
    assert result["losses"] == pytest.approx(emulated["losses"], rel=LATER_RTOL)
    for pname, p in emulated["params"].items():  # master weights: exact AdamW on those gradients
        torch.testing.assert_close(result["params"][pname], p, rtol=LATER_RTOL, atol=LATER_RTOL, msg=pname)


@pytest.mark.distributed
def test_quantized_losses_within_tolerance_of_unquantized(runs) -> None:
    plain, gathers, reductions = runs["gpt", 3, None, None], runs["gpt", 3, "int8", None], runs["gpt", 3, None, "int8"]
    sent_plain = plain["stats"].comm_bytes
    for quant in (gathers, reductions):
        assert quant["losses"] == pytest.approx(plain["losses"], rel=VS_UNQUANTIZED_RTOL)
        assert quant["losses"] != plain["losses"]  # the values really went through int8
    # int8 alone would be a quarter; the tiny GPT (width 16) has many sub-block shards that travel raw
    assert gathers["stats"].comm_bytes["reduce_scatter"] == sent_plain["reduce_scatter"] > 0
    assert 0.25 < gathers["stats"].comm_bytes["all_gather"] / sent_plain["all_gather"] < 0.4
    assert reductions["stats"].comm_bytes["all_gather"] == sent_plain["all_gather"] > 0
    assert 0.25 < reductions["stats"].comm_bytes["reduce_scatter"] / sent_plain["reduce_scatter"] < 0.4


# ---------------------------------------------------- Triton (interpreter) vs references, subprocesses

def _refuse(module, name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} was called: dispatch did not pick the Triton kernel")

    setattr(module, name, refuse)


def check_quantize_triton() -> None:
    """pack_quantized (Triton) vs pack_quantized_reference, bitwise, for each dtype and world
    size, including empty and non-contiguous shards; and the op's CUDA kernel path vs its CPU one."""
    from triton.runtime.interpreter import InterpretedFunction

    from zerograph.kernels import _triton_kernels
    from zerograph.kernels import quantize as qmod

    assert isinstance(_triton_kernels._quantize_kernel, InterpretedFunction)
    shards = [torch.randn(150, 512), torch.randn(150)]
    # qgZ's copy-in: bf16 gradients, 3 destination chunks of 100 rows, the raw ones sent in fp32
    grads = [torch.randn(299, 512).bfloat16(), torch.randn(299).bfloat16()]
    want_ops = [PACK_QUANTIZED(shards, [150, 150], 1, torch.float32, BLOCK),  # the CPU kernel: the reference
                PACK_QUANTIZED(grads, [100, 100], 3, torch.float32, BLOCK)]
    reference = qmod.pack_quantized_reference
    _refuse(qmod, "pack_quantized_reference")  # from here on, a fallback to it fails
    assert torch.equal(qmod._pack_quantized_cuda(shards, [150, 150], 1, torch.float32, BLOCK), want_ops[0])
    assert torch.equal(qmod._pack_quantized_cuda(grads, [100, 100], 3, torch.float32, BLOCK), want_ops[1])
    for dtype in FLOATS:
        for world in (1, 2, 3, 5):
            params = sample_params(dtype) + [torch.randn(13, 40).to(dtype).t()]  # non-contiguous
            per_rank, numels = shards_of(params, world)
            layout = wire_layout(numels, dtype.itemsize)
            for r, shards in enumerate(per_rank):
                got = qmod.pack_quantized(shards, layout, dtype, out=torch.full((layout.rank_bytes,), 7, dtype=torch.uint8))
                assert torch.equal(got, reference(shards, layout, dtype)), (dtype, world, r)
    print("ok quantize_triton")


def check_dequantize_triton() -> None:
    """unpack_dequantized (Triton) vs its reference: fp32 bitwise; bf16/fp16 outputs within 1 ulp
    (the interpreter truncates fp32 -> bf16 where compiled Triton rounds, see tests/test_kernels.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    from tests.test_kernels import assert_matches
    from zerograph.kernels import _triton_kernels
    from zerograph.kernels import quantize as qmod

    assert isinstance(_triton_kernels._dequantize_kernel, InterpretedFunction)
    args = ([150, 150], [300, 300], [512, 1], torch.float32, BLOCK)
    gathered = torch.cat([PACK_QUANTIZED([torch.randn(150, 512), torch.randn(150)], [150, 150], 1, torch.float32, BLOCK)
                          for _ in range(2)])
    want_op = UNPACK_DEQUANTIZED(gathered, 2, *args)  # the CPU kernel: the reference
    reference = qmod.unpack_dequantized_reference
    _refuse(qmod, "unpack_dequantized_reference")
    assert torch.equal(qmod._unpack_dequantized_cuda(gathered, 2, *args), want_op)
    for dtype in FLOATS:
        for world in (1, 2, 3, 5):
            params = sample_params(dtype)
            per_rank, numels = shards_of(params, world)
            layout = wire_layout(numels, dtype.itemsize)
            gathered = torch.cat([pack_quantized_reference(s, layout, dtype) for s in per_rank])
            outs = [torch.full((p.numel(),), 7.0, dtype=dtype) for p in params]
            got = qmod.unpack_dequantized(gathered, world, layout, dtype, outs)
            want = reference(gathered, world, layout, dtype, [torch.empty_like(o) for o in outs])
            for i, (a, b) in enumerate(zip(got, want)):
                if dtype == torch.float32 or not layout.quantized[i]:
                    assert torch.equal(a, b), (dtype, world, i)
                else:
                    assert_matches(a, b, f"{dtype} world={world} param {i}", max_ulp=1)
    print("ok dequantize_triton")


def check_dequantize_sum_triton() -> None:
    """dequantize_sum (Triton) vs its reference: bitwise (fp32 sums in rank order, raw chunks of
    each dtype included), and the op's CUDA kernel path vs its CPU one."""
    from triton.runtime.interpreter import InterpretedFunction

    from zerograph.kernels import _triton_kernels
    from zerograph.kernels import quantize as qmod

    assert isinstance(_triton_kernels._dequantize_sum_kernel, InterpretedFunction)
    args = ([100, 100], [512, 1], torch.float32, BLOCK)
    received = torch.cat([PACK_QUANTIZED([torch.randn(100, 512), torch.randn(100)], [100, 100], 1, torch.float32,
                                         BLOCK) for _ in range(3)])
    want_op = qmod.DEQUANTIZE_SUM(received, 3, *args)  # the CPU kernel: the reference
    reference = qmod.dequantize_sum_reference
    _refuse(qmod, "dequantize_sum_reference")
    assert torch.equal(qmod._dequantize_sum_cuda(received, 3, *args), want_op)
    for dtype in FLOATS:
        for world in (1, 2, 3, 5):
            params = sample_params(dtype)
            per_rank, numels = shards_of(params, world)  # as if each rank sent this rank its chunk
            layout = wire_layout(numels, dtype.itemsize)
            received = torch.cat([pack_quantized_reference(s, layout, dtype) for s in per_rank])
            total = sum(numels)
            got = qmod.dequantize_sum(received, world, layout, dtype, torch.full((total,), 7.0))
            want = reference(received, world, layout, dtype, torch.empty(total))
            assert torch.equal(got, want), (dtype, world)
    print("ok dequantize_sum_triton")


CHECKS = {"quantize_triton": check_quantize_triton, "dequantize_triton": check_dequantize_triton,
          "dequantize_sum_triton": check_dequantize_sum_triton}


@pytest.mark.slow
def test_triton_kernels_match_the_references() -> None:
    procs = start_checks("tests.test_quantize", CHECKS, interpreted=CHECKS)
    try:
        for name in CHECKS:
            assert_check_passed(procs[name], name)
    finally:
        stop_checks(procs)


if __name__ == "__main__":
    subprocess_checks.main(CHECKS)
