"""zerograph.kernels: Triton kernels vs. their torch references, and the references vs. torch.

The Triton checks run the kernels under the Triton interpreter on CPU. ``triton.jit`` decides at
decoration time whether a kernel is interpreted, and by the time pytest collects this module other
imports (torch._inductor, zerograph) have already loaded Triton, so the checks run in fresh
subprocesses with ``TRITON_INTERPRET=1``: ``python -m tests.test_kernels <check>`` runs one
``check_*`` function below, which raises on any mismatch. The subprocesses start together to use
both cores.
"""
from __future__ import annotations

import pytest
import torch

from tests import subprocess_checks
from tests.subprocess_checks import assert_check_passed, start_checks, stop_checks
from zerograph.kernels import adamw_step, adamw_step_reference, pack, pack_reference, unpack, unpack_reference

SIZES = (1, 7, 1023, 4097)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


# ------------------------------------------------------------------------------------ comparisons

def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        # Sign-magnitude -> monotonic integers, so adjacent floats differ by 1 (and +0 == -0).
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str, max_ulp: int = 0) -> None:
    """fp32: equal to 1e-6 relative to the tensor's scale; fp16/bf16: within ``max_ulp`` ulps."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    if actual.dtype == torch.float32:
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1e-30),
                                   msg=lambda m: f"{what}: {m}")
    else:
        worst = ulps(actual, expected).max().item() if actual.numel() else 0
        assert worst <= max_ulp, f"{what}: {worst} ulp apart (allowed {max_ulp})"


def cast_ulp(src: torch.dtype, dst: torch.dtype) -> int:
    """Tolerance for a cast done by the interpreter: it truncates fp32 -> bf16 instead of rounding
    to nearest even (compiled Triton rounds), so those casts may be 1 ulp off; all others are exact."""
    return 1 if dst == torch.bfloat16 and src != torch.bfloat16 else 0


def chunk_layout(shapes, world):
    """Per rank, the padded chunk shards of every parameter, built with torch.chunk (independent of
    zerograph.kernels): returns (params, per-rank shard lists, per-parameter padded numels)."""
    params = [torch.randn(s) for s in shapes]
    chunk_rows = [-(-s[0] // world) for s in shapes]
    padded = [c * (torch.Size(s[1:]).numel()) for c, s in zip(chunk_rows, shapes)]
    per_rank = [[] for _ in range(world)]
    for p in params:
        pieces = list(torch.chunk(p, world, dim=0))
        pieces += [p[:0]] * (world - len(pieces))  # torch.chunk returns fewer pieces for tiny tensors
        for r in range(world):
            per_rank[r].append(pieces[r])
    return params, per_rank, padded


# ------------------------------------------------------------------- subprocess checks (interpreter)

def _forbid(module, name):
    """Replace a reference in its module so the public function must dispatch to Triton."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} was called: dispatch did not pick the Triton kernel")

    setattr(module, name, refuse)


def _assert_interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kernel, InterpretedFunction), f"{kernel} is not running under the Triton interpreter"


