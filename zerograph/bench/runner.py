"""The body of every rank: join the process group, then for each system build it, warm up, time,
profile and count its steps, and gather the ranks' figures into one record (rank 0 returns the
whole result). Every system starts from the same seed and sees the same batches.

Source: ``torch.distributed`` (``init_process_group``, ``all_gather_object``); the step time
definition in docs/bench.md (``report.DEFINITIONS``).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import gc
import itertools
import os
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import (
    comm_breakdown,
    count_collectives,
    zerograph_volume,
    zerograph_wait_breakdown,
)
from .memory import MemoryProbe, allocation_summary, held_bytes, profile_allocations
from .profiling import median_window, profile_steps, sync_device
from .report import DEFINITIONS, machine_description
from .simulation import Cluster, clusters_for, simulate_system, simulation_summary
from .systems import SystemSpec, build_system, parse_systems, train_step
from .workloads import (
    Workload,
    load_workload,
    padded_params,
    shapes_only,
    tokens_per_step,
    unique_params,
)


def rank_main(options: dict) -> dict | None:
    """Body of every rank: join the group, measure every system; rank 0 returns the result.

    ``options``: the parsed flags as a dict, plus ``command_line`` (the flags that reproduce the
    run). A rank that raises leaves without the closing barrier: its peers may be blocked in a
    collective it will never join, and the launcher (``torch.distributed.elastic``) stops them and
    reports this rank's exception.
    """
    args = argparse.Namespace(**options)
    device = _init_distributed(args.backend)
    result = measure_all(args, device)
    dist.barrier()  # no rank tears the group down while a peer still talks to it
    dist.destroy_process_group()
    return result


def _init_distributed(backend: str = "auto") -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    timeout = datetime.timedelta(minutes=10)
    if torch.cuda.is_available():
        # NCCL refuses two ranks on one GPU; gloo (which stages CUDA tensors through the host) does not
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if backend == "gloo":
            dist.init_process_group("gloo", timeout=timeout)
        else:
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        # ranks share the cores: one intra-op thread pool per rank, sized to its share
        threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // local_world))
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", timeout=timeout)
    return device


def measure_all(args: argparse.Namespace, device: torch.device) -> dict | None:
    """Measure every system of ``args.systems`` in order; rank 0 returns the whole result."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    specs = parse_systems(args.systems, args.prefetch_depth, args.bucket_bytes)
    workload = load_workload(args.model, args.batch_size, args.seq_len, args.seed, args.n_layer, args.n_embd)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    clusters = clusters_for(args, device) if args.simulate else []  # this machine first
    reference = shapes_only(workload)
    model_info = {"name": workload.name, "psi": unique_params(reference),
                  "psi_padded": padded_params(reference, world_size), **workload.description,
                  "tokens_per_step": tokens_per_step(workload, world_size)}
    del reference
    _prime_compiler()
    prime_systems(specs, device, args.lr)
    from tqdm import tqdm

    per_system = args.warmup + args.steps + 2 * args.profile_steps + 1
    systems: dict[str, dict] = {}
    with tqdm(total=len(specs) * per_system, disable=rank != 0, unit="step", file=sys.stderr) as progress:
        for spec in specs:
            progress.set_description(spec.name)
            systems[spec.name] = run_system(spec, workload, args, device, model_info, clusters, progress)
    if rank != 0:
        return None
    return {
        "command": "zerograph bench " + args.command_line,
        "machine": machine_description(device, world_size, load_start),
        "model": model_info,
        "settings": {k: getattr(args, k) for k in ("steps", "warmup", "profile_steps", "batch_size", "seq_len", "n_layer",
                                                   "n_embd", "lr", "seed", "prefetch_depth", "bucket_bytes")},
        "definitions": DEFINITIONS,
        "systems": systems,
        "loss_check": loss_check(systems),
        "simulate": simulation_summary(systems, clusters, args),
    }


