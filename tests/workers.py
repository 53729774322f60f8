"""Functions that run on each rank (spawned by ``tests.distributed.spawn``); they return plain data."""
from __future__ import annotations

import torch
import torch.fx as fx

import zerograph
from zerograph.graph.vocab import COLLECTIVE_KINDS as COLLECTIVE_OPS
from zerograph.graph.vocab import TAG
from zerograph.passes.liveness import PARAM_ROLES, timeline
from zerograph.runtime.state import runtime_of_model, state_of

from .models import build, global_batch, rank_slice
from .training import train_steps


def train(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float,
          config: zerograph.Config | None = None) -> dict:
    model = zerograph.compile(build(name), stage=stage, config=config)
    last: dict = {}

    def keep_stats(step: int, opt: torch.optim.Optimizer) -> None:
        if step == steps - 1:
            last["stats"] = zerograph.stats(model, opt)

    _, losses = train_steps(model, lambda step: model(*rank_slice(global_batch(name, step, batch_size), rank,
                                                                  world_size)),
                            steps, lr, after_backward=keep_stats)
    stats = last["stats"]
    state = state_of(model)
    return {
        "losses": losses,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "param_ids": [id(p) for p in model.parameters()],
        "stats": stats,
        "units": [(u.name, sum(state.runtime.layouts[k].padded_numel for k in u.keys)) for u in state.runtime.units],
        "graphs": [graph_facts(rec) for rec in state.captured.graphs],
        "input_params": state.captured.input_params,
        "templates": len(state.captured.templates),
        "islands": dict(state.captured.islands),
        # Inductor's FX graph cache, this process so far: a lowering it bypassed is not reused on restart
        "fx_graph_cache": {k: v for k, v in torch._dynamo.utils.counters["inductor"].items() if k.startswith("fxgraph_cache")},
    }


def train_runs(rank: int, world_size: int, runs: tuple[tuple, ...], steps: int, batch_size: int,
               lr: float, config: zerograph.Config | None = None) -> dict:
    """``train`` for each run in turn in this process group: ``{run: result}``. A run is
    ``(name, stage)``, trained under ``config``, or ``(name, stage, config)``. One spawn for
    several runs saves a process start and a first compile per run."""
    out = {}
    for run in runs:
        name, stage, run_config = (*run, config) if len(run) == 2 else run
        torch._dynamo.reset()  # a fresh model per run: Dynamo keeps at most 8 graphs per code object
        out[run] = train(rank, world_size, name, stage, steps, batch_size, lr, run_config)
    return out


def train_configs(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float,
                  configs: tuple[zerograph.Config, ...]) -> list[dict]:
    """``train`` under each config in turn in this process group (one spawn for all)."""
    out = []
    for config in configs:
        torch._dynamo.reset()
        out.append(train(rank, world_size, name, stage, steps, batch_size, lr, config))
    return out


def graph_facts(record: dict[str, fx.GraphModule]) -> dict:
    """What the structure tests check, as plain data (graphs do not cross processes)."""
    facts = {}
    for kind in ("forward", "backward"):
        if kind not in record:
            continue
        graph = record[kind].graph
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        gathers = []
        for node in nodes:
            if COLLECTIVE_OPS.get(node.target) == "all_gather":
                unit = node.meta[TAG]["unit"]
                first_compute = min((pos[u] for n in nodes if n.meta.get(TAG, {}).get("unit") == unit
                                     and n.meta[TAG]["role"] == "gather" for u in n.users
                                     if TAG not in u.meta), default=None)
                gathers.append({"unit": unit, "pos": pos[node], "first_compute": first_compute})
        after_comm: set[fx.Node] = set()  # nodes that need a collective's result
        for n in nodes:
            if n.target in COLLECTIVE_OPS or any(i in after_comm for i in n.all_input_nodes):
                after_comm.add(n)
        compute = [pos[n] for n in nodes if n.op == "call_function" and TAG not in n.meta and n not in after_comm]
        facts[kind] = {
            "gathers": gathers,
            "collective_pos": [pos[n] for n in nodes if n.target in COLLECTIVE_OPS],
            "last_compute": max(compute, default=-1),
            "collectives": [COLLECTIVE_OPS[n.target] for n in nodes if n.target in COLLECTIVE_OPS],
            "placeholders": [n.name for n in nodes if n.op == "placeholder"],
        }
    if "forward" in record:
        fwd = timeline(record["forward"].graph)
        facts["forward"]["saved_gathered"] = [n for n, (role, _) in fwd.saved.items() if role in PARAM_ROLES]
        facts["forward"]["gathered_live_at_end"] = fwd.live[-1].get("gather", 0) if fwd.live else 0
    return facts


