"""Rank functions of the fault tests (spawned by ``tests.distributed.spawn``); they return plain data.

Every fault is provoked on purpose and the error each rank sees is returned as ``describe(exc)``,
so the tests can check the type and the message on every rank.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import zerograph
from zerograph.runtime.state import graphs_of

from .distributed import run_case_in_step

WIDTH = 8


class Stack(nn.Module):
    """Three ``Linear(width, width)`` blocks, three units; ``depth`` of them run (control flow).

    Input (B, T, width): the sequence length T may differ per rank, the parameters may not.
    """

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])

    def forward(self, x: torch.Tensor, depth: int = 3) -> torch.Tensor:
        for block in self.blocks[:depth]:
            x = torch.tanh(block(x))  # (B, T, width)
        return x.square().mean()


def build_stack(width: int = WIDTH, stage: int = 3, config: zerograph.Config | None = None) -> nn.Module:
    torch.manual_seed(0)
    return zerograph.compile(Stack(width), stage=stage, config=config)


def batch(seq_len: int, width: int = WIDTH) -> torch.Tensor:
    return torch.randn(2, seq_len, width, generator=torch.Generator().manual_seed(seq_len))


def describe(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "zerograph": isinstance(exc, zerograph.ZeroGraphError),
            "message": str(exc), "cause": repr(exc.__cause__)}


def error_of(step) -> dict | None:
    """Run ``step()``; the error it raised as plain data, or ``None``."""
    try:
        step()
    except Exception as exc:  # the error a user sees
        return describe(exc)
    return None


def schedule_checks(rank: int, world_size: int) -> dict:
    """Legal per-rank sequence lengths, then three kinds of divergence, on one process group (a
    mismatch leaves the group usable: every rank ran the same check collectives)."""
    model = build_stack()
    seq_len = 16 if rank == 0 else 8  # each rank its own length: different graphs, same collectives
    results = {"legal": error_of(lambda: model(batch(seq_len)).backward()), "seq_len": seq_len,
               "graph_shapes": [tuple(p.meta["val"].shape) for p in
                                graphs_of(model)[0]["forward"].graph.find_nodes(op="placeholder")]}
    # rank 1 skips the last block: its forward gathers two units, rank 0's three
    results["control_flow"] = error_of(lambda: model(batch(4), depth=3 if rank == 0 else 2))
    results["after_mismatch"] = error_of(lambda: model(batch(4)).backward())  # the group still works
    # the same divergence at stage 0, where the forward moves nothing: caught before the backward's all-reduces
    ddp = build_stack(stage=0)
    loss = ddp(batch(4), depth=3 if rank == 0 else 2)
    results["stage0_backward"] = error_of(loss.backward)
    # ranks that built different models: refused at compile, before rank 0's values are broadcast
    width = WIDTH if rank == 0 else WIDTH - 2
    results["shapes"] = error_of(lambda: build_stack(width=width))
    return results


def unsupported_uses(rank: int, world_size: int) -> dict:
    """Each unsupported use raises before any collective, so every rank can go on to the next one."""
    model = build_stack()
    model(batch(4)).backward()
    x = batch(4)
    found = {
        "call_submodule": error_of(lambda: model.blocks[0](x)),
        "torch_compile_submodule": error_of(lambda: torch.compile(model.blocks[0], backend="eager")(x)),
        "zerograph_compile_submodule": error_of(lambda: zerograph.compile(model.blocks[1], stage=3)),
        "zerograph_compile_twice": error_of(lambda: zerograph.compile(model, stage=1)),
    }
    model.blocks[1].weight.requires_grad_(False)
    found["freeze_after_compile"] = error_of(lambda: model(x))
    model.blocks[1].weight.requires_grad_(True)
    found["unfrozen_again"] = error_of(lambda: model(x).backward())
    model.blocks[2].scale = nn.Parameter(torch.ones(()))
    found["parameter_added"] = error_of(lambda: model(x))
    replaced = build_stack()
    replaced.blocks[0].bias = nn.Parameter(torch.zeros(WIDTH))
    found["parameter_replaced"] = error_of(lambda: replaced(x))
    grown = build_stack()
    grown.head = nn.Linear(WIDTH, 1)
    found["submodule_added"] = error_of(lambda: grown(x))
    found["frozen_before_compile"] = _frozen_before_compile()
    return found


def _frozen_before_compile() -> dict:
    """The LoRA pattern's order (freeze, then compile) stays legal and keeps frozen weights exact."""
    torch.manual_seed(0)
    stack = Stack()
    stack.blocks[1].requires_grad_(False)
    frozen = stack.blocks[1].weight.detach().clone()
    model = zerograph.compile(stack, stage=3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    error = error_of(lambda: [model(batch(4)).backward(), opt.step(), opt.zero_grad()])
    weight = model.blocks[1].weight
    return {"error": error, "unchanged": torch.equal(weight.full_tensor(), frozen), "grad": weight.grad}


def one_rank_goes_silent(rank: int, world_size: int, flag_dir: str) -> dict:
    """Twice, after a good step, rank 1 fails in Python before its forward (a bad batch) and stays
    alive without calling the model; rank 0 must raise within a timeout instead of waiting.

    1. on a new group with a 3 s process-group timeout and the default ``Config`` (300 s);
    2. on the world group (60 s timeout, from the test) with ``Config(timeout_s=2)``.
    Each time rank 0 then calls the model again: the group is out of step, so it must raise at once.
    The first leaves no collective pending (gloo gave up), so the second starts clean.
    """
    short = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=3))
    episodes = {}
    for name, group, config in (("group_timeout", short, None),
                                ("config_timeout", None, zerograph.Config(timeout_s=2))):
        torch.manual_seed(0)
        model = zerograph.compile(Stack(), stage=3, process_group=group, config=config)
        model(batch(4)).backward()
        flag = os.path.join(flag_dir, name)
        if rank == 1:
            episodes[name] = error_of(_load_bad_batch)
            deadline = time.monotonic() + 120
            while not os.path.exists(flag) and time.monotonic() < deadline:  # alive, but silent
                time.sleep(0.05)
            continue
        start = time.monotonic()
        episodes[name] = {**(error_of(lambda: model(batch(4)).backward()) or {}), "elapsed_s": time.monotonic() - start}
        start = time.monotonic()  # the group is out of step now: the next call must not communicate
        episodes[name]["again"] = {**(error_of(lambda: model(batch(4)).backward()) or {}),
                                   "elapsed_s": time.monotonic() - start}
        open(flag, "w").close()  # let rank 1 go on
    return episodes


