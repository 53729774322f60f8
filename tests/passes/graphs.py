"""Tiny hand-built FX graphs, shaped as capture leaves them, and a minimal ``PassContext``.

A graph here holds what a captured forward or backward holds around zerograph's markers: shard
placeholders, a view of each, ``zerograph::unshard(view, key)`` in a forward, compute ops
(``aten.mm`` and friends) and ``zerograph::reduce_grad(full_grad, key)`` in a backward, every node
with a fake ``meta["val"]`` (what the passes trace their replacements on). No Dynamo, no process
group: passes never touch one, and ``group_name`` is just a string on the collectives.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zerograph.graph.ops import REDUCE_GRAD, UNSHARD
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG, WAIT
from zerograph.passes._fx import find_collectives
from zerograph.passes.context import PassContext, graph_modules
from zerograph.passes.manager import lazily_recompiled, run_checked
from zerograph.shard.sharding import ROOT_INDEX, ParamLayout, Unit, make_layout

aten = torch.ops.aten
GROUP = "0"  # the process group's name as the collectives carry it; no such group exists


class GraphBuilder:
    """An ``fx.Graph`` built node by node, each node with a fake ``meta["val"]``.

    ``units``: parameter shapes per unit, e.g. ``[[(4, 4), (4,)], [(4, 4)]]``; unit ``i`` of the
    list is unit ``i + 1`` (unit 0 is the root, without parameters unless ``root`` is given).
    Parameter keys are assigned in order, 0, 1, ...
    """

    def __init__(self, units: Sequence[Sequence[tuple[int, ...]]], *, world_size: int = 2, stage: int = 3,
                 root: Sequence[tuple[int, ...]] = (), dtype: torch.dtype = torch.float32,
                 param_dtype: torch.dtype | None = None) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.world_size = world_size
        self.layouts: dict[int, ParamLayout] = {}
        unit_keys: list[tuple[int, ...]] = []
        for index, shapes in enumerate([root, *units]):
            keys = []
            for shape in shapes:
                key = len(self.layouts)
                param = torch.empty(shape, dtype=dtype, device="meta")
                self.layouts[key] = make_layout(key, f"u{index}.p{key}", index, param, world_size, stage > 0,
                                                param_dtype=param_dtype)
                keys.append(key)
            unit_keys.append(tuple(keys))
        self.units = tuple(Unit(i, "<root>" if i == ROOT_INDEX else f"u{i}", keys) for i, keys in enumerate(unit_keys))

    def keys_of(self, unit: int) -> tuple[int, ...]:
        return self.units[unit].keys

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def shard(self, key: int, rank: int = 0) -> fx.Node:
        """This rank's shard of parameter ``key`` as a placeholder, and its view (as the graph
        holds ``DTensor.to_local()``)."""
        return self.shards([key], rank)[key]

    def shards(self, keys: Sequence[int], rank: int = 0) -> dict[int, fx.Node]:
        """``shard`` of each key: the placeholders first, then their views (AOTAutograd's order)."""
        layouts = [self.layouts[key] for key in keys]
        placeholders = [self.input(f"shard_{layout.key}", *layout.local_shape(rank), dtype=layout.dtype)
                        for layout in layouts]
        return {layout.key: self.op(aten.view.default, p, list(layout.local_shape(rank)))
                for layout, p in zip(layouts, placeholders)}

    def unshard(self, shard: fx.Node, key: int) -> fx.Node:
        """``zerograph::unshard(shard, key)``: the full parameter, in ``param_dtype``."""
        layout = self.layouts[key]
        node = self.graph.call_function(UNSHARD, (shard, key))
        with self.mode:
            node.meta["val"] = torch.empty(layout.shape, dtype=layout.param_dtype)
        return node

    def reduce_grad(self, grad: fx.Node, key: int, grad_mode: str | None = None, rank: int = 0) -> fx.Node:
        """``zerograph::reduce_grad(grad, key)``: this rank's shard of the gradient."""
        layout = self.layouts[key]
        args = (grad, key) if grad_mode is None else (grad, key, grad_mode)
        node = self.graph.call_function(REDUCE_GRAD, args)
        with self.mode:
            node.meta["val"] = torch.empty(layout.local_shape(rank), dtype=layout.dtype)
        return node

    def op(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        with self.mode:
            node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]))
        return node

    def output(self, *values: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(values))
        self.graph.lint()
        return fx.GraphModule(torch.nn.Module(), self.graph)

    def ctx(self, graph_kind: str = "forward", stage: int = 3, **fields) -> PassContext:
        return PassContext(graph_kind=graph_kind, stage=stage, world_size=self.world_size, group_name=GROUP,
                           layouts=self.layouts, units=self.units, **fields)