def one_rank_quits(rank: int, world_size: int) -> str:
    """Rank 1 leaves before the first step; rank 0's step must fail with an error, not wait."""
    import time

    model = zerograph.compile(build("mlp"), stage=3)
    if rank == 1:
        return "left"
    start = time.monotonic()
    try:
        model(*rank_slice(global_batch("mlp", 0, 4), rank, world_size)).backward()
    except Exception as exc:  # the error a user sees
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "no error"


def world_size_mismatch(rank: int, world_size: int) -> str:
    import os

    os.environ["WORLD_SIZE"] = str(world_size + 1)
    try:
        zerograph.compile(build("mlp"), stage=3)
    except zerograph.ProcessGroupError as exc:
        return str(exc)
    return "no error"


def checkpoint_roundtrip(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """state_dict / torch.distributed.checkpoint on the DTensor shards, saved and loaded back."""
    import torch.distributed.checkpoint as dcp

    model = zerograph.compile(build("gpt"), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = rank_slice(global_batch("gpt", 0, 4), rank, world_size)
    model(*batch).backward()
    opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt_dir)
    restored = zerograph.compile(build("gpt"), stage=3)
    state = {"model": restored.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    restored.load_state_dict(state["model"])
    with torch.no_grad():
        losses = (model(*batch).item(), restored(*batch).item())
    return {
        "losses": losses,
        "equal": all(torch.equal(a.full_tensor(), b.full_tensor())
                     for a, b in zip(model.parameters(), restored.parameters())),
        "full_state": {k: v.full_tensor() for k, v in model.state_dict().items()},
    }


def pooled_training(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float,
                    config: zerograph.Config | None = None) -> dict:
    """``train``, plus what ``buffer_reuse`` did: the pool's allocations and bytes after each
    step, every pooled buffer of every graph, and the liveness peak of gathered parameters."""
    from zerograph.runtime.buffer_pool import POOL_BUFFER

    model = zerograph.compile(build(name), stage=stage, config=config)
    pool = runtime_of_model(model).buffer_pool
    allocations, pool_bytes = [], []

    def read_pool(step: int, opt: torch.optim.Optimizer) -> None:
        allocations.append(pool.allocations)
        pool_bytes.append({"gathered": pool.nbytes("gathered"), "send": pool.nbytes("send")})

    _, losses = train_steps(model, lambda step: model(*rank_slice(global_batch(name, step, batch_size), rank,
                                                                  world_size)),
                            steps, lr, after_step=read_pool)
    state = state_of(model)
    pooled = {}
    for i, record in enumerate(state.captured.graphs):
        for kind in ("forward", "backward"):
            nodes = record[kind].graph.find_nodes(op="call_function", target=POOL_BUFFER) if kind in record else []
            pooled[i, kind] = [{"role": n.args[1], "slot": n.args[2], "tag": n.meta[TAG]["role"],
                                "bytes": n.meta["val"].numel() * n.meta["val"].element_size()} for n in nodes]
    return {
        "losses": losses,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "allocations": allocations,
        "pool_bytes": pool_bytes,
        "pooled": pooled,
        "gathered_peak": {(i, kind): t.peak(PARAM_ROLES) for i, mem in enumerate(state.runtime.accounting.graph_memory)
                          for kind, t in mem.items()},
        "unit_bytes": [sum(state.runtime.layouts[k].padded_numel * state.runtime.layouts[k].param_dtype.itemsize
                           for k in u.keys) for u in state.runtime.units],
        "flat_units": len(state.runtime.flat_shards),
    }


def pooled_trainings(rank: int, world_size: int, name: str, stage: int, steps: int, batch_size: int, lr: float,
                     configs: tuple, debug_pool: tuple = ()) -> list[dict]:
    """``pooled_training`` for each config in turn, in one process group; the i-th run with the
    pool's debug mode (``ZEROGRAPH_DEBUG_POOL=1``) when ``debug_pool[i]``."""
    import os

    runs = []
    for i, config in enumerate(configs):
        os.environ["ZEROGRAPH_DEBUG_POOL"] = "1" if i < len(debug_pool) and debug_pool[i] else "0"
        runs.append(pooled_training(rank, world_size, name, stage, steps, batch_size, lr, config))
        runs[-1]["pool_debug"] = os.environ["ZEROGRAPH_DEBUG_POOL"] == "1"
    os.environ.pop("ZEROGRAPH_DEBUG_POOL")
    return runs