def _prime_compiler() -> None:
    """Compile and run a tiny function with a backward once, so that the first measured system
    does not pay alone for loading ``torch.compile``'s machinery (its modules and caches stay in
    the RSS and would count as that system's memory)."""
    double_sum = torch.compile(lambda x: (x * 2).sum(), backend="aot_eager")
    x = torch.ones(4, requires_grad=True)
    double_sum(x).backward()


def prime_systems(specs: list[SystemSpec], device: torch.device, lr: float) -> list[SystemSpec]:
    """Build each kind of system of ``specs`` once on the ``tiny`` GPT, run one step (a compiled
    one compiles its forward and backward), and drop it, before any system is measured: what a
    process keeps after its first model of a kind (modules imported on first use, process-wide
    caches of Dynamo, AOTAutograd and FSDP2) then sits in every system's baseline instead of in
    the first measured system's peak (docs/benchmarks.md, "Memory", says by how much). One spec
    per ``(kind, compiled, lowering)``; returns those primed. Collective: every rank calls it
    with the same ``specs``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tiny = load_workload("tiny", world_size, None, 0)
    kinds: dict[tuple, SystemSpec] = {}
    for spec in specs:
        lowering = spec.config.lowering if spec.kind == "zerograph" else None
        kinds.setdefault((spec.kind, spec.compiled, lowering), spec)
    primed = list(kinds.values())
    for spec in primed:
        model, optimizer = build_system(spec, tiny, device, lr)
        train_step(model, optimizer, tuple(t.to(device) for t in tiny.batch(0, rank, world_size)))
        del model, optimizer
    return primed


def run_system(spec: SystemSpec, workload: Workload, args: argparse.Namespace, device: torch.device,
               model_info: dict, clusters: list[Cluster], progress: Any) -> dict:
    """Warm up, time, profile and count one system on this rank; every rank returns the merged record."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _release_memory(device)
    memory = MemoryProbe(device)
    torch.manual_seed(args.seed)
    model, optimizer = build_system(spec, workload, device, args.lr)
    steps = itertools.count()  # global step numbers: every system sees the same batches
    batch_of = lambda step: tuple(t.to(device) for t in workload.batch(step, rank, world_size))  # noqa: E731

    losses: list[torch.Tensor] = []
    times: dict[str, list[float]] = {"warmup_s": [], "step_s": []}
    for phase, count in (("warmup_s", args.warmup), ("step_s", args.steps)):
        if phase == "step_s":
            memory.start_peak()  # the peak of training steps, not of compiling
        for _ in range(count):
            seconds, loss = _timed_step(model, optimizer, batch_of(next(steps)), device, workload.loss)
            times[phase].append(seconds)
            losses.append(loss)
            progress.update()
    peak = memory.result()

    events, windows = profile_steps(lambda: train_step(model, optimizer, batch_of(next(steps)), workload.loss),
                                    args.profile_steps, device)
    progress.update(args.profile_steps)
    breakdowns = [comm_breakdown(events, w, device) for w in windows]
    # separate steps: recording every allocation slows the step, so the timed profile runs without it
    held = held_bytes(model, optimizer)
    peaks, at_peak = profile_allocations(lambda: train_step(model, optimizer, batch_of(next(steps)), workload.loss),
                                         args.profile_steps, device)
    progress.update(args.profile_steps)
    mine = {**times, "memory": peak, "profile": breakdowns,
            "allocations": {"state_bytes_by_kind": held, "step_peak_bytes": peaks, "at_peak": at_peak}}
    if spec.kind == "zerograph":
        mine["comm_elements"] = zerograph_volume(model)
        mine["waits"] = zerograph_wait_breakdown(events, windows)
        if clusters and rank == 0 and windows:
            mine["simulate"] = simulate_system(spec, model, events, median_window(windows), clusters,
                                               workload, world_size)
    else:
        mine["comm_elements"] = count_collectives(lambda: train_step(model, optimizer, batch_of(next(steps)), workload.loss))
    progress.update()
    mine["losses"] = _global_losses(losses, world_size)
    ranks: list[Any] = [None] * world_size
    dist.all_gather_object(ranks, mine)
    del model, optimizer, events
    return merge_ranks(spec, ranks, model_info)


