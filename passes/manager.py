"""Runs a named, ordered list of passes on a graph and checks it after each one.

After every pass: ``graph.lint()`` and zerograph's invariants (every collective waited exactly
once). After the whole pipeline: no marker of the graph's kind is left (every parameter gathered,
every trainable gradient reduced). A failure raises ``PassError`` naming the pass and those
before it. With a dump directory, the graph is written before the first pass and after each.
Modelled on ``torch.fx.passes.infra.pass_manager.PassManager`` and torchtitan's graph passes.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from zerograph.errors import ConfigError, PassError
from zerograph.graph.ops import GATHER_ACTIVATION, REDUCE_GRAD, UNSHARD
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG, WAIT, full_buffer, group_name_of

from ._fx import is_alias_of_input
from .activation_partition import activation_partition
from .bucketing import bucketing
from .buffer_reuse import buffer_reuse
from .context import PartitionedGraphs, PassContext, PassResult, graph_modules
from .contract import pipeline_problem
from .expand_inference_unit_calls import expand_inference_unit_calls
from .expand_unit_calls import expand_unit_calls
from .hand_over_secondary_pieces import hand_over_secondary_pieces
from .insert_allgather import insert_allgather
from .insert_reduce_scatter import insert_reduce_scatter
from .mark_recomputed_unit_calls import mark_recomputed_unit_calls
from .prefetch import prefetch
from .saved_opaque_objects_last import saved_opaque_objects_last
from .schedule_overlap import schedule_overlap
from .secondary_partition import secondary_partition
from .selective_unshard import selective_unshard

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule, PassContext], PassResult]  # the "partitioned" pipeline's take PartitionedGraphs
Graphs = fx.GraphModule | PartitionedGraphs


def pipeline(kind: str) -> list[Pass]:
    """The passes for one graph kind, in the order they run.

    - joint: sharding decisions, made before the partitioner so that its min-cut sees them
      (stage 3's recompute-tagged gathers decide what backward re-gathers, less the units
      ``selective_unshard`` keeps); ``mark_recomputed_unit_calls`` first, before the others
      rewrite the unit calls' arguments; ``activation_partition`` last, since it leaves the
      recompute tags of those passes alone and tags whole units so that saved activations fit
      the budget.
    - partitioned: the forward / backward pair the min-cut partitioner returns, rewritten where
      a change binds both graphs (what one saves, the other reads): saved tensors before opaque
      objects first, since the other two hand tensors over by that convention; then the unit
      templates' ops put back; then hpZ's pieces for checkpointed units.
    - forward / inference: the same gathers, for graphs that never were joint (``no_grad``; an
      inference graph's unit calls are expanded first); then the schedule (prefetch the
      gathers, sink their waits to first use).
    - backward: gradient reductions, placed where the stage says full gradients die; then the
      schedule (prefetch backward's re-gathers, sink every wait as far as memory allows).
    ``buffer_reuse`` comes last in each: it needs every buffer's final lifetime.
    The bucketing and insert passes find nothing to do on a graph whose markers are expanded.
    """
    gathers = [bucketing, insert_allgather]
    schedule = [prefetch, schedule_overlap]
    return {
        "joint": [mark_recomputed_unit_calls] + gathers + [selective_unshard, secondary_partition, activation_partition],
        "partitioned": [saved_opaque_objects_last, expand_unit_calls, hand_over_secondary_pieces],
        "forward": gathers + schedule + [buffer_reuse],
        "inference": [expand_inference_unit_calls] + gathers + schedule + [buffer_reuse],
        "backward": [bucketing, insert_reduce_scatter] + schedule + [buffer_reuse],
    }[kind]


GRAPH_KINDS = ("joint", "partitioned", "forward", "inference", "backward")
# the key of ``GraphModule.meta`` where ``run_pipeline`` leaves its record: nodes in and out and
# each pass's wall-clock seconds (what the dump's summary shows under "Compile time")
PASS_TIMES = "zerograph_passes"


def pass_names() -> set[str]:
    """Every pass some pipeline runs (what ``Config.disabled_passes`` may name)."""
    return {p.__name__ for kind in GRAPH_KINDS for p in pipeline(kind)}


def check_disabled_passes(disabled: Sequence[str]) -> None:
    """Refuse ``disabled`` when it names an unknown pass, or one that a later pass or the end of a
    pipeline requires (the passes' contracts, ``passes/contract.py``).

    Raises:
        ConfigError: naming the unknown pass, or the pipeline, pass and missing capability.
    """
    unknown = sorted(set(disabled) - pass_names())
    if unknown:
        raise ConfigError(f"Config.disabled_passes names unknown passes {unknown}; passes: {sorted(pass_names())}")
    for kind in GRAPH_KINDS:
        problem = pipeline_problem(kind, pipeline(kind), disabled)
        if problem is not None:
            raise ConfigError(f"Config.disabled_passes={tuple(disabled)} cannot run: {problem}. A pass that "
                              "provides what the pipeline needs is required: leave it enabled (it does nothing "
                              "on a graph it does not apply to)")


def run_pipeline(graphs: Graphs, ctx: PassContext, passes: Sequence[Pass], *,
                 disabled: Sequence[str] = (), dump_dir: str | None = None) -> Graphs:
    """Run ``passes`` (less ``disabled``) on ``graphs`` in order; return the final graph module
    (or, for the "partitioned" pipeline, the final ``PartitionedGraphs``).

    Raises:
        PassError: the pipeline breaks a pass contract (checked before any pass runs), a pass
            raised, or a graph fails a check after a pass (naming the pass and those before it).
    """
    problem = pipeline_problem(ctx.graph_kind, passes, disabled)
    if problem is not None:
        raise PassError(problem)
    graphs = lazily_recompiled(graphs)
    nodes_in = _node_count(graphs)
    seconds: dict[str, float] = {}
    dump = _open_dump(dump_dir, ctx, graphs)
    logged = log.isEnabledFor(logging.INFO)
    done: list[str] = []
    for number, pass_fn in enumerate(passes, start=1):
        name = pass_fn.__name__
        if name in disabled:
            log.info("pass %s disabled", name)
            if dump is not None:
                dump.disabled(number, name)
            continue
        before = _node_count(graphs) if logged else 0
        start = time.perf_counter()
        try:
            result = run_checked(pass_fn, graphs, ctx)
            graphs = result.graph_module
        except PassError:
            raise
        except Exception as exc:
            raise PassError(f"pass {name!r} failed on the {ctx.graph_kind} graph (after {done or 'no passes'}): {exc}") from exc
        done.append(name)
        seconds[name] = time.perf_counter() - start
        graphs = lazily_recompiled(graphs)  # a pass may hand back a new module
        log.info("%s graph: pass %d %s %s in %.1f ms, nodes %d -> %d", ctx.graph_kind, number, name,
                 result.counts, 1e3 * (time.perf_counter() - start), before, _node_count(graphs) if logged else 0)
        if dump is not None:
            dump.after_pass(number, name, graphs, result.modified, seconds=time.perf_counter() - start)
    check_pipeline_end(graphs, ctx, done)
    graphs.meta[PASS_TIMES] = {"nodes_in": nodes_in, "nodes_out": _node_count(graphs), "seconds": seconds}
    return graphs  # code is generated when first read or run; the eager lowering generates its own


def run_checked(pass_fn: Pass, graphs: Graphs, ctx: PassContext) -> PassResult:
    """One pass as ``run_pipeline`` runs each: then ``graph.lint()`` and ``check_collectives_waited``
    on every graph module it returns (tests run a single pass through this, as the pipeline does).

    Raises:
        PassError: a collective is not waited exactly once; whatever the pass or ``lint`` raise
            (``run_pipeline`` names the pass in a ``PassError``).
    """
    result = pass_fn(graphs, ctx)
    for gm in graph_modules(result.graph_module):
        gm.graph.lint()
        check_collectives_waited(gm.graph)
    return result


def _node_count(graphs: Graphs) -> int:
    return sum(len(gm.graph.nodes) for gm in graph_modules(graphs))


def check_pipeline_end(graphs: Graphs, ctx: PassContext, done: list[str]) -> None:
    """What capture needs of a graph of ``ctx.graph_kind`` when its pipeline is done: every marker
    of its kind expanded; for the partitioned pair, a forward that reduces no gradient and, at
    stage 3, saves no gathered parameter.

    Raises:
        PassError: naming the check and the passes that ran.
    """
    if isinstance(graphs, PartitionedGraphs):
        check_no_gradient_reduction_in_forward(graphs.forward)
        if ctx.stage == 3:
            check_no_saved_gathers(graphs.forward)
        return
    check_markers_expanded(graphs.graph, ctx, done)


def lazily_recompiled(graphs: Graphs) -> Graphs:
    """``graphs`` as ``torch.fx`` lazy graph modules: a pass's ``gm.recompile()`` then only marks its
    Python code stale, and the code is generated once, when something reads or runs it (a dump, a
    test), instead of after every pass: on a deep model that codegen is most of a pass's time, and
    the joint graph's code is never needed (the partitioner reads its graph)."""
    if isinstance(graphs, PartitionedGraphs):
        return dataclasses.replace(graphs, forward=lazily_recompiled(graphs.forward),
                                   backward=lazily_recompiled(graphs.backward))
    if isinstance(graphs, _LazyGraphModule):
        return graphs
    lazy = _LazyGraphModule(graphs, graphs.graph, class_name=type(graphs).__name__)
    lazy.meta.update(graphs.meta)
    return lazy


def _open_dump(dump_dir: str | None, ctx: PassContext, gm: Graphs):
    """The per-pass log (``zerograph.dump.GraphDump`` writing into ``dump_dir``, and / or the
    structured trace's ``PassTrace``) with the input graph recorded, or ``None`` when dumping and
    the trace are off. Imported here, not at the top, so that both off cost nothing."""
    traced = structured_trace_on()
    if not dump_dir and not traced:
        return None
    from zerograph.dump import open_pass_log

    return open_pass_log(dump_dir, ctx, gm, traced)


def structured_trace_on() -> bool:
    """True when PyTorch's structured trace (``TORCH_TRACE=dir``, read by ``tlparse``) will write:
    it has a handler other than the lazy one made without a directory (which removes itself)."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    return any(not (isinstance(h, LazyTraceHandler) and h.root_dir is None) for h in trace_log.handlers)


def check_collectives_waited(graph: fx.Graph) -> None:
    """Every collective's result is waited on exactly once (an unwaited one would leak or race)."""
    for node in graph.nodes:
        if node.target in COLLECTIVE_KINDS:
            waits = [u for u in node.users if u.target is WAIT]
            if len(waits) != 1 or len(node.users) != 1:
                raise PassError(f"collective {node.name} must have exactly one wait_tensor user, has {list(node.users)}")


def check_markers_expanded(graph: fx.Graph, ctx: PassContext, done: list[str]) -> None:
    marker = REDUCE_GRAD if ctx.graph_kind == "backward" else UNSHARD
    if ctx.graph_kind == "joint":
        return  # the joint graph keeps its reduce_grad markers for the backward pipeline
    left = graph.find_nodes(op="call_function", target=marker)
    if left:
        raise PassError(f"{ctx.graph_kind} graph still holds {len(left)} {marker} markers after {done}")


def check_no_saved_gathers(fwd: fx.GraphModule) -> None:
    """Stage 3: the forward graph saves shards only, never a gathered parameter or a view of one
    (except the gathers ``selective_unshard`` chose to keep)."""
    output = fwd.graph.find_nodes(op="output")[0]
    for saved in output.all_input_nodes:
        node = saved
        while is_alias_of_input(node):
            node = node.all_input_nodes[0]
        tag = node.meta.get(TAG, {})
        if tag.get("role") == "gather" and not tag.get("kept"):
            raise PassError(f"stage 3 forward saves gathered parameter {saved.name} for backward")


def check_no_gradient_reduction_in_forward(fwd: fx.GraphModule) -> None:
    """The partitioned forward graph holds no ``zerograph::reduce_grad`` marker: a gradient is
    reduced in backward, after the tangents it depends on. One in the forward means a gradient
    that does not depend on the tangents (a unit whose backward got none), which the min-cut
    partitioner may place in either graph depending on sizes that differ from rank to rank, so
    the ranks' collective schedules would diverge; refused on every rank alike instead."""
    reductions = fwd.graph.find_nodes(op="call_function", target=REDUCE_GRAD)
    if reductions:
        raise PassError(f"the forward graph reduces gradients ({', '.join(n.name for n in reductions)}): a "
                        "gradient that does not depend on the output's gradient; report it with the model")


def collective_volume(graph: fx.Graph) -> list[tuple[str, int, int, str | None]]:
    """``[(kind, full_numel, itemsize, group_name)]`` of every collective in the graph, in graph
    order; ``group_name`` is the process group it runs over (hybrid sharding: the shard or the
    replicate group). ``zerograph::gather_activation`` (ZeRO-R's P_a, hpZ's backward re-gather)
    counts as an all-gather of its padded full buffer over its group."""
    volume = []
    for node in graph.nodes:
        if node.target is GATHER_ACTIVATION:  # P_a's and hpZ's all-gather, inside the op
            piece, _, group_name, group_size = node.args[:4]
            val = piece.meta["val"]
            volume.append(("all_gather", val.numel() * group_size, val.element_size(), group_name))
            continue
        kind = COLLECTIVE_KINDS.get(node.target)
        if kind is None:
            continue
        val = full_buffer(node)
        volume.append((kind, val.numel(), val.element_size(), group_name_of(node)))
    return volume