def check_adamw() -> None:
    from zerograph.kernels import _triton_kernels
    from zerograph.kernels import adamw as adamw_mod

    _assert_interpreted(_triton_kernels._adamw_kernel)
    reference = adamw_mod.adamw_step_reference
    _forbid(adamw_mod, "adamw_step_reference")
    configs = [  # (weight_decay, betas, grad dtype, grad_scale, out dtype)
        (0.0, (0.9, 0.999), torch.float32, None, None),
        (0.1, (0.9, 0.999), torch.float32, None, torch.bfloat16),
        (0.1, (0.9, 0.95), torch.bfloat16, 1024.0, torch.bfloat16),
        (0.01, (0.3, 0.99), torch.float16, torch.tensor(8.0), torch.float16),  # lerp weight >= 0.5 branch
        (0.05, (0.8, 0.9), torch.float32, torch.tensor([0.5]), torch.float32),
    ]
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        for wd, (b1, b2), gdtype, scale, odtype in configs:
            tag = f"n={n} wd={wd} betas={(b1, b2)} grad={gdtype} scale={scale} out={odtype}"
            p = torch.randn(n, generator=gen)
            m, v = torch.zeros(n), torch.zeros(n)
            kern = [p.clone(), m.clone(), v.clone()]
            ref = [p.clone(), m.clone(), v.clone()]
            for step in range(1, 6):
                g = torch.randn(n, generator=gen).to(gdtype)
                out_k = torch.full((n,), 3.0, dtype=odtype) if odtype else None
                out_r = torch.full((n,), 3.0, dtype=odtype) if odtype else None
                kw = dict(lr=1e-2, beta1=b1, beta2=b2, eps=1e-8, weight_decay=wd, step=step, grad_scale=scale)
                before = kern[0].clone()
                adamw_step(kern[0], g, kern[1], kern[2], param_bf16_out=out_k, **kw)
                reference(ref[0], g, ref[1], ref[2], param_bf16_out=out_r, **kw)
                assert not torch.equal(before, kern[0]), f"{tag}: kernel left the parameter unchanged"
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), kern, ref):
                    assert_matches(a, b, f"{tag} step {step} {name}")
                if odtype is not None:
                    assert_matches(out_k, out_r, f"{tag} step {step} param_bf16_out",
                                   max_ulp=cast_ulp(torch.float32, odtype))
    print("ok adamw")


def check_pack() -> None:
    from zerograph.kernels import _triton_kernels
    from zerograph.kernels import packing as pack_mod

    _assert_interpreted(_triton_kernels._pack_kernel)
    reference = pack_mod.pack_reference
    _forbid(pack_mod, "pack_reference")
    gen = torch.Generator().manual_seed(1)
    for src in FLOATS:
        for dst in FLOATS:
            shards = [torch.randn(n, generator=gen).to(src) for n in SIZES]
            shards += [torch.randn(7, 3, generator=gen).to(src),
                       torch.randn(0, 5).to(src),                            # a rank holding no rows
                       torch.randn(5, 9, generator=gen).to(src).t()]       # non-contiguous
            padded = [s.numel() + extra for s, extra in zip(shards, (0, 1, 5, 3, 0, 10, 2, 4))]
            total = sum(padded)
            # Outputs start as non-zero garbage so the padding must be written, not inherited.
            got = pack(shards, padded, dst, out=torch.full((total,), 7.0, dtype=dst))
            want = reference(shards, padded, dst, out=torch.full((total,), 7.0, dtype=dst))
            assert_matches(got, want, f"pack {src}->{dst}", max_ulp=cast_ulp(src, dst))
            for n in SIZES:  # one shard per call, allocating the output, padded to an odd length
                one = torch.randn(n, generator=gen).to(src)
                assert_matches(pack([one], [n + 3], dst), reference([one], [n + 3], dst),
                               f"pack n={n} {src}->{dst}", max_ulp=cast_ulp(src, dst))
    print("ok pack")


