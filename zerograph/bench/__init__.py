"""``zerograph bench``: zerograph's stages and schedules beside DDP and FSDP2, in one run.

    python -m zerograph.bench --model small --nproc 2 --steps 10 \\
        --systems zerograph-s3,zerograph-s3-noov,ddp,fsdp2,fsdp2-compile --json bench.json --png bench.png

One launch runs every system on the same ranks, from the same initial values on the same
batches, and reports per system: step time, tokens/s, exposed communication, peak memory,
elements moved per step against the ZeRO paper's 2Ψ / 3Ψ, and every step's loss, which must
agree across systems. ``--simulate CLUSTER`` projects each zerograph schedule's measured profile
onto a cluster of ``clusters.json`` (or ``local``: this machine, as a self-consistency check).

Systems (``--systems``, comma-separated; docs/bench.md's table says what each modifier sets):
    zerograph-s<0-3>[-noov][-pool][-keeproot][-pf<K>][-bb<BYTES>][-inductor][-islands][-qw][-qg][-tpl|-notpl][-hsdp<S>][-hpz<M>]
        ``zerograph.compile`` at that stage; each modifier sets one ``Config`` field or policy
        field (``systems.MODIFIERS``), and ``Config`` checks the result. ``-hsdp<S>`` shards over
        groups of S ranks and replicates across them; under ``--simulate`` a group of S
        (``-hsdp``) or M (``-hpz``) ranks is a node.
    ddp             ``torch.nn.parallel.DistributedDataParallel``
    fsdp2           ``torch.distributed.fsdp.fully_shard`` on each block, then on the root
    fsdp2-compile   the same, then ``torch.compile(model)``

A step is ``loss = model(*batch); loss.backward(); opt.step(); opt.zero_grad()``, AdamW, fp32.
``--model``: a size of the package's GPT, a real model (``hf-gpt2``, ``hf-llama``,
``titan-llama``) or ``module:factory``. docs/bench.md has the factory's contract, the definition
of every figure and the package's layout.

Sources: ZeRO (Rajbhandari et al., arXiv 1910.02054) section 7; FSDP2
(``torch.distributed.fsdp.fully_shard``); nccl-tests' bus-bandwidth convention; the two-stream
projection is ``zerograph.report.timeline.predict``.
"""
from __future__ import annotations

from ..graph.costmodel import CLUSTERS_FILE, cluster_cost_model, load_cluster_table
from ..report.profile import ProfiledCost, attribute_seconds, match_nodes, roofline_seconds
from .cli import (
    DEFAULT_SYSTEMS,
    add_arguments,
    build_parser,
    describe_rank_failure,
    main,
    run,
    validate_args,
)
from .comm import KINDS, CollectiveCounter, comm_breakdown, count_collectives
from .memory import MemoryProbe, held_bytes, peak_allocations, profile_allocations
from .profiling import STEP_LABEL, profile_steps
from .report import (
    DEFINITIONS,
    MIB,
    format_report,
    format_simulation,
    format_table,
    machine_description,
    plot,
    report,
)
from .runner import loss_check, measure_all, merge_ranks, prime_systems, rank_main, run_system
from .simulation import LOCAL_CLUSTER, Cluster, cluster_links, group_cost_models, mesh_dims_of, simulate_system
from .systems import SystemSpec, build_system, check_world_size, parse_system, parse_systems, train_step
from .workloads import (
    Workload,
    load_factory,
    load_workload,
    padded_params,
    unique_params,
)

__all__ = [
    "CLUSTERS_FILE", "DEFAULT_SYSTEMS", "DEFINITIONS", "KINDS", "LOCAL_CLUSTER", "MIB", "STEP_LABEL",
    "Cluster", "CollectiveCounter", "MemoryProbe", "ProfiledCost", "SystemSpec", "Workload",
    "add_arguments", "attribute_seconds", "build_parser", "build_system", "check_world_size", "cluster_cost_model",
    "cluster_links",
    "comm_breakdown", "count_collectives", "describe_rank_failure", "format_report", "format_simulation",
    "format_table", "group_cost_models", "held_bytes", "load_cluster_table", "load_factory", "load_workload", "loss_check",
    "machine_description", "main", "mesh_dims_of", "match_nodes", "measure_all", "merge_ranks", "padded_params",
    "parse_system", "parse_systems", "peak_allocations", "plot", "prime_systems", "profile_allocations", "profile_steps",
    "rank_main", "report", "roofline_seconds", "run", "run_system", "simulate_system", "train_step",
    "unique_params", "validate_args",
]
