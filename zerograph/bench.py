"""``zerograph bench``: zerograph's stages and schedules beside DDP and FSDP2, in one run.

    python -m zerograph.bench --model small --nproc 2 --steps 10 \\
        --systems zerograph-s3,zerograph-s3-noov,ddp,fsdp2,fsdp2-compile --json bench.json --png bench.png

One launch runs every system one after another on the same ranks, from the same initial values
(one seed) on the same batches, and reports per system: median / min / max step time, tokens/s,
exposed communication, peak memory (RSS and the allocator's bytes), elements moved per step
against the ZeRO paper's 2Ψ / 3Ψ (arXiv 1910.02054, section 7), and every step's loss, which must
agree across systems.
``--simulate CLUSTER`` projects each zerograph schedule's measured profile onto a cluster
described in ``clusters.json`` (or ``local``: this machine, as a self-consistency check).

Systems (``--systems``, comma-separated):
    zerograph-s<0-3>[-noov][-nopool][-keeproot][-pf<K>][-bb<BYTES>][-inductor]
        ``zerograph.compile`` at that stage; ``-noov`` disables ``config.OVERLAP_PASSES`` (every
        wait right after its start); ``-nopool`` disables ``buffer_reuse`` (comm buffers from the
        allocator each step instead of a pool held across steps); ``-keeproot`` sets
        ``Config.reshard_root_after_forward=False`` (the root unit stays gathered from forward
        to backward, as FSDP2 keeps its root); ``-pf``/``-bb`` override ``--prefetch-depth`` /
        ``--bucket-bytes``; ``-inductor`` lowers with Inductor instead of running FX eagerly.
    ddp             ``torch.nn.parallel.DistributedDataParallel``
    fsdp2           ``torch.distributed.fsdp.fully_shard`` on each block, then on the root
    fsdp2-compile   the same, then ``torch.compile(model)``

A step is ``loss = model(*batch); loss.backward(); opt.step(); opt.zero_grad()`` with
``torch.optim.AdamW`` (no gradient clipping), fp32.

``--model module:factory``: ``factory()`` returns ``(model, batch_fn)``. ``model`` is a CPU
``nn.Module`` whose ``model(*batch)`` returns the scalar mean loss of its inputs; ``batch_fn(step,
rank, world_size)`` returns this rank's inputs (a tuple of tensors) for step ``step``, the same
for every system, the ranks' parts of one global batch of equal size. The factory is called once
per system after ``torch.manual_seed(--seed)``, so it must build the same values each time. FSDP2
wraps the children of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` (zerograph's
default units). Tokens per step are counted as the elements of ``batch[0]`` summed over ranks.

Definitions, identical for every system (also written into the JSON):
    step time       wall time of one step on a rank, from a barrier to the step's end (after
                    ``torch.cuda.synchronize`` on GPU); each step counts as its slowest rank.
    exposed comm    from ``torch.profiler`` over ``--profile-steps`` extra steps: time during which
                    some collective is in flight and the training thread runs no compute op. On
                    CPU a collective is in flight while gloo's worker thread runs it (its
                    ``gloo:*`` event; gloo runs collectives on its own threads for every system,
                    whereas DDP's and FSDP2's waits leave no event on the training thread); compute
                    ops are the outermost operator events of the training thread other than
                    ``c10d::*`` / ``_c10d_functional::*`` (launches and waits). On GPU: NCCL kernels
                    against the other kernels. Median over the profiled steps, mean over ranks.
    peak memory     CPU: the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``
                    after the warm-up steps) during the timed steps, minus the RSS before the
                    system was built (after ``gc`` and ``malloc_trim``); so it counts the model,
                    optimizer states and the step's transients, and the memory kept by compiled
                    code. GPU: ``torch.cuda.max_memory_allocated`` over the timed steps minus the
                    allocation before the build. Max over ranks.
    peak alloc      bytes of the device's torch allocator (CPU: torch's CPU allocator; GPU: CUDA's,
                    as ``max_memory_allocated`` counts them) from ``torch.profiler(profile_memory=
                    True)`` over ``--profile-steps`` further steps (recording each allocation slows
                    the step, so the steps timed for exposed comm run without it): per step, the
                    peak of the running sum of its allocations and frees, i.e. the most bytes the
                    step allocates above what it started with; median over steps, max over ranks.
    state           bytes held at the start of a step, counted from tensors (each storage once):
                    this rank's parameters (a ``DTensor``'s local shard, padding included), ``.grad``,
                    the optimizer's state tensors, module buffers, and the communication buffers
                    kept across steps (zerograph's buffer pool, DDP's gradient buckets). State +
                    peak alloc is the step's peak of allocated bytes (max over ranks of the sum).
    comm volume     elements of the full tensors moved per step (an all-reduce counts twice,
                    paper section 7): zerograph from ``zerograph.stats``; DDP and FSDP2 counted by
                    a dispatch mode over one extra step (every ``c10d`` and functional collective
                    with its real sizes). Divided by Ψ, the unique parameter count.

Sources: ZeRO (Rajbhandari et al., arXiv 1910.02054); FSDP2 (``torch.distributed.fsdp.fully_shard``);
the bus-bandwidth convention of NCCL's nccl-tests (``PERFORMANCE.md``); the two-stream projection
is ``zerograph.timeline.predict``.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import itertools
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .config import OVERLAP_PASSES, Config
from .costmodel import WAIT, CostModel
from .errors import ConfigError
from .state import graphs_of, is_compiled, runtime_of_model
from .timeline import is_top_level_op

log = logging.getLogger(__name__)

DEFAULT_SYSTEMS = ("zerograph-s0,zerograph-s1,zerograph-s2,zerograph-s3,zerograph-s3-noov,"
                   "ddp,fsdp2,fsdp2-compile")
CLUSTERS_FILE = Path(__file__).with_name("clusters.json")
LOCAL_CLUSTER = "local"
STEP_LABEL = "zerograph.bench.step"  # record_function around each profiled step
MIB = 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags on ``parser`` (``zerograph bench`` and ``python -m zerograph.bench``)."""
    defaults = Config()
    parser.add_argument("--model", default="small",
                        help="GPT example size (tiny, small, medium, gpt2-124m) or module:factory (see the module docstring)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps after the timed ones")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help="comma-separated; see the module docstring")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write every raw figure here")
    parser.add_argument("--png", dest="png_path", metavar="PATH", help="write the step-time chart here")
    parser.add_argument("--prefetch-depth", type=int, default=defaults.prefetch_depth,
                        help="zerograph Config.prefetch_depth (units)")
    parser.add_argument("--bucket-bytes", type=int, default=defaults.bucket_bytes,
                        help="zerograph Config.bucket_bytes (bytes)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, sequences (split over ranks)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence; sets the GPT's block_size (default its size's)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init and the batches")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="process-group backend: auto is nccl when CUDA is present, else gloo; gloo with CUDA "
                             "lets several ranks share one GPU (ranks map to GPUs round-robin), for memory figures")
    parser.add_argument("--simulate", metavar="CLUSTER[,CLUSTER]",
                        help=f"project zerograph's measured profiles onto clusters from --clusters, or '{LOCAL_CLUSTER}'")
    parser.add_argument("--clusters", default=str(CLUSTERS_FILE), metavar="PATH",
                        help="JSON table of clusters for --simulate (default: the packaged clusters.json)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerograph bench", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` (``sys.argv[1:]`` when ``None``) and ``run``. Returns the exit status."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed ``args``; 0 on success, 1 when a rank failed, 2 on bad input.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank and rank 0 reports;
    otherwise ``--nproc`` ranks are launched with ``torch.distributed.launcher`` (the engine of
    torchrun) and this process reports what rank 0 returns.
    """
    try:
        _check_args(args)
    except ConfigError as exc:
        print(f"zerograph bench: {exc}", file=sys.stderr)
        return 2
    options = vars(args).copy()
    options.pop("handler", None)  # set when called through the zerograph CLI; not picklable
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = rank_main(options)
        if result is not None:
            report(result, args)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        results = _launch(options, args.nproc)
    except ChildFailedError as exc:
        print(f"zerograph bench: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    report(results[0], args)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA; this machine has none")
    for name in ("nproc", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "profile_steps", "prefetch_depth", "bucket_bytes"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    parse_systems(args.systems, args.prefetch_depth, args.bucket_bytes)
    if ":" not in args.model and args.model not in _example_gpt().SIZES:  # before any rank starts
        raise ConfigError(f"unknown GPT size {args.model!r}; known: {sorted(_example_gpt().SIZES)} (or module:factory)")
    if args.simulate:
        names = [n for n in args.simulate.split(",") if n != LOCAL_CLUSTER]
        table = load_cluster_table(args.clusters)
        unknown = [n for n in names if n not in table]
        if unknown:
            raise ConfigError(f"unknown cluster(s) {unknown} in {args.clusters}; known: "
                              f"{sorted(table)} and '{LOCAL_CLUSTER}'")


def _launch(options: dict, nproc: int) -> dict[int, Any]:
    """Start ``nproc`` local ranks running ``rank_main(options)``; returns ``{rank: result}``."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"zerograph-bench-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.WARNING)  # the agent's INFO lines would bury the table
    try:
        return elastic_launch(config, rank_main)(options)
    finally:
        elastic_log.setLevel(level)


# ---------------------------------------------------------------------------------------------
# systems


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One configuration to measure. ``kind``: ``"zerograph"``, ``"ddp"`` or ``"fsdp2"``."""

    name: str
    kind: str
    stage: int | None = None
    overlap: bool = True
    pool: bool = True
    keep_root: bool = False
    prefetch_depth: int = 1
    bucket_bytes: int = 0
    lowering: str = "eager"
    compiled: bool = False

    @property
    def paper_volume(self) -> int:
        """Multiples of Ψ the ZeRO paper moves per step for this scheme (section 7): 3 for
        ZeRO-3 and FSDP (parameters gathered in forward and again in backward), else 2."""
        return 3 if self.stage == 3 or self.kind == "fsdp2" else 2

    def zerograph_config(self) -> Config:
        return Config(lowering=self.lowering, prefetch_depth=self.prefetch_depth, bucket_bytes=self.bucket_bytes,
                      reshard_root_after_forward=not self.keep_root,
                      disabled_passes=(() if self.overlap else OVERLAP_PASSES) + (() if self.pool else ("buffer_reuse",)))


_ZEROGRAPH_NAME = re.compile(r"^zerograph-s(?P<stage>[0-3])(?P<mods>(?:-(?:noov|nopool|keeproot|inductor|pf\d+|bb\d+))*)$")


def parse_system(name: str, prefetch_depth: int, bucket_bytes: int) -> SystemSpec:
    """``SystemSpec`` of one ``--systems`` entry; raises ``ConfigError`` for an unknown name."""
    if name == "ddp":
        return SystemSpec(name, "ddp")
    if name in ("fsdp2", "fsdp2-compile"):
        return SystemSpec(name, "fsdp2", compiled=name == "fsdp2-compile")
    match = _ZEROGRAPH_NAME.match(name)
    if not match:
        raise ConfigError(f"unknown system {name!r}: expected zerograph-s<0-3>[-noov][-nopool][-keeproot][-pf<K>][-bb<BYTES>]"
                          "[-inductor], ddp, fsdp2 or fsdp2-compile")
    mods = match["mods"].split("-")[1:]
    for mod in mods:
        if mod.startswith("pf"):
            prefetch_depth = int(mod[2:])
        elif mod.startswith("bb"):
            bucket_bytes = int(mod[2:])
    return SystemSpec(name, "zerograph", stage=int(match["stage"]), overlap="noov" not in mods, pool="nopool" not in mods,
                      keep_root="keeproot" in mods,
                      prefetch_depth=prefetch_depth, bucket_bytes=bucket_bytes,
                      lowering="inductor" if "inductor" in mods else "eager")


def parse_systems(text: str, prefetch_depth: int, bucket_bytes: int) -> list[SystemSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--systems needs distinct names, got {text!r}")
    return [parse_system(n, prefetch_depth, bucket_bytes) for n in names]


# ---------------------------------------------------------------------------------------------
# workloads: what is trained


@dataclasses.dataclass
class Workload:
    """A model factory and its data.

    ``build()``: a fresh CPU model (the caller seeds); ``batch(step, rank, world_size)``: this
    rank's inputs of step ``step``; ``blocks(model)``: the modules FSDP2 wraps one by one.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int, int], tuple[torch.Tensor, ...]]
    blocks: Callable[[nn.Module], list[nn.Module]]
    description: dict


def load_workload(model: str, batch_size: int, seq_len: int | None, seed: int) -> Workload:
    """The GPT example at a named size, or a user's ``module:factory``. Raises ``ConfigError``."""
    if ":" in model:
        return _factory_workload(model)
    return _gpt_workload(model, batch_size, seq_len, seed)


def _example_gpt() -> Any:
    """The package's GPT (``zerograph.models.gpt``)."""
    from .models import gpt

    return gpt


def _gpt_workload(size: str, batch_size: int, seq_len: int | None, seed: int) -> Workload:
    gpt = _example_gpt()
    if size not in gpt.SIZES:
        raise ConfigError(f"unknown GPT size {size!r}; known: {sorted(gpt.SIZES)} (or module:factory)")
    cfg = gpt.SIZES[size] if seq_len is None else dataclasses.replace(gpt.SIZES[size], block_size=seq_len)

    def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_size % world_size:
            raise ConfigError(f"--batch-size {batch_size} must be divisible by the world size {world_size}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # same global batch on every rank
        tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=gen)  # (B, T+1)
        per_rank = batch_size // world_size
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]                                   # (B/N, T+1)
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()                               # 2 x (B/N, T)

    return Workload(f"gpt-{size}", lambda: gpt.GPT(cfg), batch, lambda model: list(model.blocks),
                    {"kind": "GPT (zerograph.models.gpt), random tokens", "size": size,
                     **dataclasses.asdict(cfg), "global_batch": batch_size})


def _factory_workload(spec: str) -> Workload:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {spec}: cannot load {attr!r} from {module_name!r}: {exc}") from exc
    batch_fns: list[Callable] = []

    def build() -> nn.Module:
        model, batch_fn = factory()
        if not batch_fns:  # every call returns the same data; keep the first batch_fn
            batch_fns.append(batch_fn)
        return model

    def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
        if not batch_fns:
            build()
        return tuple(batch_fns[0](step, rank, world_size))

    def blocks(model: nn.Module) -> list[nn.Module]:
        from .sharding import find_units

        return [module for _, module in find_units(model, None)]

    return Workload(spec, build, batch, blocks, {"kind": "user factory", "factory": spec})


def unique_params(model: nn.Module) -> int:
    """Ψ: elements of the model's parameters, each tied parameter counted once."""
    return sum(p.numel() for p in model.parameters())


def padded_params(model: nn.Module, world_size: int) -> int:
    """Ψ with every parameter padded to ``world_size`` equal row chunks (``Shard(0)``'s layout):
    the most a sharded collective can move per Ψ."""
    total = 0
    for p in model.parameters():
        if p.dim() == 0:
            total += 1
            continue
        rows = p.shape[0]
        total += -(-rows // world_size) * world_size * (p.numel() // rows)
    return total


# ---------------------------------------------------------------------------------------------
# one rank


def rank_main(options: dict) -> dict | None:
    """Body of every rank: join the group, measure every system; rank 0 returns the result."""
    args = argparse.Namespace(**options)
    device = _init_distributed(args.backend)
    try:
        return measure_all(args, device)
    finally:
        dist.barrier()  # no rank tears the group down while a peer still talks to it
        dist.destroy_process_group()


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
    workload = load_workload(args.model, args.batch_size, args.seq_len, args.seed)
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    clusters = _clusters_for(args, device) if args.simulate else []  # this machine first
    reference = _shapes_only(workload)
    model_info = {"name": workload.name, "psi": unique_params(reference),
                  "psi_padded": padded_params(reference, world_size), **workload.description,
                  "tokens_per_step": _tokens_per_step(workload, world_size)}
    del reference
    _prime_compiler()
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
        "command": "zerograph bench " + " ".join(_argv_of(args)),
        "machine": machine_description(device, world_size, load_start),
        "model": model_info,
        "settings": {k: getattr(args, k) for k in ("steps", "warmup", "profile_steps", "batch_size", "seq_len",
                                                   "lr", "seed", "prefetch_depth", "bucket_bytes")},
        "definitions": DEFINITIONS,
        "systems": systems,
        "loss_check": loss_check(systems),
        "simulate": _simulation_summary(systems, clusters, args),
    }


def _shapes_only(workload: Workload) -> nn.Module:
    """The workload's model on the meta device (shapes, no memory), or on the CPU when its
    factory cannot build there."""
    try:
        with torch.device("meta"):
            return workload.build()
    except Exception:  # a user factory that materialises values (e.g. loads weights)
        return workload.build()


def _prime_compiler() -> None:
    """Compile and run a tiny function with a backward once, so that the first measured system
    does not pay alone for loading ``torch.compile``'s machinery (its modules and caches stay in
    the RSS and would count as that system's memory)."""
    double_sum = torch.compile(lambda x: (x * 2).sum(), backend="aot_eager")
    x = torch.ones(4, requires_grad=True)
    double_sum(x).backward()


def _tokens_per_step(workload: Workload, world_size: int) -> int:
    return sum(workload.batch(0, r, world_size)[0].numel() for r in range(world_size))


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The flags that differ from their defaults: the command that reproduces this run."""
    out = []
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        if action.option_strings and action.dest != "help" and value is not None and value != action.default:
            out += [action.option_strings[0], str(value)]
    return out


# ---------------------------------------------------------------------------------------------
# one system on one rank


def build_system(spec: SystemSpec, workload: Workload, device: torch.device, lr: float
                 ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model wrapped by ``spec``'s system, and AdamW over its parameters."""
    import zerograph

    model = workload.build().to(device)
    if spec.kind == "zerograph":
        model = zerograph.compile(model, spec.stage, config=spec.zerograph_config())
    elif spec.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in workload.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if spec.compiled:
            model = torch.compile(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """One training step; returns this rank's loss (detached scalar)."""
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_system(spec: SystemSpec, workload: Workload, args: argparse.Namespace, device: torch.device,
               model_info: dict, clusters: list["Cluster"], progress: Any) -> dict:
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
            seconds, loss = _timed_step(model, optimizer, batch_of(next(steps)), device)
            times[phase].append(seconds)
            losses.append(loss)
            progress.update()
    peak = memory.result()

    events, windows = profile_steps(lambda: train_step(model, optimizer, batch_of(next(steps))),
                                    args.profile_steps, device)
    progress.update(args.profile_steps)
    breakdowns = [comm_breakdown(events, w, device) for w in windows]
    # separate steps: recording every allocation slows the step, so the timed profile runs without it
    held = held_bytes(model, optimizer)
    peaks, at_peak = profile_allocations(lambda: train_step(model, optimizer, batch_of(next(steps))),
                                         args.profile_steps, device)
    progress.update(args.profile_steps)
    mine = {**times, "memory": peak, "profile": breakdowns,
            "allocations": {"state_bytes_by_kind": held, "step_peak_bytes": peaks, "at_peak": at_peak}}
    if spec.kind == "zerograph":
        mine["comm_elements"] = _zerograph_volume(model)
        mine["waits"] = _zerograph_wait_breakdown(events, windows)
        if clusters and rank == 0 and windows:
            mine["simulate"] = simulate_system(spec, model, events, _median_window(windows), clusters,
                                               workload, world_size)
    else:
        mine["comm_elements"] = count_collectives(lambda: train_step(model, optimizer, batch_of(next(steps))))
    progress.update()
    mine["losses"] = _global_losses(losses, world_size)
    ranks: list[Any] = [None] * world_size
    dist.all_gather_object(ranks, mine)
    del model, optimizer, events
    return merge_ranks(spec, ranks, model_info)


def _timed_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, device: torch.device
                ) -> tuple[float, torch.Tensor]:
    _sync(device)
    dist.barrier()  # every rank starts together: a step's time is not a peer's lateness
    start = time.perf_counter()
    loss = train_step(model, optimizer, batch)
    _sync(device)
    return time.perf_counter() - start, loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _global_losses(losses: list[torch.Tensor], world_size: int) -> list[float]:
    """Mean over ranks of each step's loss: the loss of the global batch (equal rank batches)."""
    stacked = torch.stack(losses).double()
    dist.all_reduce(stacked)
    return (stacked / world_size).tolist()


def _zerograph_volume(model: nn.Module) -> dict[str, int]:
    import zerograph

    return {k: int(v) for k, v in zerograph.stats(model).comm_elements.items()}


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
        "kind": spec.kind, "spec": dataclasses.asdict(spec),
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
        **_allocation_summary([r["allocations"] for r in ranks]),
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


# ---------------------------------------------------------------------------------------------
# memory


class MemoryProbe:
    """Peak memory of one system on this rank (see ``DEFINITIONS["peak_memory"]``).

    CPU: RSS from ``/proc/self/status`` (``VmRSS``, ``VmHWM``); the high-water mark is reset by
    writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). Where that is refused, falls back
    to ``resource.getrusage``'s lifetime peak, which misses a peak lower than an earlier
    system's (``method`` says which). GPU: ``torch.cuda`` allocator statistics. Bytes throughout.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = self._current()
        self.method = "cuda_max_memory_allocated" if device.type == "cuda" else "VmHWM"

    def start_peak(self) -> None:
        """Start the peak window now (after the warm-up steps, which compile)."""
        self.steady = self._current()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "ru_maxrss (lifetime peak: may miss this system's peak)"

    def result(self) -> dict:
        peak = self._peak()
        return {"method": self.method, "baseline_bytes": self.baseline, "after_warmup_bytes": self.steady,
                "peak_bytes": peak, "peak_over_baseline_bytes": max(0, peak - self.baseline)}

    def _current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_bytes("VmRSS")

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.method == "VmHWM":
            return _proc_status_bytes("VmHWM")
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the training state this rank holds between steps, by kind, each storage counted
    once (``DEFINITIONS["allocated"]``): parameters (a ``DTensor``'s local shard, with the
    padding of its storage), ``.grad``, the optimizer's state tensors, the module buffers, and
    the communication buffers a system keeps across steps (zerograph's pool, DDP's buckets)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def nbytes(tensors: Any) -> int:
        total = 0
        for t in tensors:
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:  # a freed FSDP2 unsharded param has 0
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_states": nbytes(v for state in optimizer.state.values() for v in state.values()
                                       if isinstance(v, torch.Tensor)),
            "buffers": nbytes(model.buffers()), "comm_buffers": nbytes(_comm_buffers(model))}


def _comm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Buffers a system keeps from step to step outside parameters and optimizer: zerograph's
    ``BufferPool`` slots; DDP's gradient buckets (as same-sized copies: the reducer exposes no
    other handle on them)."""
    if is_compiled(model):
        return list(runtime_of_model(model).buffer_pool.buffers.values())
    reducer = getattr(model, "reducer", None)
    if not isinstance(reducer, dist.Reducer):
        return []
    return [bucket.buffer() for bucket in reducer._get_zeros_like_grad_buckets()]


def profile_allocations(step: Callable[[], Any], n: int, device: torch.device) -> tuple[list[int], list[dict]]:
    """Run ``step()`` ``n`` times as ``profile_steps`` does, with ``profile_memory``. Returns per
    step the peak of the running sum of the device allocator's allocations (+) and frees (-)
    inside its ``STEP_LABEL`` window (the most bytes the step allocated above what was held at its
    start), and ``peak_allocations`` of the profile (what made the highest point)."""
    if n == 0:
        return [], []
    prof = _profile(step, n, device, profile_memory=True)
    kineto = prof.profiler.kineto_results
    origin = kineto.trace_start_ns()  # FunctionEvent times are microseconds after it
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    changes = sorted(((e.start_ns() - origin, e.nbytes()) for e in kineto.events()
                      if e.name() == "[memory]" and e.device_type() == kind), key=lambda c: c[0])
    peaks = []
    for window in _step_windows(prof.events()):
        start_ns, end_ns = window.time_range.start * 1e3, window.time_range.end * 1e3
        running = peak = 0
        for t, nbytes in changes:
            if start_ns <= t <= end_ns:
                running += nbytes
                peak = max(peak, running)
        peaks.append(peak)
    return peaks, peak_allocations(kineto.experimental_event_tree(), device)


def peak_allocations(roots: Sequence[Any], device: torch.device, top: int = 6) -> list[dict]:
    """The blocks alive at the highest point of the allocations a profile recorded on ``device``,
    summed by the ops that allocated them: ``[{"ops": "aten::empty < zerograph::unpack_gathered <
    CompiledFunction", "bytes": ...}]`` (innermost op first, three levels), largest first, at most
    ``top``. Blocks allocated before the profile started are not seen. ``roots``: the profiler's
    event tree (``kineto_results.experimental_event_tree()``), whose allocation events carry the
    address, size (negative: a free) and device, as ``torch.profiler._memory_profiler`` reads them."""
    allocations = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.typed[1]
        if type(fields).__name__.endswith("Allocation") and fields.device.type == device.type:
            ops, parent = [], event.parent
            while parent is not None and len(ops) < 3:
                ops.append(parent.name)
                parent = parent.parent
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size, " < ".join(ops) or "(no op)"))
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    snapshot: dict[int, tuple[int, str]] = {}
    for _, ptr, size, ops in sorted(allocations, key=lambda a: a[0]):
        if size > 0:
            live[ptr] = (size, ops)
            total += size
        elif ptr in live:
            total -= live.pop(ptr)[0]
        if total > best:
            best, snapshot = total, dict(live)
    by_ops: dict[str, int] = {}
    for size, ops in snapshot.values():
        by_ops[ops] = by_ops.get(ops, 0) + size
    ranked = sorted(by_ops.items(), key=lambda kv: -kv[1])[:top]
    return [{"ops": ops, "bytes": nbytes} for ops, nbytes in ranked]


def _allocation_summary(ranks: Sequence[dict]) -> dict:
    """Max over ranks of the state held at a step's start, of the median in-step allocation peak
    and of their sum (``None`` without profiled steps)."""
    state = [sum(r["state_bytes_by_kind"].values()) for r in ranks]
    peak = [statistics.median(r["step_peak_bytes"]) if r["step_peak_bytes"] else None for r in ranks]
    if None in peak:
        return {"state_bytes": max(state), "step_peak_alloc_bytes": None, "state_plus_peak_bytes": None}
    return {"state_bytes": max(state), "step_peak_alloc_bytes": max(peak),
            "state_plus_peak_bytes": max(s + p for s, p in zip(state, peak))}


# ---------------------------------------------------------------------------------------------
# communication volume of the baselines


def _numel(tensors: Any) -> int:
    """Elements of a tensor or of a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


# full elements moved by each collective op the dispatcher sees, from its arguments
_COLLECTIVE_SIZES: dict[str, tuple[str, Callable[[tuple], int]]] = {
    "c10d::allreduce_": ("all_reduce", lambda a: _numel(a[0])),
    "c10d::allreduce_coalesced_": ("all_reduce", lambda a: _numel(a[0])),
    "c10d::_allgather_base_": ("all_gather", lambda a: _numel(a[0])),
    "c10d::allgather_": ("all_gather", lambda a: _numel(a[0])),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", lambda a: _numel(a[0])),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", lambda a: _numel(a[1])),
    "c10d::reduce_scatter_": ("reduce_scatter", lambda a: _numel(a[1])),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _numel(a[1])),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", lambda a: _numel(a[0]) * a[1]),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", lambda a: _numel(a[0]) * a[1]),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", lambda a: _numel(a[0])),
    "_c10d_functional::all_reduce": ("all_reduce", lambda a: _numel(a[0])),
}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active, as ``zerograph.stats`` counts its own:
    ``elements[kind]`` = elements of the full tensors, an all-reduce twice (ZeRO paper section 7).
    ``other`` counts calls of other ``c10d`` ops (broadcasts, barriers), which move no model state.

    Eager collectives only: a compiled graph's collectives do not reach a dispatch mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.elements = dict.fromkeys(KINDS, 0)
        self.other: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name
        if name in _COLLECTIVE_SIZES:
            kind, size = _COLLECTIVE_SIZES[name]
            self.elements[kind] += size(args) * (2 if kind == "all_reduce" else 1)
        elif "c10d" in name:
            self.other[name] = self.other.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_collectives(step: Callable[[], Any]) -> dict[str, int]:
    """Run ``step()`` under ``CollectiveCounter``; ``{kind: elements}``."""
    counter = CollectiveCounter()
    with counter:
        step()
    if counter.other:
        log.info("uncounted c10d ops in the counted step: %s", counter.other)
    return counter.elements


# ---------------------------------------------------------------------------------------------
# profile: exposed communication


def profile_steps(step: Callable[[], Any], n: int, device: torch.device) -> tuple[list[Any], list[Any]]:
    """Run ``step()`` ``n`` times under ``torch.profiler`` (each after a barrier, inside a
    ``STEP_LABEL`` record_function); returns ``(events, step windows)`` in time order."""
    if n == 0:
        return [], []
    events = list(_profile(step, n, device).events())
    return events, _step_windows(events)


def _profile(step: Callable[[], Any], n: int, device: torch.device, profile_memory: bool = False) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=profile_memory) as prof:
        for _ in range(n):
            _sync(device)
            dist.barrier()
            with torch.profiler.record_function(STEP_LABEL):
                step()
                _sync(device)
    return prof


def _step_windows(events: Sequence[Any]) -> list[Any]:
    return sorted((e for e in events if e.name == STEP_LABEL), key=lambda e: e.time_range.start)


_COMM_OP_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_COMM_THREAD_PREFIXES = ("gloo:", "nccl:")


def _clipped(event: Any, window: Any, track: str) -> Any | None:
    """``timeline.Event`` of ``event`` cut to ``window`` (seconds from its start), or ``None``."""
    from .timeline import Event

    start = max(event.time_range.start, window.time_range.start)
    end = min(event.time_range.end, window.time_range.end)
    if end <= start:
        return None
    return Event(event.name, track, (start - window.time_range.start) / 1e6, (end - start) / 1e6, kind=event.name)


def comm_breakdown(events: Sequence[Any], window: Any, device: torch.device) -> dict[str, float]:
    """``step_s``, ``compute_s``, ``comm_s`` (collectives in flight) and ``exposed_comm_s`` of one
    profiled step, in seconds, by the definition in the module docstring."""
    from .timeline import schedule_from_events

    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = [_clipped(e, window, "comm") for e in kernels if "nccl" in e.name.lower()]
        compute = [_clipped(e, window, "compute") for e in kernels if "nccl" not in e.name.lower()]
    else:
        comm_threads = {e.thread for e in events if e.name.startswith(_COMM_THREAD_PREFIXES)}
        comm = [_clipped(e, window, "comm") for e in events
                if e.thread in comm_threads and e.name.startswith(_COMM_THREAD_PREFIXES)]
        compute = [_clipped(e, window, "compute") for e in events
                   if e.thread not in comm_threads and not e.name.startswith(_COMM_OP_PREFIXES)
                   and is_top_level_op(e)]
    schedule = schedule_from_events([e for e in comm + compute if e is not None])
    return {"step_s": (window.time_range.end - window.time_range.start) / 1e6,
            "compute_s": schedule.compute_s, "comm_s": schedule.comm_s,
            "exposed_comm_s": schedule.comm_s - schedule.overlap_s()}


def _zerograph_wait_breakdown(events: Sequence[Any], windows: Sequence[Any]) -> list[float]:
    """Per profiled step, seconds the training thread sat in ``wait_tensor``: the exposed
    communication as ``zerograph.timeline.measure`` defines it (comparable with ``predict``)."""
    from .timeline import schedule_from_profile

    out = []
    for w in windows:
        inside = [e for e in events if w.time_range.start <= e.time_range.start and e.time_range.end <= w.time_range.end]
        out.append(schedule_from_profile(inside).exposed_comm_s)
    return out


def _median_window(windows: Sequence[Any]) -> Any:
    ordered = sorted(windows, key=lambda w: w.time_range.end - w.time_range.start)
    return ordered[len(ordered) // 2]


# ---------------------------------------------------------------------------------------------
# simulation: this machine's profile projected onto a cluster


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster to project onto: one data-parallel rank per device (see ``clusters.json``).

    ``scale``: factor applied to this machine's measured op times (this machine's calibrated
    FLOP/s over the cluster's); ``cost``: the cluster's ``CostModel`` (its collectives are used).
    """

    name: str
    description: str
    world_size: int
    scale: float
    cost: CostModel
    assumptions: tuple[str, ...]


def load_cluster_table(path: str | os.PathLike) -> dict[str, dict]:
    """The clusters of a JSON table (keys starting with ``_`` are comments). Raises ``ConfigError``."""
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the cluster table {path}: {exc}") from exc
    return {name: entry for name, entry in table.items() if not name.startswith("_")}


def cluster_cost_model(entry: Mapping[str, Any]) -> CostModel:
    """``CostModel`` of a cluster entry: alpha = ``latency_s``, beta from the bus bandwidth with
    nccl-tests' factors ((N-1)/N for all-gather and reduce-scatter, 2(N-1)/N for all-reduce)."""
    try:
        n = int(entry["nodes"]) * int(entry["devices_per_node"])
        busbw, latency = float(entry["bus_bandwidth_bytes_per_s"]), float(entry["latency_s"])
        ring = (n - 1) / n
        return CostModel(world_size=n, flops_per_s=float(entry["flops_per_s"]),
                         bytes_per_s=float(entry["memory_bytes_per_s"]), op_overhead_s=float(entry["op_overhead_s"]),
                         collectives={"all_gather": (latency, ring / busbw), "reduce_scatter": (latency, ring / busbw),
                                      "all_reduce": (latency, 2 * ring / busbw)})
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"cluster entry {dict(entry)} is incomplete or invalid: {exc!r}") from exc


def _clusters_for(args: argparse.Namespace, device: torch.device) -> list[Cluster]:
    """Calibrate this machine (every rank takes part), then describe each requested cluster.
    The first entry is always this machine (``LOCAL_CLUSTER``); it is reported only when asked."""
    from .costmodel import calibrate

    local = calibrate(dist.group.WORLD)
    table = load_cluster_table(args.clusters)
    clusters = [Cluster(LOCAL_CLUSTER, f"this machine, as calibrated by costmodel.calibrate ({device.type})",
                        local.world_size, 1.0, local,
                        ("op times as measured (scale 1)",
                         "collectives: alpha-beta fitted by costmodel.calibrate on this machine's process group"))]
    for name in args.simulate.split(","):
        if name == LOCAL_CLUSTER:
            continue
        entry = table[name]
        cost = cluster_cost_model(entry)
        scale = local.flops_per_s / cost.flops_per_s
        clusters.append(Cluster(name, entry.get("description", name), cost.world_size, scale, cost, (
            f"op times: this machine's measured times x {scale:.3g} (its calibrated matmul rate "
            f"{local.flops_per_s / 1e9:.3g} GFLOP/s over the cluster's {cost.flops_per_s / 1e9:.3g} GFLOP/s), "
            f"floored at the cluster's op overhead {cost.op_overhead_s * 1e6:.3g} us; time outside the graphs "
            "(optimizer step, framework) scaled the same way",
            f"collectives: latency {float(entry['latency_s']) * 1e6:.3g} us + bytes / bus bandwidth "
            f"{float(entry['bus_bandwidth_bytes_per_s']) / 1e9:.3g} GB/s with nccl-tests' factors, at world size "
            f"{cost.world_size}, one at a time on one stream beside compute",
            "per-rank batch and graphs as measured here (weak scaling: the global batch grows with the "
            "world size); collectives move full buffers, so their sizes do not depend on the world size")))
    return clusters


@dataclasses.dataclass(frozen=True)
class ProfiledCost(CostModel):
    """A ``CostModel`` whose compute time per node comes from a measured profile.

    ``node_seconds``: FX node -> seconds on the compute stream (nodes absent cost 0, ``wait_tensor``
    always 0: ``timeline.predict`` decides how long a wait blocks). Collectives keep the base
    model's ``collective_time``.
    """

    node_seconds: Mapping[fx.Node, float] = dataclasses.field(default_factory=dict, compare=False)

    def node_time(self, node: fx.Node) -> float:
        if node.op != "call_function" or node.target is WAIT:
            return 0.0
        return self.node_seconds.get(node, 0.0)


_REGION_NAMES = {"CompiledFunction": "forward", "CompiledFunctionBackward": "backward"}
_LOOKAHEAD = 8  # profile events skipped at most when matching one graph node to its event
_MIN_MATCHED = 0.9  # below this fraction of nodes matched, a graph's time is spread by roofline


def _graph_regions(events: Sequence[Any], window: Any) -> list[Any]:
    """The compiled graphs' executions inside ``window``: AOTAutograd's annotation events."""
    return sorted((e for e in events if e.name in _REGION_NAMES and e.thread == window.thread
                   and window.time_range.start <= e.time_range.start <= window.time_range.end),
                  key=lambda e: e.time_range.start)


def _region_ops(events: Sequence[Any], region: Any) -> list[Any]:
    return sorted((e for e in events if e.thread == region.thread and is_top_level_op(e)
                   and region.time_range.start <= e.time_range.start < region.time_range.end),
                  key=lambda e: e.time_range.start)


def match_nodes(graph: fx.Graph, ops: Sequence[Any]) -> list[tuple[Any, fx.Node]]:
    """Pair the graph's operator nodes with the profile's op events, in order, by op name
    (``aten::mm`` ...); an event no node claims within ``_LOOKAHEAD`` is skipped (e.g. the
    runtime's schedule check). Returns ``(event, node)`` pairs in execution order."""
    pairs, j = [], 0
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name
        for k in range(j, min(j + _LOOKAHEAD, len(ops))):
            if ops[k].name == name:
                pairs.append((ops[k], node))
                j = k + 1
                break
    return pairs


def attribute_seconds(region: Any, pairs: Sequence[tuple[Any, fx.Node]]) -> dict[fx.Node, float]:
    """Seconds of ``region`` charged to each matched node: its own event plus the gap to the next
    event (Python between ops, unmatched events). A ``wait_tensor``'s blocked time is left out,
    since the simulation recomputes it, and the gap after a wait goes to the node after it (that
    time cannot hide the awaited collective)."""
    seconds: dict[fx.Node, float] = {}
    previous, pending = None, 0.0
    cursor = region.time_range.start
    for event, node in pairs:
        gap = max(0.0, event.time_range.start - cursor) / 1e6
        if previous is None:
            pending += gap
        else:
            seconds[previous] += gap
        cursor = max(cursor, event.time_range.end)
        if node.target is WAIT:
            previous = None
            continue
        seconds[node] = seconds.get(node, 0.0) + pending + (event.time_range.end - event.time_range.start) / 1e6
        previous, pending = node, 0.0
    tail = max(0.0, region.time_range.end - cursor) / 1e6
    if previous is not None:
        seconds[previous] += tail
    elif seconds:  # the region ended on a wait: the tail follows the last node
        seconds[next(reversed(seconds))] += pending + tail
    return seconds


def roofline_seconds(region: Any, ops: Sequence[Any], graph: fx.Graph, cost: CostModel) -> dict[fx.Node, float]:
    """The region's measured time less its waits, shared among the graph's nodes in proportion
    to ``cost.node_time`` (roofline): for lowered code whose ops are not the graph's nodes."""
    waited = sum(e.time_range.end - e.time_range.start for e in ops if e.name == WAIT._schema.name) / 1e6
    budget = max(0.0, (region.time_range.end - region.time_range.start) / 1e6 - waited)
    estimates = {n: cost.node_time(n) for n in graph.nodes if n.op == "call_function" and n.target is not WAIT}
    total = sum(estimates.values())
    return {n: t * budget / total for n, t in estimates.items() if t > 0} if total > 0 else {}


def measured_graph_profile(model: nn.Module, events: Sequence[Any], window: Any, local_cost: CostModel
                           ) -> tuple[list[fx.GraphModule], dict[fx.Node, float], float, float]:
    """This rank's graphs in execution order, measured seconds per node, seconds of the step
    outside the graphs, and the fraction of operator nodes matched to a profile event. A graph
    with fewer than ``_MIN_MATCHED`` of its operator nodes matched (Inductor's fused kernels) has
    its measured time spread by ``roofline_seconds`` with ``local_cost``.

    Raises ``ConfigError`` when the profiled step ran a different number of graphs than captured.
    """
    captured = graphs_of(model)
    forwards = [g["forward"] for g in captured if "forward" in g]
    backwards = [g["backward"] for g in reversed(captured) if "backward" in g]
    regions = _graph_regions(events, window)
    kinds = [_REGION_NAMES[r.name] for r in regions]
    if kinds != ["forward"] * len(forwards) + ["backward"] * len(backwards):
        raise ConfigError(f"profiled step ran graphs {kinds}, captured {len(forwards)} forward and "
                          f"{len(backwards)} backward")
    graphs = forwards + backwards
    seconds: dict[fx.Node, float] = {}
    matched = total = 0
    for region, gm in zip(regions, graphs):
        ops = _region_ops(events, region)
        pairs = match_nodes(gm.graph, ops)
        operators = sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        if len(pairs) >= _MIN_MATCHED * operators:
            seconds.update(attribute_seconds(region, pairs))
        else:  # fused kernels (Inductor): spread the measured time over the nodes by their roofline
            seconds.update(roofline_seconds(region, ops, gm.graph, local_cost))
        matched += len(pairs)
        total += operators
    inside = sum(r.time_range.end - r.time_range.start for r in regions) / 1e6
    outside = (window.time_range.end - window.time_range.start) / 1e6 - inside
    return graphs, seconds, outside, matched / max(total, 1)


def simulate_system(spec: SystemSpec, model: nn.Module, events: Sequence[Any], window: Any,
                    clusters: Sequence[Cluster], workload: Workload, world_size: int) -> dict:
    """Project one zerograph system's profiled step onto each cluster with ``timeline.predict``.

    Per cluster: predicted ``step_s`` (graphs on two streams plus the time outside them),
    ``compute_s``, ``comm_s``, ``exposed_comm_s`` (seconds) and model-state bytes per rank from
    ``zerograph.plan`` at the cluster's world size (fp32 parameters and gradients, AdamW fp32
    states; activations not included).
    """
    from .timeline import predict

    local = next(c for c in clusters if c.name == LOCAL_CLUSTER)
    try:
        graphs, seconds, outside_s, matched = measured_graph_profile(model, events, window, local.cost)
    except ConfigError as exc:
        return {"error": str(exc)}
    out: dict[str, Any] = {"matched_node_fraction": matched, "outside_graphs_s": outside_s,
                           "profiled_step_s": (window.time_range.end - window.time_range.start) / 1e6}
    for cluster in clusters:
        scaled = {node: max(s * cluster.scale, cluster.cost.op_overhead_s) for node, s in seconds.items()}
        cost = ProfiledCost(**{f.name: getattr(cluster.cost, f.name) for f in dataclasses.fields(CostModel)},
                            node_seconds=scaled)
        schedule = predict(graphs, cost)
        out[cluster.name] = {
            "world_size": cluster.world_size,
            "step_s": schedule.step_s + outside_s * cluster.scale,
            "graphs_step_s": schedule.step_s, "compute_s": schedule.compute_s + outside_s * cluster.scale,
            "comm_s": schedule.comm_s, "exposed_comm_s": schedule.exposed_comm_s,
            "model_state_bytes_per_rank": _planned_bytes(spec, workload, cluster.world_size),
        }
    return out


def _planned_bytes(spec: SystemSpec, workload: Workload, world_size: int) -> dict[str, int] | None:
    """``zerograph.plan``'s per-rank model-state bytes (formula and with overheads), or ``None``
    when the plan fails for this model."""
    import zerograph

    try:
        plan = zerograph.plan(_shapes_only(workload), spec.stage, world_size, param_dtype=torch.float32,
                              master_dtype=torch.float32, prefetch_depth=spec.prefetch_depth)
    except Exception as exc:  # a user model zerograph.plan cannot read: report without memory
        log.warning("no memory plan for %s: %s", workload.name, exc)
        return None
    return {"formula": int(plan.bytes_per_rank["total"]), "with_overheads": int(plan.total_with_overheads)}


def _simulation_summary(systems: Mapping[str, dict], clusters: Sequence[Cluster], args: argparse.Namespace) -> dict | None:
    if not clusters:
        return None
    requested = args.simulate.split(",")
    summary: dict[str, Any] = {"clusters": {c.name: {"description": c.description, "world_size": c.world_size,
                                                     "scale": c.scale, "cost_model": c.cost.to_dict(),
                                                     "assumptions": list(c.assumptions)}
                                            for c in clusters if c.name in requested}}
    if LOCAL_CLUSTER in requested:
        summary["self_check"] = {name: _self_check(s) for name, s in systems.items()
                                 if LOCAL_CLUSTER in s.get("simulate", {})}
    return summary


def _self_check(system: dict) -> dict:
    """Simulated 'local' step against the profiled step it was built from (which differs from it
    only in how communication and waits are modelled) and against the timed median (which adds
    step-to-step variation of the machine)."""
    sim = system["simulate"]
    predicted = sim[LOCAL_CLUSTER]["step_s"]
    return {"predicted_s": predicted, "measured_profiled_step_s": sim["profiled_step_s"],
            "relative_error": predicted / sim["profiled_step_s"] - 1,
            "measured_median_s": system["median_s"], "relative_error_vs_median": predicted / system["median_s"] - 1}


# ---------------------------------------------------------------------------------------------
# report


DEFINITIONS = {
    "step_time": "wall time of one step (forward, backward, AdamW step, zero_grad) from a barrier to its end "
                 "(after cuda synchronize on GPU); each step counts as its slowest rank",
    "exposed_comm": "torch.profiler over the profiled steps: time some collective is in flight (gloo's worker-"
                    "thread event on CPU, NCCL kernels on GPU) while the training thread runs no compute op "
                    "(outermost operator events other than c10d/_c10d_functional launches and waits); median "
                    "over profiled steps, mean over ranks",
    "peak_memory": "CPU: peak RSS (VmHWM reset after warm-up) over the timed steps minus RSS before the system "
                   "was built; GPU: max_memory_allocated over the timed steps minus the allocation before the "
                   "build; max over ranks",
    "allocated": "torch.profiler(profile_memory=True) over separate profiled steps: peak of the running sum of "
                 "the device allocator's allocations minus frees within each step (bytes above the step's start; "
                 "median over steps); state: bytes held at the step's start counted from tensors, each storage "
                 "once: local parameter shards (DTensor to_local, padded storage), .grad, optimizer state tensors, "
                 "module buffers, comm buffers kept across steps (zerograph's buffer pool, DDP's gradient buckets); "
                 "state + peak = the step's peak allocated bytes; max over ranks",
    "comm_volume": "elements of the full tensors moved per step, all-reduce counted twice (ZeRO paper section 7); "
                   "zerograph from zerograph.stats, baselines counted by a dispatch mode over one step; divided "
                   "by psi (unique parameters)",
}


def machine_description(device: torch.device, world_size: int, load_start: tuple | None) -> dict:
    """Platform, software and device of this run (``load_average`` shows a shared machine)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpu_count": os.cpu_count(), "device": device.type, "device_name": name,
            "world_size": world_size, "backend": dist.get_backend(), "threads_per_rank": torch.get_num_threads(),
            "load_average_start": list(load_start) if load_start else None,
            "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(result: dict, args: argparse.Namespace) -> None:
    """Print the tables; write the JSON and the PNG when asked."""
    print(format_report(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json_path}")
    if args.png_path:
        plot(result, args.png_path)
        print(f"wrote {args.png_path}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned to their widest cell (the first left-aligned)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.1f}"


def format_report(result: dict) -> str:
    m, model = result["machine"], result["model"]
    memory_label = "max alloc +MiB" if m["device"] == "cuda" else "peak RSS +MiB"
    headers = ["system", "median ms", "min ms", "max ms", "tokens/s", "exposed comm ms", "comm in flight ms",
               memory_label, "peak alloc +MiB", "state + peak MiB", "comm/Ψ (paper)", "loss step 1"]
    rows = [[name, _ms(s["median_s"]), _ms(s["min_s"]), _ms(s["max_s"]), f"{s['tokens_per_s']:.0f}",
             _ms(s["exposed_comm_s"]), _ms(s["comm_in_flight_s"]), _mib(s["peak_memory_bytes"]),
             _mib(s.get("step_peak_alloc_bytes")), _mib(s.get("state_plus_peak_bytes")),
             f"{s['comm_ratio']:.3f} ({s['paper_ratio']})", f"{s['losses'][0]:.6f}"]
            for name, s in result["systems"].items()]
    check = result["loss_check"]
    load = m.get("load_average_start")
    lines = [
        f"{model['name']}: Ψ = {model['psi']:,} parameters, {model['tokens_per_step']:,} tokens per step; "
        f"world size {m['world_size']} ({m['backend']}, {m['device_name']}, {m['threads_per_rank']} thread(s) per rank); "
        f"torch {m['torch']}" + (f"; load average {load[0]:.1f} at start" if load else ""),
        f"{result['settings']['steps']} timed steps after {result['settings']['warmup']} warm-up; "
        f"exposed comm from {result['settings']['profile_steps']} profiled steps, peak alloc from as many more "
        f"(profile_memory); peak RSS over the timed steps",
        "",
        format_table(headers, rows),
        "",
        f"losses: step 1 differs by at most {check['step1_max_abs_diff']:.2e} across systems; "
        f"step {check['last_step']} by {check['last_max_abs_diff']:.2e}",
    ]
    at_peak = {name: s["allocations_per_rank"][0].get("at_peak") for name, s in result["systems"].items()}
    if any(at_peak.values()):
        lines += ["", "at the highest allocation point of the profiled steps (rank 0), allocated by:"]
        for name, entries in at_peak.items():
            lines.append(f"  {name}: " + "; ".join(f"{e['ops']} {_mib(e['bytes'])} MiB" for e in entries[:4]))
    if result.get("simulate"):
        lines += ["", format_simulation(result)]
    return "\n".join(lines)


def format_simulation(result: dict) -> str:
    sim = result["simulate"]
    lines = []
    for name, cluster in sim["clusters"].items():
        rows = []
        for system, s in result["systems"].items():
            p = s.get("simulate", {}).get(name)
            if p is None:
                continue
            mem = p["model_state_bytes_per_rank"]
            rows.append([system, _ms(p["step_s"]), _ms(p["compute_s"]), _ms(p["comm_s"]), _ms(p["exposed_comm_s"]),
                         "-" if mem is None else f"{mem['with_overheads'] / MIB:.2f} ({mem['formula'] / MIB:.2f})"])
        lines += [f"simulated on {name}: {cluster['description']}, world size {cluster['world_size']}",
                  format_table(["system", "step ms", "compute ms", "comm ms", "exposed comm ms",
                                "model states MiB/rank (formula)"], rows)]
        lines += [f"  assumption: {a}" for a in cluster["assumptions"]]
        lines += ["  memory: zerograph.plan at this world size, fp32 parameters and gradients, AdamW fp32 states, "
                  "with padding, in-flight gathers and the gradient bucket; activations not included", ""]
    for system, check in (sim.get("self_check") or {}).items():
        lines.append(f"self-check {system}: simulated '{LOCAL_CLUSTER}' {check['predicted_s'] * 1e3:.1f} ms vs the profiled "
                     f"step it was built from {check['measured_profiled_step_s'] * 1e3:.1f} ms "
                     f"({check['relative_error'] * 100:+.1f}%); vs the timed median {check['measured_median_s'] * 1e3:.1f} ms "
                     f"({check['relative_error_vs_median'] * 100:+.1f}%)")
    if sim.get("self_check"):
        lines.append("  (op times come from the profiled step; what is modelled is communication: alpha-beta "
                     "collectives on one stream and the waits they cause)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bar chart: per system, median step time split into exposed communication and the rest,
    with min / max step time as error bars (matplotlib, no display needed)."""
    from matplotlib.figure import Figure

    names = list(result["systems"])
    systems = [result["systems"][n] for n in names]
    median = [s["median_s"] * 1e3 for s in systems]
    exposed = [min(s["exposed_comm_s"] or 0.0, s["median_s"]) * 1e3 for s in systems]
    rest = [m - e for m, e in zip(median, exposed)]
    low = [m - s["min_s"] * 1e3 for m, s in zip(median, systems)]
    high = [s["max_s"] * 1e3 - m for m, s in zip(median, systems)]
    fig = Figure(figsize=(max(6.0, 1.2 * len(names)), 4.5))
    ax = fig.add_subplot()
    x = range(len(names))
    ax.bar(x, rest, color="#4c72b0", label="compute and other (median − exposed)")
    ax.bar(x, exposed, bottom=rest, color="#dd8452", label="exposed communication")
    ax.errorbar(x, median, yerr=[low, high], fmt="none", ecolor="black", capsize=4, label="min / max step")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("step time (ms)")
    m = result["machine"]
    load = m.get("load_average_start")
    title = f"{result['model']['name']}, world size {m['world_size']} ({m['backend']}, {m['device_name']})"
    if load:  # a shared machine's numbers vary; say how busy it was
        title += f", load average {load[0]:.1f} on {m['cpu_count']} CPUs"
    ax.set_title(title, fontsize=9, pad=28)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
