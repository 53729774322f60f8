"""``zerograph memory``: peak memory per rank, side by side (``side_by_side``), from the command line.

    zerograph memory --world-size 64 --json memory.json

Rank 0 of a fake world of ``--world-size`` (collectives move no data, every tensor of this rank
real), the same meta-built model for every system, AdamW, two fp32 steps, each system in its own
process. Prints a markdown table of peak RSS growth (MiB) per system, ``zerograph.plan``'s
predicted stage-3 step peak and its ratio to the measured one, and zerograph's ratio to FSDP2
eager; ``--json`` writes every figure. Below it, the step time of the same runs (median, min-max
of the steps after ``--warmup``) and how many of zerograph's units ran their unit template.
Method and definitions: docs/memory.md, section "Side by side with FSDP2".

Models (``--models``; sizes ``WIDTHxBLOCKS:BATCHxSEQ``, the batch being this rank's; ``--size``
sets every model's size not set by its own flag):
  gpt          zerograph.models.gpt, blocks in an nn.ModuleList        (--gpt, default 1024x16:2x256)
  llama        zerograph.models.llama, torchtitan-style, layers in an nn.ModuleDict (--llama, default 1024x8:1x128)
  hf-gpt2      transformers' GPT2LMHeadModel from a config, unchanged  (--hf-gpt2, default 1024x8:2x128)
  hf-llama     transformers' LlamaForCausalLM from a config, unchanged (--hf-llama, default 1024x8:2x128)
  titan-llama  zerograph.models.titan_llama: torchtitan's calling conventions (--titan-llama, default 1024x8:2x128)
The real models (the last three) have their loss computed outside the model, as their trainers do.

One line, the real models' step time (rank 0 of a fake world of 8, width 512 x 4 blocks):
  zerograph memory --models hf-gpt2,hf-llama,titan-llama --world-size 8 --size 512x4:2x128 --heads 8 \\
      --steps 6 --warmup 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from .side_by_side import MODELS, SYSTEMS, format_table, side_by_side


def size(text: str) -> dict:
    """``WIDTHxBLOCKS:BATCHxSEQ`` -> the ``ModelSpec`` fields it sets."""
    match = re.fullmatch(r"(\d+)x(\d+):(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected WIDTHxBLOCKS:BATCHxSEQ (e.g. 1024x16:2x256), got {text!r}")
    dim, layers, batch, seq = map(int, match.groups())
    return {"dim": dim, "layers": layers, "batch": batch, "seq": seq}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``zerograph memory`` (and ``examples/memory_side_by_side.py``)."""
    p.add_argument("--models", default="gpt,llama", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--world-size", type=int, default=64, help="N, the fake world rank 0 belongs to")
    for name, spec in MODELS.items():
        p.add_argument(f"--{name}", type=size, help=f"the {name} model's size (default "
                       f"{spec.dim}x{spec.layers}:{spec.batch}x{spec.seq})")
    p.add_argument("--size", type=size, help="the size of every model not given its own")
    p.add_argument("--heads", type=int, default=16, help="attention heads (width must be a multiple)")
    p.add_argument("--steps", type=int, default=2, help="training steps per system")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the step times")
    p.add_argument("--timeout", type=float, default=900, help="seconds per system before it counts as failed")
    p.add_argument("--json", dest="json_path", help="write every figure here")


def run(args: argparse.Namespace, command: str | None = None) -> int:
    """Measure what ``args`` asks, print the table, write the JSON; 0, or 2 on a bad flag."""
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [n for n in names if n not in MODELS] + [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"zerograph memory: unknown model(s) / system(s): {bad}; models: {', '.join(MODELS)}; "
              f"systems: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    specs = {}
    for name in names:
        changes = getattr(args, name.replace("-", "_")) or args.size or {}
        specs[name] = dataclasses.replace(MODELS[name], heads=args.heads, **changes)
        if specs[name].dim % args.heads:
            print(f"zerograph memory: --{name}: width {specs[name].dim} is not a multiple of --heads {args.heads}",
                  file=sys.stderr)
            return 2
    if not 0 <= args.warmup < args.steps:
        print(f"zerograph memory: --warmup {args.warmup} must be >= 0 and below --steps {args.steps}", file=sys.stderr)
        return 2
    result = side_by_side(specs, args.world_size, systems, steps=args.steps, warmup=args.warmup, timeout_s=args.timeout,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
    result["command"] = command or args.invocation  # the example passes its own; zerograph.cli sets it
    print(format_table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0
