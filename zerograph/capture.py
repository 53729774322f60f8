"""The torch.compile backend: Dynamo graph -> AOTAutograd joint graph -> passes -> lowering.

Capture knows nothing of stages: it maps graph inputs back to parameters, hands each graph to the
pass pipeline of its kind, partitions with the min-cut partitioner, lowers, and wraps the lowered
callables so the runtime counts the collectives each call runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.graph import _BoxedCodeGen
from torch.multiprocessing.reductions import StorageWeakRef

from zerograph.passes.activation_partition import offloaded_outputs, saved_activation_outputs, wants_offload
from zerograph.passes.context import PartitionedGraphs, PassContext
from zerograph.passes.liveness import Timeline, timeline
from zerograph.passes.manager import Graphs, collective_volume, pipeline, run_pipeline, structured_trace_on
from zerograph.passes.secondary_partition import secondary_partition_outputs

from . import registry
from .config import Config
from .errors import ShardingError
from .islands import lower_islands
from .ops import UNIT_BACKWARD, UNIT_FORWARD, UNSHARD
from .runtime import Runtime

log = logging.getLogger(__name__)


class CapturedGraphs:
    """What one compile produced, kept for tests and inspection (plain FX graph modules)."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, fx.GraphModule]] = []
        self.input_params: list[list[str | None]] = []
        # graph id -> bytes of activations its forward handed to backward on its last call (measured)
        self.saved_activation_bytes: dict[int, int] = {}
        self.offloaded_activation_bytes: dict[int, int] = {}  # handed over in host memory instead (offload)
        self.secondary_partition_bytes: dict[int, int] = {}  # hpZ's pieces of gathered parameters
        # (graph id, kind) -> (islands, distinct islands compiled) under the Inductor lowering (islands.py)
        self.islands: dict[tuple[int, str], tuple[int, int]] = {}
        self.templates: list = []  # unit_trace.UnitTemplate, one per unit kind and input signature traced


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
        runtime, config = self.runtime, self.config
        return PassContext(kind, runtime.stage, runtime.world_size, runtime.group_name, runtime.marker_layouts,
                           tuple(runtime.units), schedule=config.schedule, memory=config.memory,
                           activations=dataclasses.replace(config.activations, group=None),
                           activation_group=config.activations.group_for_passes(),
                           buffer_pool=_pool_for(self.lowering, runtime),
                           replicate_group=(None if runtime.replicate_group is None
                                            else (runtime.replicate_group_name, runtime.replicate_size)),
                           gather_quantization=config.gather_quantization,
                           reduce_quantization=config.reduce_quantization,
                           secondary_group=(None if runtime.secondary_group is None
                                            else (runtime.secondary_group_name, runtime.secondary_size)))

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        check_no_parameter_writes(gm.graph, self.runtime.marker_layouts, {
            flat.layout.fqn: {offset: layout.fqn for offset, layout in zip(flat.offsets, flat.layouts)}
            for flat in self.runtime.flat_shards.values()})
        graph = _GraphCompile(self, next(self._graph_ids), gm, example_inputs)
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=functools.partial(graph.compile_graph, "forward"),
            bw_compiler=functools.partial(graph.compile_graph, "backward"),
            inference_compiler=functools.partial(graph.compile_graph, "inference"),
            partition_fn=graph.partition, decompositions=_decompositions(self.lowering),
        )


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
        captured.input_params.append([backend.params.get(id(x)) for x in example_inputs])
        captured.graphs.append(self.record)
        runtime.graph_memory.append(self.memory)
        self.dump_root = backend.config.resolved_dump_dir()
        if self.dump_root:  # the dump's cost model: collective, so here on every rank alike (not in AOT's compilers)
            from .dump import begin_dump, calibrate_once  # imported only when dumping: off costs nothing

            calibrate_once(runtime.group)
            begin_dump(self.dump_root, runtime)  # the run's manifest; clears a previous dump there, refuses a non-dump

    def run_passes(self, kind: str, g: Graphs) -> Graphs:
        """Run the pipeline of ``kind`` on ``g`` (dumped when asked) and record the result."""
        backend = self.backend
        dump_dir = (os.path.join(self.dump_root, f"rank{backend.runtime.mesh_rank}", f"graph{self.graph_id}_{kind}")
                    if self.dump_root else None)
        g = run_pipeline(g, backend.pass_context(kind), pipeline(kind), disabled=backend.config.disabled_passes,
                         dump_dir=dump_dir)
        self.record[kind] = g
        traced = structured_trace_on()  # TORCH_TRACE: the same numbers go to tlparse's trace
        if dump_dir or traced:  # the final graph's rendering, memory, schedule (imported here: off costs nothing)
            from .dump import finish_graph

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
        lowered, islands = _lower(backend.lowering, g, inputs, kind, backend.config.inductor_islands)
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


