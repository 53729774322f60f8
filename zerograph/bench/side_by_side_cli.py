"""``zerograph memory``: peak memory per rank, side by side (``side_by_side``), from the command line.

    zerograph memory --world-size 64 --json memory.json

Rank 0 of a fake world of ``--world-size`` (``zerograph.fake_world``: no peers, collectives move
no data, every tensor of this rank real and of its real size), the same meta-built model for
every system, AdamW, two fp32 steps; each system in its own fresh process with
``MALLOC_MMAP_THRESHOLD_=65536`` so the resident set follows live tensors. Prints a markdown
table of peak RSS growth (MiB) per system, ``zerograph.plan``'s predicted stage-3 step peak
and its ratio to the measured one, and zerograph's ratio to FSDP2 eager; ``--json`` writes every
figure (with the breakdowns). Definitions: ``zerograph/bench/side_by_side.py``.

Models (``--models``; sizes ``WIDTHxBLOCKS:BATCHxSEQ``, the batch being this rank's):
  gpt    zerograph.models.gpt, blocks in an nn.ModuleList    (--gpt,   default 1024x16:2x256)
  llama  zerograph.models.llama, torchtitan-style, layers in an nn.ModuleDict (--llama, default 1024x8:1x128)
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
    p.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--world-size", type=int, default=64, help="N, the fake world rank 0 belongs to")
    p.add_argument("--gpt", type=size, help="the GPT's size (default 1024x16:2x256)")
    p.add_argument("--llama", type=size, help="the Llama's size (default 1024x8:1x128)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (width must be a multiple)")
    p.add_argument("--steps", type=int, default=2, help="training steps per system")
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
        changes = getattr(args, name) or {}
        specs[name] = dataclasses.replace(MODELS[name], heads=args.heads, **changes)
        if specs[name].dim % args.heads:
            print(f"zerograph memory: --{name}: width {specs[name].dim} is not a multiple of --heads {args.heads}",
                  file=sys.stderr)
            return 2
    result = side_by_side(specs, args.world_size, systems, steps=args.steps, timeout_s=args.timeout,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
    result["command"] = command or args.invocation  # the example passes its own; zerograph.cli sets it
    print(format_table(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0