def check_unpack() -> None:
    from zerograph.kernels import _triton_kernels
    from zerograph.kernels import packing as pack_mod

    _assert_interpreted(_triton_kernels._unpack_kernel)
    reference = pack_mod.unpack_reference
    _forbid(pack_mod, "unpack_reference")
    _forbid(pack_mod, "pack_reference")
    shapes = [(1,), (7,), (1023,), (4097,), (7, 3), (5, 2, 3), (2,)]
    gen = torch.Generator().manual_seed(2)
    for world in (1, 2, 3, 4, 8):
        row = sum(-(-s[0] // world) * torch.Size(s[1:]).numel() for s in shapes)
        for src in FLOATS:
            gathered = torch.randn(world * row, generator=gen).to(src)
            for dst in FLOATS:
                tag = f"unpack world={world} {src}->{dst}"
                got = unpack(gathered, shapes, world, dtype=dst,
                             out=[torch.full(s, 7.0, dtype=dst) for s in shapes])
                want = reference(gathered, shapes, world, dtype=dst)
                for i, (a, b) in enumerate(zip(got, want)):
                    assert_matches(a, b, f"{tag} param {i}", max_ulp=cast_ulp(src, dst))
        # Round trip through both Triton kernels: torch.chunk shards -> pack per rank -> unpack.
        params, per_rank, padded = chunk_layout(shapes, world)
        gathered = torch.cat([pack(shards, padded) for shards in per_rank])
        for i, (a, b) in enumerate(zip(unpack(gathered, shapes, world), params)):
            assert torch.equal(a, b), f"round trip world={world} param {i}"
    print("ok unpack")


def check_cpu_without_interpreter() -> None:
    import zerograph.kernels._common as common

    assert not common.interpreter_requested()
    n = 33
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    try:
        adamw_step(p, g, m, v, weight_decay=0.1, step=1, use_triton=True, **HYPER)
    except RuntimeError as e:
        assert "TRITON_INTERPRET" in str(e), e
    else:
        raise AssertionError("use_triton=True on CPU without the interpreter did not raise")
    # Default dispatch on CPU must not touch Triton at all.
    common.triton_kernels = lambda: (_ for _ in ()).throw(AssertionError("Triton used on CPU"))
    import zerograph.kernels.adamw as adamw_mod
    import zerograph.kernels.packing as pack_mod

    adamw_mod.triton_kernels = pack_mod.triton_kernels = common.triton_kernels
    # ... and give the reference's results (it printed "ok" here without comparing anything)
    before, want = p.clone(), [t.clone() for t in (p, m, v)]
    adamw_step(p, g, m, v, weight_decay=0.1, step=1, **HYPER)
    adamw_step_reference(want[0], g, want[1], want[2], weight_decay=0.1, step=1, **HYPER)
    assert not torch.equal(p, before), "CPU dispatch left the parameter unchanged"
    for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), want):
        assert torch.equal(got, ref), f"CPU dispatch {name} differs from adamw_step_reference"
    shard = torch.randn(5)
    packed = pack([shard], [8], torch.bfloat16)
    assert torch.equal(packed, pack_reference([shard], [8], torch.bfloat16))
    assert torch.equal(packed[:5], shard.to(torch.bfloat16)) and not packed[5:].any()  # cast, then zero padding
    for a, b in zip(unpack(packed, [(7,)], 2), unpack_reference(packed, [(7,)], 2)):
        assert torch.equal(a, b)
    print("ok cpu_without_interpreter")


CHECKS = {"adamw": check_adamw, "pack": check_pack, "unpack": check_unpack,
          "cpu_without_interpreter": check_cpu_without_interpreter}
INTERPRETED = ("adamw", "pack", "unpack")


@pytest.fixture(scope="module")
def check_runs():
    """Start every subprocess check at once; each test then waits for its own."""
    procs = start_checks("tests.test_kernels", CHECKS, INTERPRETED)
    yield procs
    stop_checks(procs)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_subprocess_check(check_runs, name):
    assert_check_passed(check_runs[name], name)


# ------------------------------------------------------------------------- in-process: references
# These pass use_triton=False where they test reference semantics, so they hold whatever
# TRITON_INTERPRET says; the default dispatch is checked in the cpu_without_interpreter subprocess.

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_reference_matches_torch(n, weight_decay):
    torch.manual_seed(n)
    ours = torch.randn(n)
    theirs = torch.nn.Parameter(ours.clone())
    opt = torch.optim.AdamW([theirs], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=weight_decay, foreach=False)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 4):
        g = torch.randn(n)
        theirs.grad = g.clone()
        opt.step()
        adamw_step_reference(ours, g, m, v, weight_decay=weight_decay, step=step, **HYPER)
        st = opt.state[theirs]
        assert_matches(ours, theirs.detach(), "param")
        assert_matches(m, st["exp_avg"], "exp_avg")
        assert_matches(v, st["exp_avg_sq"], "exp_avg_sq")


