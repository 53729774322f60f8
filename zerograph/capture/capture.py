"""The torch.compile backend: Dynamo graph -> AOTAutograd joint graph -> passes -> lowering.

Capture knows nothing of stages. For each Dynamo graph, in order: the parameter-write check
(``parameter_writes``); AOTAutograd's joint graph through the joint pipeline; the min-cut
partition; the partitioned pair's pipeline; the forward, backward (or inference) pipelines; the
lowering (``lowering``); and a wrapper that lets the runtime check and count the collectives each
call runs (``_account``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition

from zerograph.passes.activation_partition import offloaded_outputs, saved_activation_outputs, wants_offload
from zerograph.passes.context import PartitionedGraphs, PassContext
from zerograph.passes.liveness import Timeline, timeline
from zerograph.passes.manager import Graphs, collective_volume, pipeline, run_pipeline, structured_trace_on
from zerograph.passes.secondary_partition import secondary_partition_outputs

from ..config import Config
from ..graph import registry
from ..graph.ops import UNIT_BACKWARD
from ..runtime.runtime import Runtime
from ..runtime.state import CapturedGraphs
from ..shard.parameter_writes import check_no_parameter_writes
from ..templates.unit_reach import read_in_part
from .lowering import decompositions, lower
from .unreached import none_for_unreached, output_reach

log = logging.getLogger(__name__)


class ZeroGraphBackend:
    """The ``torch.compile`` backend of one compiled model: Dynamo graph -> joint graph -> passes
    -> partition -> passes per graph -> lowering -> accounted callable.

    Each step is a method that tests can call on its own: ``pass_context`` (the passes' inputs,
    built from the config in this one place), ``run_passes`` (one graph kind's pipeline, dumped
    when asked), ``partition`` (the joint pipeline, then the min-cut partitioner), and
    ``compile_graph`` (one partitioned graph's pipeline, liveness and lowering). Calling the object
    with a Dynamo graph runs them through AOTAutograd.

    Args:
        runtime: the model's ``Runtime``.
        config: the model's ``Config``.
        params: ``id(parameter)`` -> its name; Dynamo passes the real parameter objects as example
            inputs, so every graph input is matched to its parameter by identity.
        captured: where every graph is recorded for tests and inspection.
    """

    def __init__(self, runtime: Runtime, config: Config, params: dict[int, str], captured: CapturedGraphs):
        self.runtime = runtime
        self.config = config
        self.params = params
        self.captured = captured
        self.lowering = config.resolved_lowering(runtime.device)  # "eager" or "inductor"
        self._graph_ids = itertools.count()

    def pass_context(self, kind: str) -> PassContext:
        """The ``PassContext`` of a graph of ``kind``: the runtime's layout and the config's policies."""
        runtime, config, topology = self.runtime, self.config, self.runtime.topology
        return PassContext(kind, runtime.stage, topology.world_size, topology.group_name, runtime.marker_layouts,
                           tuple(runtime.units), schedule=config.schedule, memory=config.memory,
                           activations=dataclasses.replace(config.activations, group=None),
                           activation_group=config.activations.group_for_passes(),
                           buffer_pool=_pool_for(self.lowering, runtime, config),
                           replicate_group=topology.replicate_spec,
                           gather_quantization=config.gather_quantization,
                           reduce_quantization=config.reduce_quantization,
                           secondary_group=topology.secondary_spec)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        check_no_parameter_writes(gm.graph, self.runtime.marker_layouts, {
            flat.layout.fqn: {offset: layout.fqn for offset, layout in zip(flat.offsets, flat.layouts)}
            for flat in self.runtime.flat_shards.values()})
        in_part = read_in_part(gm)
        if in_part is not None:  # a unit's outputs read in part: autograd must decide per parameter
            kind, why = in_part
            registry.unit_kind(kind).leave_flat_shards(
                f"{why} (eager leaves .grad None for a parameter only an unread output reaches; a template's "
                "backward would give zeros)")
        graph = _GraphCompile(self, next(self._graph_ids), gm, example_inputs)
        reach = output_reach(gm)
        compiled = aot_module_simplified(
            gm, example_inputs,
            fw_compiler=functools.partial(graph.compile_graph, "forward"),
            bw_compiler=functools.partial(graph.compile_graph, "backward"),
            inference_compiler=functools.partial(graph.compile_graph, "inference"),
            partition_fn=graph.partition, decompositions=decompositions(self.lowering),
        )
        return none_for_unreached(compiled, reach, self.runtime.topology.world_group, self.runtime.device)


class _GraphCompile:
    """One Dynamo graph on its way through AOTAutograd: what its joint, forward and backward
    compiles share (the graph id, the record of its graphs, the forward's liveness)."""

    def __init__(self, backend: ZeroGraphBackend, graph_id: int, gm: fx.GraphModule, example_inputs: list[Any]):
        self.backend = backend
        self.graph_id = graph_id
        self.record: dict[str, fx.GraphModule] = {"dynamo": gm}
        self.memory: dict[str, Timeline] = {}
        self.user_outputs: list[int] = []
        captured, runtime = backend.captured, backend.runtime
        # a unit's flat shard is a new tensor each forward (FlatShard.input, this forward's while it compiles)
        names = {**backend.params, **{id(flat.input): flat.layout.fqn for flat in runtime.flat_shards.values()
                                      if flat.input is not None}}
        captured.input_params.append([names.get(id(x)) for x in example_inputs])
        captured.graphs.append(self.record)
        runtime.accounting.graph_memory.append(self.memory)
        self.dump_root = backend.config.resolved_dump_dir()
        if self.dump_root:  # the dump's cost model: collective, so here on every rank alike (not in AOT's compilers)
            from ..dump import begin_dump, calibrate_once  # imported only when dumping: off costs nothing

            calibrate_once(runtime.topology.group)
            begin_dump(self.dump_root, runtime)  # the run's manifest; clears a previous dump there, refuses a non-dump

    def run_passes(self, kind: str, g: Graphs) -> Graphs:
        """Run the pipeline of ``kind`` on ``g`` (dumped when asked) and record the result."""
        backend = self.backend
        dump_dir = (os.path.join(self.dump_root, f"rank{backend.runtime.topology.mesh_rank}", f"graph{self.graph_id}_{kind}")
                    if self.dump_root else None)
        g = run_pipeline(g, backend.pass_context(kind), pipeline(kind), disabled=backend.config.disabled_passes,
                         dump_dir=dump_dir)
        self.record[kind] = g
        traced = structured_trace_on()  # TORCH_TRACE: the same numbers go to tlparse's trace
        if dump_dir or traced:  # the final graph's rendering, memory, schedule (imported here: off costs nothing)
            from ..dump import finish_graph

            saved = self.memory["forward"].saved if kind == "backward" and "forward" in self.memory else None
            finish_graph(dump_dir, kind, g, backend.runtime, backend.captured, self.graph_id, carried=saved,
                         traced=traced)
        return g

    def partition(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        """AOTAutograd's ``partition_fn``: the joint pipeline, the min-cut partitioner, then the
        partitioned pair's pipeline (the rewrites that bind forward and backward)."""
        self.user_outputs.append(kwargs["num_fwd_outputs"])  # the forward's outputs past these are saved for backward
        joint = self.run_passes("joint", joint)
        with _offloading(joint):
            fwd, bwd = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        pair = self.run_passes("partitioned", PartitionedGraphs(fwd, bwd, kwargs["num_fwd_outputs"]))
        return pair.forward, pair.backward

    def compile_graph(self, kind: str, g: fx.GraphModule, inputs: list[Any]) -> Callable:
        """AOTAutograd's forward / backward / inference compiler: passes, liveness, lowering, accounting."""
        backend = self.backend
        g = self.run_passes(kind, g)
        carried = self.memory["forward"].saved if kind == "backward" else None
        self.memory[kind] = timeline(g.graph, carried=carried)
        lowered, islands = lower(backend.lowering, g, inputs, kind, backend.config.inductor_islands)
        if islands is not None:
            backend.captured.islands[self.graph_id, kind] = islands
        if kind == "forward" and self.user_outputs:
            saved = saved_activation_outputs(g.graph, self.user_outputs[-1])
            offloaded, secondary = offloaded_outputs(g.graph), secondary_partition_outputs(g.graph)
            lowered = _measure_saved(lowered, [i for i in saved if i not in offloaded and i not in secondary],
                                     offloaded, secondary, backend.captured, self.graph_id)
        call = _account(backend.runtime, g, lowered, backward=kind == "backward", graph_id=self.graph_id)
        # a backward may run after its model is gone: keep the templates its graph calls alive
        call._zerograph_templates = [registry.template_of(n.args[0]) for n in g.graph.nodes  # type: ignore[attr-defined]
                                     if n.target is UNIT_BACKWARD]
        return call


def _offloading(joint: fx.GraphModule) -> contextlib.AbstractContextManager:
    """PyTorch's partitioner-level activation offloading, switched on for one partition when
    ``activation_partition`` marked saved activations ``should_offload``. On CUDA the copies run on
    a transfer stream: the device-to-host copy waits only at the forward's end (sink_wait) and the
    host-to-device copy starts ahead of its first backward use (reload_prefetch); on CPU a plain
    ``device_put`` (no streams to overlap on)."""
    marked = [n for n in joint.graph.nodes if wants_offload(n)]
    if not marked:
        return contextlib.nullcontext()
    on_cuda = any(n.meta["val"].device.type == "cuda" for n in marked)
    # cse off: it would merge the views activation_partition replays in backward on an offloaded
    # tensor with their forward twins, and the partitioner would save those views (never offloaded)
    options = dict(enable_activation_offloading=True, activation_offload_separate_stream=on_cuda,
                   activation_offload_sink_wait=on_cuda, activation_reload_prefetch=on_cuda, cse=False)
    known = {k: v for k, v in options.items() if hasattr(torch._functorch.config, k)}  # older torch: fewer knobs
    return torch._functorch.config.patch(**known)


def _pool_for(lowering: str, runtime: Runtime, config: Config) -> int | None:
    """The buffer pool ``buffer_reuse`` may use: the runtime's under the eager lowering when
    ``MemoryPolicy.pool_comm_buffers`` asks for it; none under Inductor, which plans its own
    buffers and hands a dead buffer's storage to a later one, so a pooled slot could end up as the
    storage of a tensor that outlives the graph (a gradient)."""
    return runtime.buffer_pool.id if lowering == "eager" and config.memory.pool_comm_buffers else None


def _account(runtime: Runtime, gm: fx.GraphModule, compiled: Callable, backward: bool, graph_id: int) -> Callable:
    """Wrap a lowered graph: each call first checks that every rank is about to run the same
    communication schedule (``ScheduleCheck.check_schedule``: one 16-byte all-gather, raises
    ``ScheduleMismatchError`` instead of letting diverged ranks hang), then counts the graph's
    collectives (and that graph ``graph_id`` ran) into the step counter, then runs it. A communication failure inside the graph (a
    peer died, a timeout) is re-raised as ``CollectiveError`` naming the graph, chaining the cause.
    """
    volume = collective_volume(gm.graph)
    schedule = runtime.schedule_check.schedule(gm.graph, "backward" if backward else "forward")  # computed once per graph

    def call(args: list[Any]) -> Any:
        runtime.schedule_check.check_schedule(schedule)
        for kind, numel, itemsize, group_name in volume:
            dim, size = runtime.topology.comm_dim(group_name)
            runtime.accounting.current.add(kind, numel, itemsize, size, dim)
        runtime.accounting.current.graphs.add(graph_id)
        if backward:
            runtime.accounting.backward_ran = True
        return runtime.run_graph(schedule, compiled, args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _measure_saved(compiled: Callable, positions: list[int], offloaded: list[int], secondary: list[int],
                   captured: CapturedGraphs, graph_id: int) -> Callable:
    """Wrap a lowered forward: after each call, record in ``captured.saved_activation_bytes`` the
    bytes of the activations it returned for backward on the device (outputs at ``positions``, each
    storage once, none of the graph's inputs), in ``captured.offloaded_activation_bytes`` those
    it handed over in host memory (outputs at ``offloaded``) and in
    ``captured.secondary_partition_bytes`` hpZ's secondary partitions (outputs at ``secondary``).
    The inputs' storages are read first: a boxed call may clear them."""
    def call(args: list[Any]) -> Any:
        inputs = input_storages(args)
        outs = compiled(args)
        captured.saved_activation_bytes[graph_id] = measured_bytes([outs[i] for i in positions], inputs)
        captured.offloaded_activation_bytes[graph_id] = measured_bytes([outs[i] for i in offloaded], inputs)
        captured.secondary_partition_bytes[graph_id] = measured_bytes([outs[i] for i in secondary], inputs)
        return outs

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def measured_bytes(saved: Sequence[torch.Tensor], inputs: set[int]) -> int:
    """Bytes of the storages of ``saved`` (each storage once), except those of ``inputs``
    (``untyped_storage().data_ptr()`` of the graph's input tensors)."""
    storages: dict[int, int] = {}
    for t in saved:
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def input_storages(args: Sequence[object]) -> set[int]:
    """``data_ptr`` of the storage of every tensor in ``args`` (a graph call's inputs)."""
    return {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