def linear_chain(units: int = 3, *, rows: int = 4, world_size: int = 2, stage: int = 3, root: bool = False,
                 param_dtype: torch.dtype | None = None) -> tuple[GraphBuilder, fx.GraphModule]:
    """A forward graph of ``units`` linear layers, each unit a weight ``(rows, rows)`` and a bias
    ``(rows,)``: ``x = x @ unshard(w).t() + unshard(b)`` per unit, in order; returns the sum.
    With ``root``, the root unit holds one more weight, applied last (a language model's head)."""
    b = GraphBuilder([[(rows, rows), (rows,)]] * units, world_size=world_size, stage=stage,
                     root=[(rows, rows)] if root else (), param_dtype=param_dtype)
    x = b.input("x", 2, rows)
    shards = b.shards(list(b.layouts))
    for unit in range(1, units + 1):
        w_key, b_key = b.keys_of(unit)
        w, bias = b.unshard(shards[w_key], w_key), b.unshard(shards[b_key], b_key)
        x = b.op(aten.addmm.default, bias, x, b.op(aten.t.default, w))
        x = b.op(aten.relu.default, x)
    if root:
        (head,) = b.keys_of(ROOT_INDEX)
        x = b.op(aten.mm.default, x, b.op(aten.t.default, b.unshard(shards[head], head)))
    return b, b.output(b.op(aten.sum.default, x))


def backward_chain(units: int = 3, *, rows: int = 4, world_size: int = 2, stage: int = 3,
                   grad_mode: str | None = None) -> tuple[GraphBuilder, fx.GraphModule]:
    """A backward graph: per unit, last unit first, a full weight gradient ``(rows, rows)`` and a
    bias gradient ``(rows,)`` computed from the tangent, each handed to ``reduce_grad``; returns
    the reduced shards (as AOTAutograd's backward returns the parameters' gradients). ``stage``
0 lays the parameters out unsharded (every rank holds the whole tensor)."""
    b = GraphBuilder([[(rows, rows), (rows,)]] * units, world_size=world_size, stage=stage)
    act = b.input("act", 2, rows)
    g = b.input("tangent", 2, rows)
    outs: dict[int, fx.Node] = {}
    for unit in range(units, 0, -1):
        w_key, b_key = b.keys_of(unit)
        g = b.op(aten.mul.Tensor, g, act)  # the unit's backward compute
        w_grad = b.op(aten.mm.default, b.op(aten.t.default, g), act)  # (rows, rows)
        b_grad = b.op(aten.sum.dim_IntList, g, [0])  # (rows,)
        outs[w_key] = b.reduce_grad(w_grad, w_key, grad_mode)
        outs[b_key] = b.reduce_grad(b_grad, b_key, grad_mode)
    return b, b.output(*(outs[k] for k in sorted(outs)))


def count(gm: fx.GraphModule, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


def collectives(gm: fx.GraphModule, kind: str | None = None) -> list[fx.Node]:
    """The graph's collective nodes in graph order (of ``kind``: all_gather, reduce_scatter, ...)."""
    return [n for n in gm.graph.nodes if n.target in COLLECTIVE_KINDS and (kind is None or COLLECTIVE_KINDS[n.target] == kind)]


def waits(gm: fx.GraphModule) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=WAIT))


def positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(gm.graph.nodes)}


def gathers(gm: fx.GraphModule):
    """``find_collectives``' all-gathers, in graph order of their start."""
    return [c for c in find_collectives(gm.graph) if c.role == "gather"]


def gathered_forward(units: int = 4, **knobs) -> tuple[GraphBuilder, fx.GraphModule, PassContext]:
    """``linear_chain(units)`` after ``bucketing`` and ``insert_allgather`` (a forward graph as the
    schedule passes receive it: each unit's gather right before its first use). ``knobs``:
    ``PassContext`` fields (``schedule=SchedulePolicy(...)``, ``buffer_pool=0``, ...)."""
    from zerograph.passes.bucketing import bucketing
    from zerograph.passes.insert_allgather import insert_allgather

    b, gm = linear_chain(units)
    ctx = b.ctx("forward", **knobs)
    bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    return b, gm, ctx