def _load_bad_batch() -> None:
    raise ValueError("corrupt record in shard 7")


def dies_between_forward_and_backward(rank: int, world_size: int, report: str) -> None:
    """Rank 1 exits abruptly after its forward; rank 0's backward must raise, not hang.

    Rank 1 leaves with ``os._exit(0)`` so that ``spawn`` reports rank 0's error (its traceback) rather
    than the death; rank 0 saves what it saw to ``report`` and re-raises.
    """
    model = build_stack(config=zerograph.Config(timeout_s=5))
    model(batch(4)).backward()
    loss = model(batch(4))
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        loss.backward()
    except Exception as exc:
        torch.save({**describe(exc), "elapsed_s": time.monotonic() - start}, report)
        raise
    torch.save({"type": None, "elapsed_s": time.monotonic() - start}, report)


def replica_and_checkpoint_faults(rank: int, world_size: int, root: str) -> None:
    """Replica and checkpoint faults on two ranks, in one spawn; each rank saves its results to
    ``root/result{rank}.pt`` before the last case, in which rank 1 dies inside ``checkpoint.save``
    (so ``spawn`` raises).

    - ``replicas``: every rank seeds ``torch.manual_seed(rank)``; after compile at each stage its
      full parameters and its buffer are returned (they must be rank 0's);
    - ``paths``: ranks pass different paths to save; ``unshared``: the same relative path from a
      different working directory per rank (ranks on machines that share no file system);
      ``unshared_stale``: the same, where rank 1's own disk holds a staging directory of ours, so
      rank 1 writes its shards and token and only the token check can notice;
    - ``corrupt``: one shard of a good two-rank checkpoint damaged: every rank refuses it;
    - ``dead_peer`` (in ``root/dead_peer.pt``, rank 0's view): rank 1 exits while writing.
    """
    import torch.distributed.checkpoint.filesystem as fs

    from zerograph import checkpoint

    out: dict = {"replicas": {}}
    for stage in range(4):
        torch.manual_seed(rank)
        stack = Stack()
        stack.register_buffer("scale", torch.randn(WIDTH))
        model = zerograph.compile(stack, stage=stage)
        out["replicas"][stage] = {**{n: p.full_tensor() for n, p in model.named_parameters()},
                                  "scale": model.scale.clone()}
    model = build_stack(config=zerograph.Config(timeout_s=10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(batch(4)).backward()
    opt.step()
    out["paths"] = error_of(lambda: checkpoint.save(model, opt, f"{root}/rank{rank}"))
    dist.barrier()
    out["after_paths"] = sorted(os.listdir(root))
    dist.barrier()
    home = os.getcwd()
    os.makedirs(f"{root}/host{rank}/ck2.incomplete")
    os.chdir(f"{root}/host{rank}")
    try:
        out["unshared"] = error_of(lambda: checkpoint.save(model, opt, "ck"))
        if rank == 1:  # a leftover of ours on rank 1's disk only
            open(f"ck2.incomplete/{checkpoint.STAGING_TAG}", "w").close()
        dist.barrier()
        out["unshared_stale"] = error_of(lambda: checkpoint.save(model, opt, "ck2"))
        out["host_listing"] = sorted(os.listdir("."))
    finally:
        os.chdir(home)
    checkpoint.save(model, opt, f"{root}/good")
    dist.barrier()
    if rank == 0:
        shard = f"{root}/good/__1_0.distcp"
        with open(shard, "r+b") as f:  # one bit of the middle byte flipped in place
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x01]))
    dist.barrier()
    out["corrupt"] = error_of(lambda: checkpoint.load(model, opt, f"{root}/good"))
    torch.save(out, f"{root}/result{rank}.pt")
    dist.barrier()
    if rank == 1:
        fs.FileSystemWriter.write_data = lambda self, plan, planner: os._exit(0)
    start = time.monotonic()
    try:
        checkpoint.save(model, opt, f"{root}/dead")
    except BaseException as exc:
        torch.save({**describe(exc), "elapsed_s": time.monotonic() - start}, f"{root}/dead_peer.pt")
        raise
    torch.save({"type": None}, f"{root}/dead_peer.pt")


def cases_out_of_step(rank: int, world_size: int, case: str) -> None:
    """Two ranks leave one case of a multi-case run out of step (``run_case_in_step`` must stop the
    run there): ``"raised"``, rank 0 raises where rank 1 returns; ``"extra collective"``, rank 0
    posts a send to rank 1, which receives nothing, so rank 0 has run one more operation on the
    world group."""
    def one_sided() -> None:
        if case == "raised" and rank == 0:
            raise ValueError("a bad batch on rank 0 only")
        if case == "extra collective" and rank == 0:
            dist.isend(torch.ones(1), 1)  # never received, never waited for

    run_case_in_step(case, one_sided)
    run_case_in_step("the next case", lambda: None)