def _timed_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, device: torch.device,
                loss_fn: Any = None) -> tuple[float, torch.Tensor]:
    sync_device(device)
    dist.barrier()  # every rank starts together: a step's time is not a peer's lateness
    start = time.perf_counter()
    loss = train_step(model, optimizer, batch, loss_fn)
    sync_device(device)
    return time.perf_counter() - start, loss


def _global_losses(losses: list[torch.Tensor], world_size: int) -> list[float]:
    """Mean over ranks of each step's loss: the loss of the global batch (equal rank batches)."""
    stacked = torch.stack(losses).double()
    dist.all_reduce(stacked)
    return (stacked / world_size).tolist()


def _release_memory(device: torch.device) -> None:
    """Drop what the previous system left: Dynamo's caches, garbage, and free heap pages."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)  # glibc keeps freed pages in the RSS until trimmed


def merge_ranks(spec: SystemSpec, ranks: list[dict], model_info: dict) -> dict:
    """One system's record from every rank's: a step counts as its slowest rank."""
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    warmup_s = [max(r["warmup_s"][i] for r in ranks) for i in range(len(ranks[0]["warmup_s"]))]
    median = statistics.median(step_s)
    exposed = [statistics.median(p["exposed_comm_s"] for p in r["profile"]) for r in ranks if r["profile"]]
    comm = [statistics.median(p["comm_s"] for p in r["profile"]) for r in ranks if r["profile"]]
    profiled = [statistics.median(p["step_s"] for p in r["profile"]) for r in ranks if r["profile"]]
    elements = ranks[0]["comm_elements"]
    volume = sum(elements.values())
    record = {
        "kind": spec.kind, "spec": spec.describe(),
        "step_s": step_s, "warmup_s": warmup_s, "step_s_per_rank": [r["step_s"] for r in ranks],
        "median_s": median, "min_s": min(step_s), "max_s": max(step_s),
        "tokens_per_s": model_info["tokens_per_step"] / median,
        "exposed_comm_s": statistics.fmean(exposed) if exposed else None,
        "comm_in_flight_s": statistics.fmean(comm) if comm else None,
        "profiled_step_s": statistics.fmean(profiled) if profiled else None,
        "profile_per_rank": [r["profile"] for r in ranks],
        "memory_per_rank": [r["memory"] for r in ranks],
        "peak_memory_bytes": max(r["memory"]["peak_over_baseline_bytes"] for r in ranks),
        "allocations_per_rank": [r["allocations"] for r in ranks],
        **allocation_summary([r["allocations"] for r in ranks]),
        "comm_elements": elements, "comm_elements_total": volume,
        "comm_ratio": volume / model_info["psi"], "paper_ratio": spec.paper_volume,
        "losses": ranks[0]["losses"],
    }
    if "waits" in ranks[0]:
        record["wait_tensor_s_per_rank"] = [r["waits"] for r in ranks]
    if "simulate" in ranks[0]:
        record["simulate"] = ranks[0]["simulate"]
    return record


def loss_check(systems: Mapping[str, dict]) -> dict:
    """Largest difference between systems of the step-1 loss and of the last timed step's loss."""
    firsts = [s["losses"][0] for s in systems.values()]
    lasts = [s["losses"][-1] for s in systems.values()]
    return {"step1": {name: s["losses"][0] for name, s in systems.items()},
            "step1_max_abs_diff": max(firsts) - min(firsts),
            "last_step": len(next(iter(systems.values()))["losses"]),
            "last_max_abs_diff": max(lasts) - min(lasts)}