def reduced_backward(units: int = 3, stage: int = 3, **knobs) -> tuple[GraphBuilder, fx.GraphModule, PassContext]:
    """``backward_chain(units)`` after ``bucketing`` and ``insert_reduce_scatter``."""
    from zerograph.passes.bucketing import bucketing
    from zerograph.passes.insert_reduce_scatter import insert_reduce_scatter

    b, gm = backward_chain(units, stage=stage)
    ctx = b.ctx("backward", stage=stage, **knobs)
    bucketing(gm, ctx)
    insert_reduce_scatter(gm, ctx)
    return b, gm, ctx


def in_module(node: fx.Node, path: str) -> fx.Node:
    """Mark ``node`` as traced inside submodule ``path`` (Dynamo's ``nn_module_stack``, which
    ``activation_partition`` reads to find each unit's forward nodes)."""
    node.meta["nn_module_stack"] = {f"L__self___{path}": (f"L['self'].{path}", torch.nn.Module)}
    return node


def joint_mlp(units: int = 3, *, rows: int = 4, batch: int = 2, world_size: int = 2, stage: int = 3,
              dropout: bool = False) -> tuple[GraphBuilder, fx.GraphModule]:
    """A joint graph (forward and backward in one, as AOTAutograd hands the partitioner) of
    ``units`` MLP blocks, unit ``i`` named ``u{i}`` with an up weight ``(4 * rows, rows)`` and a
    down weight ``(rows, 4 * rows)``. Forward, per unit (every node in the unit's module):
    ``hidden = relu(x @ unshard(up).t())``, with ``dropout`` then ``native_dropout(hidden)``,
    ``x = view(hidden @ unshard(down).t())``; the loss is ``sum(x)`` (outside every unit).
    Backward, from the scalar ``tangents_1``, last unit first: the down weight's gradient (reads
    the unit's ``hidden``, or the dropout's output), the hidden gradient (reads the gathered down
    weight), relu's backward (reads ``hidden``), the up weight's gradient (reads the unit's input,
    the previous unit's output view), the input gradient (reads the gathered up weight; none for
    unit 1, whose input is the batch), each weight gradient handed to ``reduce_grad``. Returns
    ``(loss, *reduced gradients in key order)``.

    Bytes saved for backward per unit (fp32, defaults): ``hidden`` 128 (plus, with dropout, the
    dropout's output 128 and mask 32) and, but for the last unit, its output 32; recomputing unit
    ``i > 1`` saves its input (unit ``i - 1``'s output, 32) instead."""
    hidden_size = 4 * rows
    b = GraphBuilder([[(hidden_size, rows), (rows, hidden_size)]] * units, world_size=world_size, stage=stage)
    x = b.input("x", batch, rows)
    tangent = b.input("tangents_1")
    shards = b.shards(list(b.layouts))
    saved = []
    for unit in range(1, units + 1):
        path = f"u{unit}"
        up_key, down_key = b.keys_of(unit)
        up, down = b.unshard(shards[up_key], up_key), b.unshard(shards[down_key], down_key)

        def op(target, *args, path=path):
            return in_module(b.op(target, *args), path)

        hidden = op(aten.relu.default, op(aten.mm.default, x, op(aten.t.default, up)))
        mask, used = None, hidden
        if dropout:
            both = op(aten.native_dropout.default, hidden, 0.5, True)
            used, mask = op(operator.getitem, both, 0), op(operator.getitem, both, 1)
        out = op(aten.view.default, op(aten.mm.default, used, op(aten.t.default, down)), [batch, rows])
        saved.append((unit, x, hidden, used, mask, up, down))
        x = out
    loss = b.op(aten.sum.default, x)
    g = b.op(aten.expand.default, tangent, [batch, rows])
    grads: dict[int, fx.Node] = {}
    for unit, x_in, hidden, used, mask, up, down in reversed(saved):
        up_key, down_key = b.keys_of(unit)
        grads[down_key] = b.reduce_grad(b.op(aten.mm.default, b.op(aten.t.default, g), used), down_key)
        g_hidden = b.op(aten.mm.default, g, down)
        if mask is not None:
            g_hidden = b.op(aten.native_dropout_backward.default, g_hidden, mask, 2.0)
        g_pre = b.op(aten.threshold_backward.default, g_hidden, hidden, 0)
        grads[up_key] = b.reduce_grad(b.op(aten.mm.default, b.op(aten.t.default, g_pre), x_in), up_key)
        if unit > 1:
            g = b.op(aten.mm.default, g_pre, up)
    return b, b.output(loss, *(grads[k] for k in sorted(grads)))


