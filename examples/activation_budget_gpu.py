"""Activation budget on one CUDA GPU: GPT-2 124M at stage 3 (world size 1, NCCL), trained 4 steps
unconstrained, then with ``ActivationPolicy.budget_bytes`` = half the measured saved-activation bytes,
once recomputing (the default pricing picks recompute at this width) and once offloading (priced
with a cost model whose compute is slow, so that offload wins: it exercises PyTorch's transfer
stream). Prints per run: losses, ``torch.cuda.max_memory_allocated`` above the step's start (MiB),
median step time, and ``zerograph.stats``' saved / offloaded activation bytes.

Usage: ``python examples/activation_budget_gpu.py`` (exits 0 without CUDA).
"""
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

import zerograph
from zerograph.graph.costmodel import CostModel
from zerograph.models.gpt import GPT, SIZES

if not torch.cuda.is_available():
    print("no CUDA device: nothing to measure")
    sys.exit(0)

dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29513",
                        device_id=torch.device("cuda", 0))
torch.cuda.set_device(0)
cfg = SIZES["gpt2-124m"]
B, STEPS = 8, 4
SLOW = CostModel(world_size=1, flops_per_s=1e6, bytes_per_s=1e6, op_overhead_s=1e-3, collectives={})

def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (B, cfg.block_size), generator=g).cuda()
    return x, torch.roll(x, -1, 1)

def run(label, **activations):
    torch.manual_seed(0)
    config = zerograph.Config(activations=zerograph.ActivationPolicy(**activations))
    model = zerograph.compile(GPT(cfg).cuda(), stage=3, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, peaks, times = [], [], []
    for step in range(STEPS):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model(*batch(step))
        loss = out[1] if isinstance(out, tuple) else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        losses.append(loss.item())
    s = zerograph.stats(model)
    print(f"{label:<22} loss {losses}  step peak above start MiB {[round(p/2**20,1) for p in peaks]}  "
          f"median step ms {statistics.median(times[1:])*1e3:.1f}  saved act MiB {s.saved_activation_bytes/2**20:.1f}  "
          f"offloaded MiB {s.offloaded_activation_bytes/2**20:.1f}", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return losses, s.saved_activation_bytes

for label, kw in [("unconstrained", {})]:
    free_losses, free_saved = run(label, **kw)
half = free_saved // 2
for label, kw in [("half budget, recompute", dict(budget_bytes=half)),
                  ("half budget, offload", dict(budget_bytes=half, offload=True, cost_model=SLOW))]:
    try:
        losses, _ = run(label, **kw)
        print("   max |loss - unconstrained| =", max(abs(a - b) for a, b in zip(losses, free_losses)))
    except Exception:
        traceback.print_exc()
dist.destroy_process_group()
