"""A Hugging Face Llama built on the meta device, sharded at ZeRO-3, loaded from safetensors shards.

    torchrun --standalone --nproc-per-node 2 examples/train_llama_meta.py --steps 20

What a job does with a model too large for one rank, at a size that runs on a laptop:

1. A random Llama of the same config is saved with ``save_pretrained`` into a temporary
   directory (the "pretrained checkpoint"; no download). ``--max-shard-size`` splits it into
   several files with a ``model.safetensors.index.json``, as large checkpoints are.
2. The model is built on the meta device (no memory), ``zerograph.compile``d at ``--stage``: each
   rank allocates only its shards. The rotary embedding's non-persistent buffers, which no
   checkpoint holds, are computed by Hugging Face's own ``_init_weights`` run through
   ``zerograph.init_weights``; ``zerograph.load_safetensors`` then reads each rank's rows of each
   weight from the files.
3. The same checkpoint is loaded the ordinary way (``LlamaForCausalLM.from_pretrained``, a full
   copy on every rank), compiled the same way, and both train on the Python standard library's
   sources (bytes as tokens). The losses must be equal; the script exits non-zero otherwise.

Needs ``transformers`` (``pip install transformers``).
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sysconfig
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import zerograph


def stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The standard library's ``.py`` files, in sorted path order, as one uint8 tensor (bytes)."""
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def batches(data: torch.Tensor, steps: int, batch: int, block: int, seed: int) -> list[torch.Tensor]:
    """``steps`` global batches of ``batch`` sequences of ``block`` byte tokens, (B, T) int64."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - block, (steps, batch), generator=gen)
    return [torch.stack([data[s:s + block] for s in row.tolist()]).long() for row in starts]


def rotary_buffers(model: torch.nn.Module):
    """An ``init_weights`` fn that computes only what no checkpoint holds: the rotary embedding's
    ``inv_freq`` buffers (Hugging Face's ``_init_weights`` for that module)."""
    def init(module: torch.nn.Module) -> None:
        if "RotaryEmbedding" in type(module).__name__:
            model._init_weights(module)
    return init


def train(model: torch.nn.Module, data: list[torch.Tensor], rank: int, world: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    per = data[0].shape[0] // world
    losses = []
    for tokens in data:
        mine = tokens[rank * per:(rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss  # Hugging Face shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, sequences (split over ranks)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-shard-size", default="100KB", help="save_pretrained's shard size: several files")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.block_size, tie_word_embeddings=True)
    directory = [tempfile.mkdtemp(prefix="zerograph-llama-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    directory = directory[0]
    if rank == 0:  # the "pretrained" checkpoint: a random model of the same config
        torch.manual_seed(args.seed)
        LlamaForCausalLM(config).save_pretrained(directory, max_shard_size=args.max_shard_size)
    dist.barrier()
    data = batches(stdlib_bytes(2_000_000), args.steps, args.batch_size, args.block_size, args.seed)

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = zerograph.compile(model, stage=args.stage, device="cpu")
    zerograph.init_weights(model, rotary_buffers(model))
    zerograph.load_safetensors(model, directory)
    meta_losses = train(model, data, rank, world, args.lr)

    ordinary = LlamaForCausalLM.from_pretrained(directory)
    ordinary = zerograph.compile(ordinary, stage=args.stage)
    ordinary_losses = train(ordinary, data, rank, world, args.lr)

    if rank == 0:
        files = sorted(os.listdir(directory))
        print(f"checkpoint: {len([f for f in files if f.endswith('.safetensors')])} safetensors files + "
              f"{'index' if 'model.safetensors.index.json' in files else 'no index'}; stage {args.stage}, world {world}")
        for step, (a, b) in enumerate(zip(meta_losses, ordinary_losses)):
            print(f"step {step:3d} | meta-built + load_safetensors {a:.6f} | from_pretrained {b:.6f}")
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(meta_losses, ordinary_losses))
    if rank == 0:
        print("losses equal" if same else "LOSSES DIFFER")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    dist.destroy_process_group()
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
