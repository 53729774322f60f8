"""The ZeRO paper's Table 1, measured: one real rank of a large world, on this machine.

Builds a GPT of about ``--params`` parameters on the meta device, compiles it at each ``--stages``
as rank 0 of ``--world-size`` ranks on PyTorch's fake process group (``zerograph.fake_world``:
collectives move no data, so the step's numbers are meaningless, but every tensor this rank holds
is real and of its real size), initialises this rank's shards, and runs ``--steps`` training steps with
the mixed-precision setup of the paper's K = 12 accounting: compute and gradients reduced in bf16,
fp32 master shards, AdamW's fp32 moments. It prints, per stage, the model-state bytes this rank
held at the step's peak (``zerograph.stats(...).resident_bytes``: the real shards, ``.grad`` and
optimizer tensors, plus the gathered full parameters and unreduced gradients alive at once by the
liveness of the graphs that ran) and those it holds between steps (the storages of its shards,
their ``.grad`` and the optimizer's state, read off the tensors), beside ``zerograph.plan``'s
formula and the paper's figure, plus the last step's peak RSS growth (``VmHWM``, reset at the step's
start, over the resident set before the build; it adds activations and the allocator's slack) beside
``zerograph.plan``'s predicted step peak (``Plan.step_peak_bytes``, with the saved activations of
this micro-batch). The last step is the steady state the plan predicts: the first one compiles and
runs its forward and backward before the optimizer's state exists. Run it with
``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns freed buffers at once and the resident set follows
the live tensors.

Usage (two steps of the default 7.5B at N = 64, stage 3; long on a CPU: docs/benchmarks.md, "The
paper's Table 1", has a run):
    MALLOC_MMAP_THRESHOLD_=65536 python examples/paper_table1.py --params 7.5e9 --world-size 64 --stages 3 --tokens 256

Source: Rajbhandari et al., "ZeRO", arXiv 1910.02054, Table 1 (7.5B parameters, N = 64:
120 / 31.4 / 16.6 / 1.88 GB for DP / P_os / P_os+g / P_os+g+p) and section 5's formulas.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

import zerograph
from zerograph.bench.memory import MemoryProbe
from zerograph.models.gpt import GPT, GPTConfig

PAPER_7_5B_N64_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}  # Table 1, K = 12, Ψ = 7.5B, N = 64
GB = 1e9  # the paper's GB


def gpt_of_size(params: float, width: int, vocab: int, seq: int) -> GPTConfig:
    """A GPT config whose parameter count is closest to ``params`` at the given width: each block
    holds 12 d^2 + 13 d parameters (q, k, v, projection, a 4x MLP, two LayerNorms, biases)."""
    per_block = 12 * width * width + 13 * width
    embeddings = (vocab + seq) * width + 2 * width
    layers = max(1, round((params - embeddings) / per_block))
    return GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, width // 128), n_embd=width)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def measure(cfg: GPTConfig, stage: int, world_size: int, tokens: int, seed: int, param_dtype: torch.dtype,
            steps: int = 2) -> dict:
    with torch.device("meta"):
        model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    seq = min(cfg.block_size, tokens)
    shape = (max(1, tokens // seq), seq)
    planned = zerograph.plan(model, stage, world_size, param_dtype=param_dtype)
    need = planned.total_with_overheads
    if need > 0.8 * available_bytes():
        raise SystemExit(f"stage {stage}: zerograph.plan needs {need / GB:.1f} GB of model states per rank, "
                         f"this machine has {available_bytes() / GB:.1f} GB available; refusing to allocate\n{planned}")
    # the step peak's activations trace the model's joint graph: only for a model that will run
    tokens_meta = torch.zeros(shape, dtype=torch.long, device="meta")
    planned = zerograph.plan(model, stage, world_size, param_dtype=param_dtype,
                             example_inputs=(tokens_meta, tokens_meta))
    config = zerograph.Config(mixed_precision=zerograph.MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                            reduce_dtype=param_dtype))
    gc.collect()
    probe = MemoryProbe(torch.device("cpu"))  # the resident set before the build is the baseline
    with zerograph.fake_world(world_size, rank=0):
        start = time.perf_counter()
        model = zerograph.compile(model, stage=stage, config=config, device="cpu")
        torch.manual_seed(seed)
        zerograph.init_weights(model)
        init_s = time.perf_counter() - start
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # foreach would copy per group
        x = torch.randint(cfg.vocab_size, shape)
        step_peaks, step_times = [], []
        for _ in range(steps):  # the first step compiles and has no optimizer state yet: later ones are the steady state
            opt.zero_grad(set_to_none=True)
            probe.start_peak()
            start = time.perf_counter()
            loss = model(x, x)
            loss.backward()
            opt.step()
            step_times.append(time.perf_counter() - start)
            step_peaks.append(probe.result()["peak_over_baseline_bytes"])
        step_s = step_times[-1]
        params = list(model.parameters())
        states = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
                  "optimizer_states": storage_bytes(v for s in opt.state.values() for v in s.values()
                                                    if isinstance(v, torch.Tensor) and v.dim() > 0)}
        stats = zerograph.stats(model, opt)
    states["total"] = sum(states.values())
    peak = {k: stats.resident_bytes.get(k, 0) for k in ("params", "grads", "optimizer_states")}
    peak["total"] = sum(peak.values())
    flops = 6 * psi * x.numel()  # forward + backward, the usual 6 Ψ T (attention's T^2 term left out)
    result = {
        "stage": stage, "world_size": world_size, "psi": psi, "tokens": x.numel(), "fake_world": stats.fake_world,
        "measured_bytes": peak, "held_between_steps_bytes": states, "plan_bytes": dict(planned.bytes_per_rank),
        "plan_total_with_overheads": planned.total_with_overheads,
        "plan_step_peak_bytes": planned.step_peak_bytes, "plan_step_peak_breakdown": dict(planned.step_peak_breakdown),
        "plan_step_peak_phase": planned.step_peak_phase,
        "paper_gb": PAPER_7_5B_N64_GB[stage] if world_size == 64 and abs(psi - 7.5e9) < 0.1e9 else None,
        "peak_rss_growth_bytes": step_peaks[-1], "peak_rss_growth_per_step_bytes": step_peaks,
        "rss_method": probe.method, "init_s": init_s, "step_s": step_s, "step_s_per_step": step_times,
        "step_tflops": flops / step_s / 1e12,
    }
    del model, opt, loss, params
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=7.5e9, help="parameters of the GPT (about)")
    p.add_argument("--width", type=int, default=4096, help="model width d")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--world-size", type=int, default=64, help="N, the world this rank belongs to")
    p.add_argument("--stages", default="3", help="comma-separated ZeRO stages")
    p.add_argument("--tokens", type=int, default=256, help="tokens in this rank's micro-batch")
    p.add_argument("--steps", type=int, default=2, help="training steps; the peak is the last one's (>= 2: steady state)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute and gather dtype; float32 on CPUs without fast bf16 matmuls (the stage-3 "
                        "model states are 16 bytes per parameter over N either way)")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = gpt_of_size(args.params, args.width, args.vocab, min(args.tokens, 1024))
    dtype = getattr(torch, args.param_dtype)
    rows = [measure(cfg, int(s), args.world_size, args.tokens, args.seed, dtype, args.steps)
            for s in args.stages.split(",")]
    print(f"GPT: {cfg.n_layer} blocks of width {cfg.n_embd}, Ψ = {rows[0]['psi']:,}, {args.param_dtype} compute, "
          f"{rows[0]['tokens']} tokens; rank 0 of N = {args.world_size} "
          f"(fake world: collectives move no data; memory and compute are this rank's own)")
    print(f"{'stage':>5}  {'between GB':>10}  {'plan GB':>8}  {'paper GB':>8}  {'between/plan':>12}  "
          f"{'peak RSS +GB':>12}  {'plan peak GB':>12}  {'plan/RSS':>8}  {'step s':>7}  {'TFLOP/s':>7}")
    for r in rows:
        planned = r["plan_bytes"]["total"]
        paper = f"{r['paper_gb']:.2f}" if r["paper_gb"] is not None else "-"
        between = r["held_between_steps_bytes"]["total"]
        rss, plan_peak = r["peak_rss_growth_bytes"], r["plan_step_peak_bytes"]
        print(f"{r['stage']:>5}  {between / GB:>10.3f}  {planned / GB:>8.3f}  {paper:>8}  {between / planned:>12.3f}  "
              f"{rss / GB:>12.3f}  {plan_peak / GB:>12.3f}  {plan_peak / rss:>8.2f}  "
              f"{r['step_s']:>7.1f}  {r['step_tflops']:>7.3f}")
        print("       model states at the step's peak (liveness): "
              + ", ".join(f"{k} {v / GB:.3f}" for k, v in r["measured_bytes"].items() if k != "total")
              + f" GB; plan's step peak (at {r['plan_step_peak_phase'].replace('_', ' ')}): "
              + ", ".join(f"{k} {v / GB:.3f}" for k, v in r["plan_step_peak_breakdown"].items()) + " GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "gpt": cfg.__dict__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