def gathered_joint(units: int = 3, *, bucketed: bool = True, world_size: int = 2, dropout: bool = False,
                   **knobs) -> tuple[GraphBuilder, fx.GraphModule, PassContext]:
    """``joint_mlp(units)`` after ``bucketing`` (one bucket per unit; without ``bucketed``, one
    gather per parameter) and ``insert_allgather``: a stage-3 joint graph as ``selective_unshard``,
    ``secondary_partition`` and ``activation_partition`` receive it, every gather chain tagged
    ``MUST_RECOMPUTE``. ``knobs``: ``PassContext`` fields."""
    from zerograph.passes.bucketing import bucketing
    from zerograph.passes.insert_allgather import insert_allgather

    b, gm = joint_mlp(units, world_size=world_size, dropout=dropout)
    ctx = b.ctx("joint", **knobs)
    if bucketed:
        bucketing(gm, ctx)
    insert_allgather(gm, ctx)
    return b, gm, ctx


def _op_name(target) -> str:
    """``aten.addmm``, ``_c10d_functional.wait_tensor``, ``zerograph.pack_shards``; a Python
    function by its name (``getitem``)."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def graph_text(gm: fx.GraphModule, *, args: bool = True, note: Callable[[fx.Node], str] | None = None) -> str:
    """The graph as text, one line per node, for expected-graph tests: ``name = op(arguments)``
    (nodes by name, other arguments as ``repr`` gives them), ``input name``, ``return (...)``.
    Without ``args``, ``name = op`` only (the order of ops, which a scheduling pass changes).
    ``note``: text appended to a node's line as ``  # text`` where it returns any (what a pass
    that only tags nodes changes: ``recompute_note``)."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            line = f"input {node.name}"
        elif node.op == "output":
            line = f"return {fx.node.map_arg(node.args[0], lambda n: n.name)}".replace("'", "")
        elif not args:
            line = f"{node.name} = {_op_name(node.target)}"
        else:
            shown = fx.node.map_arg(node.args, lambda n: _Name(n.name))
            kwargs = "".join(f", {k}={v!r}" for k, v in fx.node.map_arg(node.kwargs, lambda n: _Name(n.name)).items())
            line = f"{node.name} = {_op_name(node.target)}({', '.join(map(repr, shown))}{kwargs})"
        text = note(node) if note is not None else ""
        lines.append(f"{line}  # {text}" if text else line)
    return "\n".join(lines)


def recompute_note(node: fx.Node) -> str:
    """A node's checkpoint policy as ``graph_text`` notes it (``must recompute``, ``must save``,
    ...), with ``kept`` for a gather ``selective_unshard`` kept; empty when untagged."""
    policy = node.meta.get("recompute")
    words = [policy.name.lower().replace("_", " ")] if policy else []
    if node.meta.get(TAG, {}).get("kept"):
        words.append("kept")
    return ", ".join(words)


def run_pass(pass_fn: Callable, graphs, ctx: PassContext):
    """``pass_fn`` run as the pass manager runs each pass (``run_checked`` on lazily recompiled
    modules: the graph linted and every collective checked waited after it); its ``PassResult``.
    The modules' code is read before the pass (as a dump does), so a pass that changes a graph
    without ``gm.recompile()`` (its code then stale) fails here."""
    graphs = lazily_recompiled(graphs)
    for gm in graph_modules(graphs):
        gm.code  # generated now, as the dump of the input graph generates it
    result = run_checked(pass_fn, graphs, ctx)
    if result.modified:
        for gm in graph_modules(result.graph_module):
            assert gm.code == gm.graph.python_code("self").src, f"{pass_fn.__name__} changed the graph without recompile()"
    return result


class _Name(str):
    """A node's name, shown bare in ``graph_text`` (``repr`` without quotes)."""

    def __repr__(self) -> str:
        return str(self)
