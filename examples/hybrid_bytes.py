"""Bytes per step per mesh dim under hybrid sharding, measured (``zerograph.stats``) beside the plan.

    torchrun --standalone --nproc-per-node 4 examples/hybrid_bytes.py --mesh 2x2 --stage 3

Trains the named GPT size for ``--steps`` AdamW steps on random tokens over a ``(replicate,
shard)`` mesh (``--mesh RxS``; ``1xN`` is plain sharding over N ranks) and prints, on rank 0, what
one step sent per mesh dim and kind against ``zerograph.plan(..., replicas=R)``, in bytes and in
units of Ψ (the model's parameters, 4 bytes each in fp32).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerograph
from zerograph.models.gpt import GPT, SIZES
from zerograph.shard.hybrid import parse_mesh_shape


def mesh_shape(text: str) -> tuple[int, int]:
    """``--mesh RxS`` as ``(R, S)``; a bad value is an argparse usage error, not a traceback."""
    try:
        return parse_mesh_shape(text)
    except zerograph.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--mesh", default=(2, 2), type=mesh_shape, help="RxS: replicas x shards, R * S = the world size")
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    replicas, shards = args.mesh
    dist.init_process_group("gloo")
    if replicas * shards != dist.get_world_size():
        if dist.get_rank() == 0:
            print(f"hybrid_bytes.py: --mesh {replicas}x{shards} needs {replicas * shards} ranks, "
                  f"this job has {dist.get_world_size()}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    cfg = SIZES[args.size]
    torch.manual_seed(0)
    model = zerograph.compile(GPT(cfg), args.stage, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
        model(x, torch.roll(x, -1, dims=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    stats = zerograph.stats(model, opt)
    with torch.device("meta"):
        planned = zerograph.plan(GPT(cfg), args.stage, shards, replicas=replicas, param_dtype=torch.float32)
    if dist.get_rank() == 0:
        psi_bytes = 4 * stats.num_params
        print(f"{args.size} GPT, Ψ = {stats.num_params:,}, stage {args.stage}, mesh {replicas} x {shards} "
              f"(replicate x shard), fp32; bytes rank 0 sent in one step:")
        for dim, sent in stats.comm_bytes_per_dim.items():
            for kind, measured in sent.items():
                if measured or planned.comm_bytes_per_dim.get(dim, {}).get(kind):
                    plan_bytes = planned.comm_bytes_per_dim[dim][kind]
                    print(f"  {dim:>9} {kind:<14} {measured:>12,} B = {measured / psi_bytes:.4f} Ψ·4B"
                          f"   plan {plan_bytes:>12,} B{'' if plan_bytes == measured else '  (differs)'}")
        total = sum(sum(sent.values()) for sent in stats.comm_bytes_per_dim.values())
        print(f"  total {total:,} B = {total / psi_bytes:.4f} Ψ·4B")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
