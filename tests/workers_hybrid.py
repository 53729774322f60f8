"""Rank workers of the hybrid-sharding tests (``tests/test_hybrid.py``): 2-D meshes on gloo."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerograph
from zerograph.graph.ops import GATHER_ACTIVATION
from zerograph.graph.vocab import COLLECTIVE_KINDS
from zerograph.passes.secondary_partition import secondary_partition_outputs
from zerograph.runtime.state import graphs_of, runtime_of_model

from .models import build, global_batch, rank_slice
from .training import train_steps

MESH_DIMS = ("replicate", "shard")


def _full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """``{(param name, state key): full tensor}`` of every tensor state (collective over the mesh)."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[name, key] = value.full_tensor()
    return out


def hybrid_training(rank: int, world_size: int, runs: tuple[tuple[str, int], ...], steps: int, batch_size: int,
                    lr: float, ckpt_dir: str) -> dict:
    """Each ``(name, stage)`` of ``runs`` trained on a ``(2, world_size // 2)`` mesh; then the last
    run is saved with ``zerograph.checkpoint.save`` and loaded into a model compiled over the
    plain 1-D world (stage 3). Returns plain data: losses, full parameters and the last step's
    full gradients per run, each rank's local shards, stats, and the reload's values."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=MESH_DIMS)
    out: dict = {"coordinate": mesh.get_coordinate()}
    for name, stage in runs:
        torch._dynamo.reset()  # a fresh model per run: Dynamo keeps at most 8 graphs per code object
        model = zerograph.compile(build(name), stage, mesh=mesh)
        last: dict = {}

        def keep(step: int, opt: torch.optim.Optimizer, model=model, last=last) -> None:
            if step == steps - 1:
                last["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                last["stats"] = zerograph.stats(model, opt)
                # the global norm over the 2-D DTensor gradients; a max_norm this large scales by 1
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
                last["grad_norm"] = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()

        def loss_of(step: int, model=model, name=name) -> torch.Tensor:
            return model(*rank_slice(global_batch(name, step, batch_size), rank, world_size))

        opt, losses = train_steps(model, loss_of, steps, lr, after_backward=keep)
        rt = runtime_of_model(model)
        out[name, stage] = {
            "losses": losses,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "local": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "placements": {n: (tuple(p.placements), p.device_mesh.shape) for n, p in model.named_parameters()},
            "grads": last["grads"],
            "stats": last["stats"],
            "grad_norm": last["grad_norm"],
            "full_state_dict": zerograph.checkpoint.full_state_dict(model),  # rank 0 only (cpu_offload)
            "padded": [sum(rt.layouts[k].padded_numel for k in unit.keys) for unit in rt.units],
        }
    out["meta_init"] = _meta_init(mesh)
    batch = rank_slice(global_batch(name, steps, batch_size), rank, world_size)
    with torch.no_grad():
        loss_before = model(*batch).item()
    zerograph.checkpoint.save(model, opt, ckpt_dir)
    out["saved"] = {"params": out[name, stage]["params"], "optimizer": _full_optimizer_state(model, opt),
                    "name": name, "stage": stage, "loss": loss_before}
    torch._dynamo.reset()
    flat = zerograph.compile(build(name), 3)  # the same 4 ranks as one shard group
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=lr)
    zerograph.checkpoint.load(flat, flat_opt, ckpt_dir)
    with torch.no_grad():
        loss_after = flat(*batch).item()
    out["reload_1d"] = {"params": {n: p.full_tensor() for n, p in flat.named_parameters()},
                        "optimizer": _full_optimizer_state(flat, flat_opt), "loss": loss_before,
                        "loss_after": loss_after, "mesh": tuple(next(flat.parameters()).device_mesh.shape)}
    return out


def _meta_init(mesh) -> dict:
    """The uneven MLP built on meta, compiled on ``mesh`` at stage 3, ``init_weights`` with seed
    0, and, into a second one, ``load_state_dict`` of the ordinary build's full tensors: both
    gathered back (full tensors, for a bitwise comparison with ``build("mlp")``)."""
    from .models import UnevenMLP

    torch._dynamo.reset()
    with torch.device("meta"):
        model = UnevenMLP()
    model = zerograph.compile(model, 3, mesh=mesh, device="cpu")
    torch.manual_seed(0)  # build("mlp")'s seed
    zerograph.init_weights(model)
    with torch.device("meta"):
        loaded = UnevenMLP()
    loaded = zerograph.compile(loaded, 3, mesh=mesh, device="cpu")
    loaded.load_state_dict(build("mlp").state_dict())
    return {"init": {n: p.full_tensor() for n, p in model.named_parameters()},
            "loaded": {n: p.full_tensor() for n, p in loaded.named_parameters()},
            "local": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def hybrid_reload(rank: int, world_size: int, name: str, stage: int, ckpt_dir: str) -> dict:
    """Load the checkpoint into a ``(1, world_size)`` mesh (a replicate dim of one rank)."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=MESH_DIMS)
    model = zerograph.compile(build(name), stage, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zerograph.checkpoint.load(model, opt, ckpt_dir)
    out = {"params": {n: p.full_tensor() for n, p in model.named_parameters()},
           "optimizer": _full_optimizer_state(model, opt),
           "mesh": tuple(next(model.parameters()).device_mesh.shape)}
    # one more step trains on the loaded state (the replicate dim of one rank adds no collective)
    model(*rank_slice(global_batch(name, 0, 4), rank, world_size)).backward()
    opt.step()
    out["stats"] = zerograph.stats(model, opt)
    dist.barrier()
    return out



def hpz_graph_facts(rank: int, world_size: int, size: int, name: str = "gpt", templates: bool = True,
                    bucketing: bool = True) -> dict:
    """One step of the tiny GPT ``name`` at stage 3 with hpZ over nodes of ``size`` ranks: what its
    backward graph all-gathers over which group, what its forward saves, and the step's bytes per dim."""
    config = zerograph.Config(secondary_partition_size=size, unit_templates=templates,
                              disabled_passes=() if bucketing else ("bucketing",))
    model = zerograph.compile(build(name), 3, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*rank_slice(global_batch(name, 0, 4), rank, world_size)).backward()
    opt.step()
    stats = zerograph.stats(model, opt)
    runtime = runtime_of_model(model)
    record = graphs_of(model)[0]
    forward, backward = record["forward"].graph, record["backward"].graph
    return {
        "world_gathers_in_backward": sum(COLLECTIVE_KINDS.get(n.target) == "all_gather" for n in backward.nodes),
        "node_gathers_in_backward": [(n.args[2] == runtime.topology.secondary_group_name, n.args[3])
                                     for n in backward.nodes if n.target is GATHER_ACTIVATION],
        "node_gathers_of_saved_pieces": sum(n.target is GATHER_ACTIVATION and n.args[0].op == "placeholder"
                                            for n in backward.nodes),
        "pieces_saved": len(secondary_partition_outputs(forward)),
        "comm_bytes_per_dim": {d: dict(c) for d, c in stats.comm_bytes_per_dim.items()},
        "secondary_partition_bytes": stats.secondary_partition_bytes,
        "saved_activation_bytes": stats.saved_activation_bytes,
    }
