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
    zerograph-s<0-3>[-noov][-pool][-keeproot][-pf<K>][-bb<BYTES>][-inductor][-islands][-qw][-qg][-tpl|-notpl][-hsdp<S>][-hpz<M>]
        ``zerograph.compile`` at that stage with a ``Config``: each modifier sets one ``Config``
        field or policy field (``systems.MODIFIERS``) on the bench's base, and ``Config`` checks the result;
        ``-noov`` disables ``config.OVERLAP_PASSES`` (every
        wait right after its start); ``-pool`` sets ``MemoryPolicy.pool_comm_buffers=True`` (comm buffers
        from a pool held across steps instead of the allocator's); ``-keeproot`` sets
        ``MemoryPolicy.reshard_root_after_forward=False`` (the root unit stays gathered from forward
        to backward, as FSDP2 keeps its root); ``-pf``/``-bb`` override ``--prefetch-depth`` /
        ``--bucket-bytes``; ``-inductor`` lowers with Inductor instead of running FX eagerly;
        ``-islands`` (with ``-inductor``) sets ``Config.inductor_islands`` (Inductor also lowers
        the compute between templated units);
        ``-qw`` / ``-qg`` set ``Config.gather_quantization`` / ``reduce_quantization`` to
        ``"int8"`` (ZeRO++'s qwZ / qgZ); ``-tpl`` / ``-notpl`` set ``Config.unit_templates`` to
        ``True`` / ``False`` (each kind of unit traced once / the per-parameter build; neither:
        the default); ``-hsdp<S>`` shards over groups of S ranks and replicates across them
        (hybrid sharding, a ``(world / S, S)`` mesh of dims ``("replicate", "shard")``);
        ``-hpz<M>`` sets ``Config.secondary_partition_size`` (ZeRO++'s hpZ). Under ``--simulate``
        both groups of S or M ranks are taken to be one node of the cluster.
    ddp             ``torch.nn.parallel.DistributedDataParallel``
    fsdp2           ``torch.distributed.fsdp.fully_shard`` on each block, then on the root
    fsdp2-compile   the same, then ``torch.compile(model)``

A step is ``loss = model(*batch); loss.backward(); opt.step(); opt.zero_grad()`` with
``torch.optim.AdamW`` (no gradient clipping), fp32.

``--model hf-gpt2|hf-llama|titan-llama``: a real model (``real_models``: Hugging Face GPT-2 and
Llama built from a config and used unchanged, the torchtitan-shaped Llama of
``zerograph.models.titan_llama``), its loss computed outside the model (``Workload.loss``).

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
                    code. One tiny model of each kind of system is built and stepped before the
                    first system (``prime_systems``): what a process keeps after its first model
                    of a kind (imports, Dynamo's caches) is in every baseline, not in the first
                    system's peak. GPU: ``torch.cuda.max_memory_allocated`` over the timed steps minus the
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
is ``zerograph.report.timeline.predict``.

Layout (one module per concern): ``cli`` (flags, validation before any rank starts, launch),
``systems``, ``workloads``, ``runner`` (the per-rank step loop), ``profiling`` (profiled steps),
``comm``, ``memory``, ``real_models``, ``simulation`` (``--simulate``; per-node times from ``zerograph.report.profile``),
``report`` (text, JSON, PNG). The names below are the package's public surface.
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
