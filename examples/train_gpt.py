"""Train the GPT example on real text with zerograph: the Python standard library's own sources.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --stage 3 --steps 300

Bytes are tokens (vocab 256). Every rank draws the same global batch from one seed and trains on its
slice, so the run is the same as single-process training on the global batch. Each log line shows
the loss, tokens/s, each rank's resident model-state bytes beside the ZeRO paper's formula for the
stage, and the step's communication volume beside the paper's 2Ψ (stages 0-2) / 3Ψ (stage 3), and
the bytes each rank sent per collective kind. With ``--gather-quantization int8`` (ZeRO++'s qwZ) the
all-gathers move bytes (int8 values and fp32 scales), so their part of the Ψ multiple counts bytes;
likewise the reduce-scatters with ``--reduce-quantization int8`` (qgZ).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sysconfig
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerograph
from zerograph.models.gpt import GPT, SIZES
from zerograph.shard.hybrid import parse_mesh_shape

IDEAL_VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}  # multiples of Ψ per step (paper, section 7)


def stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The standard library's ``.py`` files, in sorted path order, as one uint8 tensor (bytes)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1_000_000:
        raise SystemExit(f"found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def get_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts.tolist()]).long()          # (B, T)
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts.tolist()]).long()  # (B, T)
    return x, y


def gb(n: float) -> str:
    return f"{n / 2**20:.2f}MiB"


def mesh_shape(text: str) -> tuple[int, int]:
    """``--mesh RxS`` as ``(R, S)``; a bad value is an argparse usage error, not a traceback."""
    try:
        return parse_mesh_shape(text)
    except zerograph.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage 0-3")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="named model size")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, sequences (split over ranks)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--data-bytes", type=int, default=8_000_000)
    p.add_argument("--lowering", default="auto", choices=["auto", "eager", "inductor"],
                   help="auto: Inductor on CUDA, eager on CPU")
    p.add_argument("--gather-quantization", choices=["int8"], default=None,
                   help="all-gather parameters as block-wise int8 + fp32 scales (ZeRO++ qwZ); default: unquantized")
    p.add_argument("--reduce-quantization", choices=["int8"], default=None,
                   help="reduce-scatter gradients as an all-to-all of int8 blocks + fp32 scales, summed in fp32 "
                        "(ZeRO++ qgZ, one hop); default: unquantized")
    p.add_argument("--mesh", type=mesh_shape, default=None,
                   help="RxS: hybrid sharding over a 2-D mesh of R replicas x S shards (R * S = the world size)")
    p.add_argument("--hpz", type=int, default=None, metavar="M",
                   help="hpZ: backward re-gathers inside groups of M ranks (Config.secondary_partition_size)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    overrides = {k: v for k, v in dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                       block_size=args.block_size).items() if v is not None}
    cfg = dataclasses.replace(SIZES[args.size], **overrides)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    mesh = None
    if args.mesh is not None:
        if not dist.is_initialized():  # the mesh needs the group zerograph.compile would otherwise create
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if args.mesh[0] * args.mesh[1] != dist.get_world_size():
            raise SystemExit(f"--mesh {args.mesh[0]}x{args.mesh[1]} needs {args.mesh[0] * args.mesh[1]} ranks, "
                             f"this job has {dist.get_world_size()}")
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, args.mesh, mesh_dim_names=("replicate", "shard"))
    model = zerograph.compile(model, stage=args.stage, mesh=mesh, config=zerograph.Config(
        lowering=args.lowering, gather_quantization=args.gather_quantization,
        reduce_quantization=args.reduce_quantization, secondary_partition_size=args.hpz))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the world size {world}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    data = stdlib_bytes(args.data_bytes)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    gen = torch.Generator().manual_seed(args.seed)  # same stream on every rank: one global batch
    per_rank = args.batch_size // world
    psi = sum(p.numel() for p in GPT(cfg).parameters()) if rank == 0 else 0
    if rank == 0:
        print(f"zerograph stage {args.stage}, world size {world}, GPT {cfg}, Ψ = {psi:,} parameters, "
              f"{len(data):,} bytes of stdlib source", flush=True)

    tokens_per_step = args.batch_size * cfg.block_size
    t0, first_loss, logged = time.perf_counter(), None, 0
    for step in range(1, args.steps + 1):
        x, y = get_batch(train, args.batch_size, cfg.block_size, gen)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        log = step % args.log_every == 0 or step in (1, args.steps)
        if log:
            stats = zerograph.stats(model, opt if step > 1 else None)
        if step == args.steps and os.environ.get("ZEROGRAPH_DUMP"):
            zerograph.explain(model, opt)  # the dump's summary.md, with this step's totals
        opt.step()
        opt.zero_grad()
        if log:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean = mean.item() / world
            first_loss = first_loss if first_loss is not None else mean
            elapsed = time.perf_counter() - t0
            resident = [None] * world
            dist.all_gather_object(resident, {"resident": stats.resident_bytes, "transient": stats.transient_bytes})
            if rank == 0:
                volume = sum(stats.comm_elements.values())
                sent = ", ".join(f"{kind} {n / 2**20:.3f}MiB" for kind, n in stats.comm_bytes.items() if n)
                if len(stats.comm_bytes_per_dim) > 1:  # hybrid sharding or hpZ: per group
                    sent += " (" + "; ".join(f"{dim}: " + ", ".join(f"{k} {n / 2**20:.3f}MiB" for k, n in c.items() if n)
                                             for dim, c in stats.comm_bytes_per_dim.items()) + ")"
                print(f"step {step:4d} | loss {mean:.4f} | {tokens_per_step * (step - logged) / elapsed:8.0f} tok/s"
                      f" | comm {volume / psi:.3f}Ψ (paper {IDEAL_VOLUME[args.stage]}Ψ) | sent {sent}", flush=True)
                for r, res in enumerate(resident):
                    line = "  ".join(f"{k} {gb(v)} (formula {gb(stats.formula_bytes[k])})"
                                     for k, v in res["resident"].items())
                    line += (f"  | in flight: gathered params {gb(res['transient']['params'])}, "
                             f"full grads {gb(res['transient']['grads'])}")
                    print(f"           rank {r}: {line}", flush=True)
            t0, logged = time.perf_counter(), step

    model.eval()
    with torch.no_grad():
        vx, vy = get_batch(val, args.batch_size, cfg.block_size, torch.Generator().manual_seed(1))
        val_loss = model(vx[rank * per_rank : (rank + 1) * per_rank], vy[rank * per_rank : (rank + 1) * per_rank])
        dist.all_reduce(val_loss)
    if rank == 0:
        print(f"done: train loss {first_loss:.3f} -> {mean:.3f}, held-out loss {val_loss.item() / world:.3f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