def test_adamw_grad_scale_and_low_precision_copy():
    torch.manual_seed(0)
    n, scale = 1023, 512.0
    p, g = torch.randn(n), torch.randn(n) * scale
    a, b = [p.clone(), torch.zeros(n), torch.zeros(n)], [p.clone(), torch.zeros(n), torch.zeros(n)]
    out = torch.empty(n, dtype=torch.bfloat16)
    adamw_step(a[0], g, a[1], a[2], weight_decay=0.1, step=1, grad_scale=torch.tensor(scale), param_bf16_out=out,
               use_triton=False, **HYPER)
    adamw_step(b[0], g / scale, b[1], b[2], weight_decay=0.1, step=1, use_triton=False, **HYPER)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(out, a[0].to(torch.bfloat16))


def test_adamw_rejects_bad_arguments():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="shape"):
        adamw_step(p, torch.zeros(5), torch.zeros(4), torch.zeros(4), weight_decay=0.0, step=1, **HYPER)
    with pytest.raises(ValueError, match="step"):
        adamw_step(p, torch.zeros(4), torch.zeros(4), torch.zeros(4), weight_decay=0.0, step=0, **HYPER)
    with pytest.raises(ValueError, match="param_bf16_out"):
        adamw_step(p, torch.zeros(4), torch.zeros(4), torch.zeros(4), weight_decay=0.0, step=1,
                   param_bf16_out=torch.zeros(3, dtype=torch.bfloat16), **HYPER)
    with pytest.raises(TypeError, match="fp32"):  # the kernel takes fp32 master weights only
        adamw_step(p.double(), torch.zeros(4).double(), torch.zeros(4).double(), torch.zeros(4).double(),
                   weight_decay=0.0, step=1, use_triton=True, **HYPER)


def test_pack_reference_layout():
    shards = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0, 5.0]]), torch.zeros(0)]
    got = pack_reference(shards, [4, 3, 2], torch.bfloat16)
    want = torch.tensor([1, 2, 3, 0, 4, 5, 0, 0, 0], dtype=torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(pack(shards, [4, 3, 2], torch.bfloat16, use_triton=False), want)


def test_pack_rejects_bad_arguments():
    with pytest.raises(ValueError, match="padded length"):
        pack([torch.zeros(5)], [4])
    with pytest.raises(ValueError, match="dtype"):
        pack([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="out"):
        pack([torch.zeros(2)], [3], out=torch.zeros(4))
    with pytest.raises(ValueError, match="at least one"):
        pack([])


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_unpack_reference_inverts_chunk_sharding(world):
    torch.manual_seed(world)
    shapes = [(1,), (7,), (1023,), (4097,), (7, 3), (2, 4, 5)]
    params, per_rank, padded = chunk_layout(shapes, world)
    gathered = torch.cat([pack_reference(shards, padded) for shards in per_rank])
    for got, want in zip(unpack_reference(gathered, shapes, world), params):
        assert torch.equal(got, want)
    # Cast on the way out, through the public function.
    for got, want in zip(unpack(gathered, shapes, world, dtype=torch.bfloat16, use_triton=False), params):
        assert torch.equal(got, want.to(torch.bfloat16))


def test_unpack_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        unpack(torch.zeros(10), [(7,)], 2)            # needs 2 * 4 elements
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(torch.zeros(6), [(7,)], 2, chunk_rows=[3])
    with pytest.raises(ValueError, match="output"):
        unpack(torch.zeros(8), [(7,)], 2, out=[torch.zeros(8)])


if __name__ == "__main__":
    subprocess_checks.main(CHECKS)
