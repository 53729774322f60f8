"""Achieved memory bandwidth of zerograph's Triton kernels (and their torch references) on one GPU.

For each kernel and size, the median time of ``--runs`` launches (CUDA events, L2 flushed before
each) gives GB/s = bytes the kernel must move / time, shown next to the device's peak DRAM
bandwidth. The byte counts are the minimal traffic of each operation:

* ``adamw``       read param, grad, exp_avg, exp_avg_sq (fp32), write param, exp_avg,
                  exp_avg_sq: 28 B/element
* ``adamw+bf16``  the same plus a bf16 copy of the new param: 30 B/element
* ``pack``        8 fp32 shards -> one bf16 buffer, each padded to a multiple of 64 elements: 4 B read + 2 B written
* ``unpack``      bf16 gathered buffer of 8 ranks -> 4 bf16 parameters of 1024 columns: 2 B read + 2 B written

Before timing, each kernel is checked once against its reference on the GPU (fp32 to 1e-6 of
the tensor's scale; AdamW's bf16 copy to 1 ulp of its own fp32 result; pack and unpack to 1 ulp;
exit status 1 on a mismatch); ``--no-check`` skips that. Without a CUDA GPU the script says so
and exits 0.

Usage: ``python examples/bench_kernels.py [--sizes 1M 16M 256M] [--runs 20] [--peak-gbps 3350]``
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

# Peak DRAM bandwidth in GB/s (1e9 bytes/s) from vendors' data sheets, matched as a substring of
# torch.cuda.get_device_name(); the longest matching key wins (so "A100" beats "A10").
PEAK_GBPS = {
    "B200": 8000,
    "GH200": 4000,  # 96 GB HBM3 version; the 144 GB HBM3e version has 4900: pass --peak-gbps
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,  # SXM5
    "H800": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,  # 40 GB versions
    "A800": 2039,
    "L40S": 864,
    "L40": 864,
    "L4": 300,
    "A10G": 600,
    "A10": 600,
    "T4": 320,
    "V100": 900,
    "RTX 4090": 1008,
    "RTX 3090": 936,
    "MI300X": 5300,
    "MI250X": 3277,
}

DEFAULT_SIZES = ["1M", "4M", "16M", "64M", "256M"]


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def peak_for(name: str) -> float | None:
    matches = [key for key in PEAK_GBPS if key.lower() in name.lower()]
    return float(PEAK_GBPS[max(matches, key=len)]) if matches else None


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two bf16/fp16 tensors."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)  # sign-magnitude -> monotonic

    return int((ordered(a) - ordered(b)).abs().max().item()) if a.numel() else 0


def median_ms(fn, runs: int, warmup: int, flush: torch.Tensor) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        flush.zero_()  # evict the previous run's data from L2 so small sizes measure DRAM traffic
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(n: int, device: torch.device):
    """Yield (name, bytes moved, triton fn, reference fn, check fn) for ``n`` elements."""
    from zerograph.kernels import adamw_step, pack, unpack

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)

    def adamw_case(with_out: bool):
        state = [torch.randn(n, device=device), torch.randn(n, device=device),
                 torch.randn(n, device=device).mul_(1e-3), torch.rand(n, device=device).mul_(1e-6)]
        out = torch.empty(n, dtype=torch.bfloat16, device=device) if with_out else None

        def run(use_triton):
            return lambda: adamw_step(*state, param_bf16_out=out, use_triton=use_triton, **hyper)

        def check():
            a = [t.clone() for t in state]
            b = [t.clone() for t in state]
            oa = out.clone() if with_out else None
            ob = out.clone() if with_out else None
            adamw_step(*a, param_bf16_out=oa, use_triton=True, **hyper)
            adamw_step(*b, param_bf16_out=ob, use_triton=False, **hyper)
            errs = [((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b)]
            # fp32 results within 1e-6 of the tensor's scale (FMA contraction differs from torch's
            # op-by-op rounding); the bf16 copy within 1 ulp of rounding the kernel's own fp32 result.
            # Not against the reference's bf16: where p - lr * update cancels to near zero, 1e-7 of
            # the scale is many bf16 ulps of the tiny result (large tensors have such elements).
            ulp = max_ulps(oa, a[0].to(torch.bfloat16)) if with_out else 0
            return max(errs) <= 1e-6 and ulp <= 1, f"max relative error {max(errs):.2e}, bf16 copy {ulp} ulp"

        return run(True), run(False), check

    name = "adamw"
    yield (name, 28 * n, *adamw_case(False))
    yield ("adamw+bf16", 30 * n, *adamw_case(True))

    n_shards = 8
    sizes = [n // n_shards + (1 if i < n % n_shards else 0) for i in range(n_shards)]
    shards = [torch.randn(s, device=device) for s in sizes]
    padded = [-(-s // 64) * 64 for s in sizes]
    send = torch.empty(sum(padded), dtype=torch.bfloat16, device=device)

    def pack_check():
        a = pack(shards, padded, out=send.clone(), use_triton=True)
        b = pack(shards, padded, out=send.clone(), use_triton=False)
        ulp = max_ulps(a, b)  # compiled Triton rounds to nearest even like torch: expect 0
        return ulp <= 1, f"{ulp} ulp"

    yield ("pack", 4 * n + 2 * sum(padded),
           lambda: pack(shards, padded, out=send, use_triton=True),
           lambda: pack(shards, padded, out=send, use_triton=False), pack_check)

    world, cols, n_params = 8, 1024, 4
    rows = max(1, n // (cols * n_params))
    shapes = [(rows - i, cols) for i in range(n_params)]  # uneven rows exercise the padding
    chunk = [-(-s[0] // world) for s in shapes]
    gathered = torch.randn(world * sum(c * cols for c in chunk), device=device).to(torch.bfloat16)
    outs = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    moved = 2 * sum(o.numel() for o in outs) * 2

    def unpack_check():
        a = unpack(gathered, shapes, world, use_triton=True)
        b = unpack(gathered, shapes, world, use_triton=False)
        ok = all(torch.equal(x, y) for x, y in zip(a, b))
        return ok, "bit-exact" if ok else "not bit-exact (a pure copy must be)"

    yield ("unpack", moved,
           lambda: unpack(gathered, shapes, world, out=outs, use_triton=True),
           lambda: unpack(gathered, shapes, world, out=outs, use_triton=False), unpack_check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="element counts, e.g. 1M 64M 256M")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per point (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak DRAM bandwidth, GB/s")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--no-reference", action="store_true", help="do not time the torch references")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU available; nothing to benchmark.")
        return 0
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or peak_for(name)
    print(f"device: {name}; peak bandwidth: "
          + (f"{peak:.0f} GB/s" + (" (--peak-gbps)" if args.peak_gbps else " (table)") if peak else
             "unknown (pass --peak-gbps)"))
    flush = torch.empty(512 * 2**20, dtype=torch.int8, device=device)  # larger than any L2 today

    failed = False
    header = f"{'kernel':<11} {'elements':>10} {'MB moved':>9} {'triton us':>10} {'GB/s':>7} {'of peak':>8}"
    header += "" if args.no_reference else f" {'torch GB/s':>11} {'speedup':>8}"
    print(header)
    for size_text in args.sizes:
        n = parse_size(size_text)
        try:
            for kernel, nbytes, fast, ref, check in cases(n, device):
                if not args.no_check:
                    ok, detail = check()
                    if not ok:
                        failed = True
                        print(f"{kernel:<11} {n:>10}  CHECK FAILED vs reference: {detail}")
                        continue
                ms = median_ms(fast, args.runs, args.warmup, flush)
                gbps = nbytes / ms / 1e6
                line = f"{kernel:<11} {n:>10} {nbytes / 1e6:>9.1f} {ms * 1e3:>10.1f} {gbps:>7.0f} "
                line += f"{gbps / peak:>7.0%}" if peak else f"{'n/a':>8}"
                if not args.no_reference:
                    ref_ms = median_ms(ref, args.runs, args.warmup, flush)
                    line += f" {nbytes / ref_ms / 1e6:>11.0f} {ref_ms / ms:>7.2f}x"
                print(line, flush=True)
        except torch.OutOfMemoryError:
            print(f"{'(all)':<11} {n:>10}  skipped: out of GPU memory")
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