# methods ending in "_" that write no element of their tensor
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})
_INPLACE_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                                operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})
# functions that write their weight when given max_norm (they renormalise the rows they look up)
_RENORMALISING = {torch.nn.functional.embedding: 1, torch.nn.functional.embedding_bag: 1}


def written_arguments(node: fx.Node) -> list[tuple[Any, str]]:
    """``(argument, op)`` for every argument a Dynamo graph node writes in place: a method ending
    in ``_`` (``clamp_``, ``copy_``, ``mul_``), item assignment and augmented operators, a torch
    function ending in ``_`` (``torch.embedding_renorm_``), ``F.embedding`` / ``F.embedding_bag``
    with ``max_norm``, an ``OpOverload`` whose schema marks an argument written, ``out=`` and
    ``inplace=True``."""
    target, args, kwargs = node.target, node.args, node.kwargs
    found: list[tuple[Any, str]] = []
    if node.op == "call_method" and args:
        name = str(target)
        if (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES) or name in (
                "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
            found.append((args[0], f"Tensor.{name}"))
    elif node.op == "call_function":
        if target in _INPLACE_OPERATORS and args:
            found.append((args[0], "item assignment (t[...] = v)" if target is operator.setitem
                          else f"operator.{target.__name__}"))
        elif target in _RENORMALISING:
            bound = inspect.signature(target).bind(*args, **kwargs)
            if bound.arguments.get("max_norm") is not None:
                found.append((args[_RENORMALISING[target]] if len(args) > 1 else kwargs.get("weight"),
                              f"F.{target.__name__}(max_norm=...), which renormalises the rows it looks up in place"))
        elif isinstance(target, torch._ops.OpOverload):
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    found.append((value, str(target)))
        elif getattr(target, "__name__", "").endswith("_") and getattr(target, "__module__", None) in (
                "torch", "torch._C._VariableFunctions", None) and args:
            found.append((args[0], f"torch.{target.__name__}"))
    if isinstance(kwargs.get("out"), fx.Node):
        found.append((kwargs["out"], f"{getattr(target, '__name__', target)}(out=...)"))
    if kwargs.get("inplace") is True and args:
        found.append((args[0], f"{getattr(target, '__name__', target)}(inplace=True)"))
    return found


_CUTS = frozenset({"view", "reshape", operator.getitem})  # how FlatShard.full_parameter cuts, as Dynamo records it


def check_no_parameter_writes(graph: fx.Graph, layouts: dict[int, Any],
                              flat_members: dict[str, dict[int, str]] | None = None) -> None:
    """Refuse a captured forward that writes a gathered parameter in place.

    Inside a zerograph forward a parameter attribute is ``zerograph::unshard``'s output, a new
    tensor (the gathered copy at stages 1-3, a copy of the replica at stage 0), so an in-place
    write to it, or to a view of it (``weight.data``, ``weight[i]``), never reaches the shards
    the optimizer updates: it would be lost silently. Writes are found by storage: every written
    argument (``written_arguments``) whose fake value shares a storage with a marker's output.
    Writing back instead is not offered: every rank writes its own rows of a different batch
    (DDP's replicas diverge there), so there is no single result to store.

    Also refuses ``F.embedding(..., sparse=True)`` on a parameter (a sparse gradient; see
    ``api._check_no_sparse_gradients`` for the module form).

    ``flat_members``: a unit's flat shard name -> element offset -> the name of the parameter there
    (``flat.py``), so that a write to a parameter cut out of the flat shard names the parameter.

    Raises:
        ShardingError: naming the parameter (its first name), the op and what to do instead.
    """
    marker_of: dict[StorageWeakRef, str] = {}  # storage of a full parameter (or a view) -> its name
    name_of: dict[fx.Node, str] = {}  # the markers and their cuts -> the parameter's name
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        if node.target is UNSHARD:
            name_of[node] = layouts[node.args[1]].fqn
        elif node.target in _CUTS and node.args and node.args[0] in name_of:
            # a parameter cut out of its unit's gathered flat shard (flat.py), a reshape's copy at
            # world size > 1; the cut's column slice says which parameter it is
            name = name_of[node.args[0]]
            index = node.args[1] if len(node.args) > 1 else None
            if isinstance(index, tuple) and len(index) == 2 and isinstance(index[1], slice):
                name = (flat_members or {}).get(name, {}).get(index[1].start, name)
            name_of[node] = name
        else:
            continue
        marker_of.setdefault(StorageWeakRef(value.untyped_storage()), name_of[node])
    if not marker_of:
        return
    for node in graph.nodes:
        if node.target in _RENORMALISING and inspect.signature(node.target).bind(*node.args, **node.kwargs) \
                .arguments.get("sparse") is True:  # F.embedding(..., sparse=True): see api's module check
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            value = weight.meta.get("example_value") if isinstance(weight, fx.Node) else None
            fqn = name_of.get(weight) or (marker_of.get(StorageWeakRef(value.untyped_storage()))
                                          if isinstance(value, torch.Tensor) else None)
            if fqn is not None:
                raise ShardingError(
                    f"parameter {fqn!r} gets a sparse gradient from F.{node.target.__name__}(sparse=True) "
                    f"(graph node {node.name!r}), which zerograph's sharded parameters (DTensors) cannot hold: "
                    "use sparse=False")
        for arg, op in written_arguments(node):
            value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
            if not isinstance(value, torch.Tensor):
                continue
            fqn = name_of.get(arg) or marker_of.get(StorageWeakRef(value.untyped_storage()))
            if fqn is None:
                continue
            raise parameter_write_error(fqn, op, node.name)


def parameter_write_error(fqn: str, op: str, node_name: str) -> ShardingError:
    """The error for parameter ``fqn`` written in place by ``op`` (graph node ``node_name``) inside
    forward, with what to do instead; one wording for the model graph and a unit template's body."""
    if "embedding_renorm" in op:  # as a traced body records F.embedding(max_norm=...)
        op = f"{op}, which F.embedding(max_norm=...) calls to renormalise the rows it looks up in place"
    renormalising = "max_norm" in op
    hint = ("build the embedding with max_norm=None and, if the norm bound matters, renormalise after "
            "opt.step() under torch.no_grad() (outside forward the weight is this rank's DTensor shard of "
            "whole rows, Shard(0), e.g. w.to_local().copy_(torch.renorm(w.to_local(), 2, 0, max_norm)); "
            "this bounds every row, not only those looked up)" if renormalising else
            "compute with a changed copy instead (w = self.weight.clamp(...)), or change the parameter "
            "outside forward, e.g. after opt.step() under torch.no_grad(), where it is this rank's "
            "DTensor shard")
    return ShardingError(
        f"parameter {fqn!r} is written in place inside forward by {op} (graph node {node_name!r}). "
        "Inside a zerograph forward a parameter is a gathered copy of the shards (at every stage), so "
        f"the write would never reach the parameter and would be lost silently. To fix: {hint}")


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


def _pool_for(lowering: str, runtime: Runtime) -> int | None:
    """The buffer pool ``buffer_reuse`` may use: the runtime's under the eager lowering; none under
    Inductor, which plans its own buffers and hands a dead buffer's storage to a later one, so a
    pooled slot could end up as the storage of a tensor that outlives the graph (a gradient)."""
    return runtime.buffer_pool.id if lowering == "eager" else None


def _lower(lowering: str, gm: fx.GraphModule, inputs: list[Any], kind: str,
           with_islands: bool) -> tuple[Callable, tuple[int, int] | None]:
    """The lowered graph, and under Inductor's lowering by islands (islands, distinct islands)."""
    if lowering == "inductor":
        if any(n.target in (UNIT_FORWARD, UNIT_BACKWARD) for n in gm.graph.nodes) and _static_shapes(gm):
            # the units' bodies are lowered per kind already (unit_trace): the rest runs as FX
            # Python, or with Config.inductor_islands, Inductor takes the islands of compute
            # between the units, each distinct one once (islands.py)
            if not with_islands:
                return _boxed(gm), None
            split, islands, compiled = lower_islands(gm, kind, _inductor_island)
            log.info("%s graph: %d compute islands lowered by Inductor, %d distinct", kind, islands, compiled)
            return _boxed(split), (islands, compiled)
        return _inductor(_decomposed(gm, inputs), inputs, kind), None
    return _boxed(gm), None


def _static_shapes(gm: fx.GraphModule) -> bool:
    """No input of ``gm`` has a symbolic size or stride (the islands' keys compare sizes as ints)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride(), value.storage_offset()))):
            return False
    return True


def _inductor_island(island: fx.GraphModule, inputs: list[Any], kind: str) -> Callable:
    """One island (``islands.lower_islands``) lowered by Inductor, its outputs in the strides the
    graph's fake values give them: the rest of the graph (views, unit calls, collectives, other
    islands) was traced with those. So every output is marked user-visible (Inductor otherwise
    may pad an output's strides on GPU), and an island whose decomposition changes an output's
    strides runs as FX Python instead. In a tracing context of its own: Inductor records each
    compiled graph's output strides in the current one, which AOTAutograd keeps for the graph it
    compiles (room for one graph's)."""
    decomposed = _decomposed(island, inputs)
    (output,) = decomposed.graph.find_nodes(op="output")
    (expected,) = island.graph.find_nodes(op="output")
    if [n.meta["val"].stride() for n in output.args[0]] != [n.meta["val"].stride() for n in expected.args[0]]:
        log.info("%s island left to Python: its decomposition changes an output's strides", kind)
        return lambda args: list(island(*args))
    output.meta["user_visible_output_idxs"] = list(range(len(output.args[0])))
    with torch._guards.tracing(torch._guards.TracingContext(detect_fake_mode(inputs))):
        return _inductor(decomposed, inputs, kind)


def _decomposed(gm: fx.GraphModule, inputs: list[Any]) -> fx.GraphModule:
    """``gm`` traced again on its fake ``inputs`` with Inductor's decompositions: the passes
    spliced in plain aten ops (t, reshape, ...), which Inductor lowers only decomposed."""
    from torch._inductor.decomposition import select_decomp_table

    with detect_fake_mode(inputs) or contextlib.nullcontext():
        return make_fx(fx.Interpreter(gm).run, decomposition_table=select_decomp_table())(*inputs)


def _inductor(gm: fx.GraphModule, inputs: list[Any], kind: str) -> Callable:
    """Inductor's ``compile_fx_inner`` on a decomposed graph (a whole one, or an island): a boxed callable."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, inputs, is_backward=kind == "backward", is_inference=kind == "inference")


def _boxed(gm: fx.GraphModule) -> Callable:
    """The eager lowering: FX's generated Python, called with AOTAutograd's boxed convention (one
    list, which the code empties once it has read it), so that each input, e.g. an activation
    saved for backward, is freed after its last use instead of when the graph returns (Inductor's
    generated code does the same). Runs a copy: the recorded graph keeps its ordinary signature."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_BoxedCodeGen())
    boxed = fx.GraphModule(gm, graph)

    def run(args: list[Any]) -> Any:
        return boxed.forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _decompositions(lowering: str) -> dict | None:
    if lowering == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None


def _account(runtime: Runtime, gm: fx.GraphModule, compiled: Callable, backward: bool, graph_id: int) -> Callable:
    """Wrap a lowered graph: each call first checks that every rank is about to run the same
    communication schedule (``Runtime.check_schedule``: one 16-byte all-gather, raises
    ``ScheduleMismatchError`` instead of letting diverged ranks hang), then counts the graph's
    collectives (and that graph ``graph_id`` ran) into the step counter, then runs it. A communication failure inside the graph (a
    peer died, a timeout) is re-raised as ``CollectiveError`` naming the graph, chaining the cause.
    """
    volume = collective_volume(gm.graph)
    schedule = runtime.schedule(gm.graph, "backward" if backward else "forward")  # computed once per graph

    def call(args: list[Any]) -> Any:
        runtime.check_schedule(schedule)
        for kind, numel, itemsize, group_name in volume:
            dim, size = runtime.comm_dim(group_name)
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
