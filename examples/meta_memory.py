"""Per-rank peak memory of building, sharding + initialising and the first step of a GPT:
zerograph's meta-device route vs an ordinary build, beside FSDP2's meta-device recipe.

    for route in zerograph-meta zerograph-ordinary fsdp2-meta; do
      MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc-per-node 4 examples/meta_memory.py --route $route
    done

Each phase's figure is the growth of the process's peak resident set (Linux ``VmHWM``, reset
before the phase through ``/proc/self/clear_refs``) over the resident set when the phase began,
in MiB. A benchmark, not a test: the numbers depend on the allocator (``MALLOC_MMAP_THRESHOLD_``
fixed makes freed buffers leave the resident set at once, so the peak counts live memory).

Routes (``--route``; one per launch, so that one's memory does not colour the next):
  zerograph-meta      GPT built under torch.device("meta"), zerograph.compile(stage=3),
                      zerograph.init_weights (bitwise the ordinary build's values)
  zerograph-ordinary  GPT built on the CPU, zerograph.compile(stage=3)
  fsdp2-meta          GPT built on meta, fully_shard per block and root, to_empty(device="cpu"),
                      reset_parameters per module on the DTensor shards (DTensor's RNG: other values)
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import zerograph
from zerograph.models.gpt import GPT, GPTConfig

ROUTES = ("zerograph-meta", "zerograph-ordinary", "fsdp2-meta")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class Phases:
    """Peak RSS growth of consecutive phases, MiB."""

    def __init__(self) -> None:
        self.growth: dict[str, float] = {}

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _kib("VmRSS")

    def end(self, name: str) -> None:
        self.growth[name] = (_kib("VmHWM") - self.base) / 1024


def gpt_init_passes(model: nn.Module, cfg: GPTConfig) -> list:
    import math
    projections = {id(m) for name, m in model.named_modules() if name.endswith("proj")}

    def scaled_projection(module: nn.Module) -> None:
        if id(module) in projections:
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    return [zerograph.reset_parameters, GPT._init_weights, scaled_projection]


def run_route(route: str, cfg: GPTConfig, batch: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    warm_cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=8)
    # a first, tiny run of the same route imports what it needs, so the phases measure the model
    measure(route, warm_cfg, batch, rank, world, Phases())
    phases = Phases()
    measure(route, cfg, batch, rank, world, phases)
    return phases.growth


def measure(route: str, cfg: GPTConfig, batch: int, rank: int, world: int, phases: Phases) -> None:
    torch.manual_seed(0)
    phases.start()
    if route == "zerograph-ordinary":
        model = GPT(cfg)
    else:
        with torch.device("meta"):
            model = GPT(cfg)
    phases.end("construction")
    phases.start()
    if route == "zerograph-meta":
        model = zerograph.compile(model, stage=3, device="cpu")
        zerograph.init_weights(model, gpt_init_passes(model, cfg))
    elif route == "zerograph-ordinary":
        model = zerograph.compile(model, stage=3)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    phases.end("shard + init")
    phases.start()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    per = batch // world
    model(x[rank * per:(rank + 1) * per], torch.roll(x, -1, 1)[rank * per:(rank + 1) * per]).backward()
    opt.step()
    phases.end("first step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--route", choices=ROUTES, default=ROUTES[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    growth = run_route(args.route, cfg, args.batch_size)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, growth)
    if dist.get_rank() == 0:
        psi = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"{args.route}: GPT {cfg.n_layer} blocks x {cfg.n_embd}, {psi * 4 / 2**20:.1f} MiB of fp32 parameters, "
              f"world {dist.get_world_size()}; peak RSS growth per rank, MiB")
        for phase in everyone[0]:
            print(f"  {phase:13s} " + "  ".join(f"{g[phase]:7.1f}" for g in everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
