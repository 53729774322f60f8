"""``make gpu-check``: the real models on one CUDA GPU, zerograph beside FSDP2, in a few minutes.

    python examples/gpu_check.py [--steps 10] [--warmup 3] [--budget-s 420]

World size 1 (a one-rank NCCL group). Each real model of ``zerograph.bench.real_models`` (Hugging
Face GPT-2 and Llama used unchanged, the torchtitan-shaped Llama) at width 1024 x 8 blocks, 8 x 512
tokens, fp32, AdamW, runs under four systems built by the bench (``zerograph.bench.build_system``):
zerograph stage 3 as built by default (``Config()``) and with the Inductor lowering
(``Config(lowering="inductor")``), FSDP2 (``fully_shard`` per block, then the root) and FSDP2 under
``torch.compile``. Printed per model and system: step time, median (min-max) of the steps after the
warm-up (after ``torch.cuda.synchronize``), ``torch.cuda.max_memory_allocated`` over those steps, and
for zerograph how many of its units ran their unit template (``templated_units``).

Without CUDA it prints ``gpu-check skipped: no CUDA`` and exits 0. A model or system that raises
is reported as failed (its error's first line) and the others still run; the exit status is then 1.
Once ``--budget-s`` seconds have passed the systems not yet run are listed as skipped.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

SYSTEMS = ("zerograph-s3", "zerograph-s3-inductor", "fsdp2", "fsdp2-compile")
MODELS = ("hf-gpt2", "hf-llama", "titan-llama")


def system_spec(name: str):
    """The bench's ``SystemSpec``: zerograph's with ``Config()``'s defaults (not the bench's eager lowering)."""
    from zerograph.bench.systems import SystemSpec

    if name.startswith("fsdp2"):
        return SystemSpec(name, "fsdp2", compiled=name == "fsdp2-compile")
    settings = (("lowering", "inductor"),) if name.endswith("-inductor") else ()
    return SystemSpec(name, "zerograph", 3, settings)


def run_one(model_name: str, system: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Build, warm up and time one system on one model; returns its figures."""
    from zerograph.bench.side_by_side import step_time_summary, templated_units
    from zerograph.bench.systems import build_system, train_step
    from zerograph.bench.workloads import load_workload

    workload = load_workload(model_name, args.batch_size, args.seq_len, 0, args.n_layer, args.n_embd)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model, optimizer = build_system(system_spec(system), workload, device, 1e-4)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats(device)
        batch = tuple(t.to(device) for t in workload.batch(step, 0, 1))
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        train_step(model, optimizer, batch, workload.loss)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = {"time": step_time_summary(times, args.warmup), "peak_bytes": torch.cuda.max_memory_allocated(device),
              "first_step_s": times[0]}
    if system.startswith("zerograph"):
        result["templated"] = templated_units(model)
    del model, optimizer
    return result


def cell(result: dict) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    t = result["time"]
    text = (f"{t['median_s'] * 1e3:,.1f} ms ({t['min_s'] * 1e3:,.1f}-{t['max_s'] * 1e3:,.1f}), "
            f"{result['peak_bytes'] / 2**20:,.0f} MiB, first step {result['first_step_s']:.1f} s")
    if "templated" in result:
        text += f", templated {result['templated']['templated']}/{result['templated']['units']}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=420, help="seconds after which no further system starts")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check skipped: no CUDA")
        return 0
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    start, failed = time.perf_counter(), False
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, world size 1, fp32 AdamW, "
          f"{args.n_embd} x {args.n_layer} blocks, {args.batch_size} x {args.seq_len} tokens; "
          f"median (min-max) of steps {args.warmup + 1}-{args.warmup + args.steps}, max_memory_allocated")
    try:
        for model_name in MODELS:
            print(f"\n{model_name}")
            for system in SYSTEMS:
                if time.perf_counter() - start > args.budget_s:
                    print(f"  {system:<22} skipped: --budget-s {args.budget_s:.0f} s spent")
                    continue
                try:
                    result = run_one(model_name, system, args, device)
                except Exception as exc:  # reported, and the other systems still run
                    failed = True
                    result = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
                print(f"  {system:<22} {cell(result)}", flush=True)
    finally:
        dist.destroy_process_group()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
