"""Small FX helpers shared by the passes: splice a traced function in, find aliases, tag nodes."""
from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from zerograph.graph.ops import REDUCE_GRAD
from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG, WAIT, full_buffer


def group_markers(markers: Sequence[fx.Node], ctx: Any) -> list[list[fx.Node]]:
    """Markers grouped into one collective each: by (bucket, dtype, sharded), in the order the
    groups first appear. A marker without a ``bucketing`` decision is a bucket of its own key.
    The dtype is the one the collective moves: ``param_dtype`` for an all-gather (``unshard``),
    ``reduce_dtype`` for a reduction (``reduce_grad``); copy-in and copy-out cast to and from it."""
    groups: dict[tuple[Any, torch.dtype, bool], list[fx.Node]] = {}
    for node in markers:
        layout = ctx.layouts[node.args[1]]
        moved = layout.reduce_dtype if node.target is REDUCE_GRAD else layout.param_dtype
        bucket = node.meta.get(TAG, {}).get("bucket", ("param", node.args[1]))
        groups.setdefault((bucket, moved, layout.sharded), []).append(node)
    return list(groups.values())


def layout_template(layouts: Sequence[Any]) -> tuple:
    """The part of ``layouts`` (``ParamLayout``) a copy-in / copy-out depends on: all but the
    parameter's identity (key, name, unit), so identical blocks share a ``splice`` template."""
    return tuple(dataclasses.replace(layout, key=0, fqn="", unit=0) for layout in layouts)


def bucket_tag(role: str, layouts: Sequence[Any]) -> dict[str, Any]:
    """The tag of a collective's nodes: its role, first unit and every unit it moves."""
    units = list(dict.fromkeys(layout.unit for layout in layouts))
    return {"role": role, "unit": units[0], "units": units}


TEMPLATE_LIMIT = 512  # traced replacements kept per fake mode (a model has a few distinct shapes per pass)
# Kept on the fake mode itself (one per compile: its joint, forward and backward graphs share it):
# the templates' fake values point at their mode, so a table keyed by mode would keep every mode alive.
_TEMPLATES_ATTR = "_zerograph_splice_templates"


def splice(graph: fx.Graph, fn: Callable[..., Any], args: Sequence[fx.Node], *, before: fx.Node,
           tag: dict[str, Any] | None = None, template: Hashable | None = None) -> Any:
    """Trace ``fn`` on the fake values of ``args`` and insert its ops before ``before``.

    Replacement code is written as an ordinary tensor function and traced to aten ops (Inductor's
    fx_passes do the same), so every inserted node carries ``meta["val"]`` for the partitioner and
    later passes. Returns ``fn``'s output structure with the new nodes in place of tensors.

    ``template``: a hashable naming everything ``fn`` computes from besides its arguments (the
    layouts' shapes and dtypes, the world size, the group), or ``None``. With one, the traced
    graph is kept per (fake mode, template, the arguments' shapes, strides and dtypes) and a later
    splice of the same key copies it instead of tracing again, so identical blocks cost one trace,
    not one each. The copies share the template's fake values (read-only metadata of the one
    fake mode they belong to). ``fn`` must not depend on anything the key leaves out, e.g. a
    marker key baked into an op's arguments. Another compile in the process (another fake mode)
    with the same key re-runs the kept graph's ops on its own fake values instead of tracing
    ``fn`` (``_retraced``: the ops, without ``make_fx``'s set-up).
    """
    vals = [a.meta["val"] for a in args]
    fake_mode = detect_fake_mode(vals)
    assert fake_mode is not None, "graph nodes carry no fake values"
    signature = _input_signature(vals)
    cache_key = (template, signature) if template is not None and signature is not None else None
    cache: dict[Hashable, fx.Graph] = fake_mode.__dict__.setdefault(_TEMPLATES_ATTR, {})
    traced = cache.get(cache_key) if cache_key is not None else None
    if traced is None:
        recipe = _RECIPES.get(cache_key) if cache_key is not None else None
        if recipe is not None:
            _RECIPES.move_to_end(cache_key)
            traced = _retraced(recipe, vals, fake_mode)
        else:
            with fake_mode:
                traced = make_fx(fn, pre_dispatch=False)(*_distinct(vals)).graph
            if cache_key is not None:
                _RECIPES[cache_key] = _without_values(traced)
                if len(_RECIPES) > TEMPLATE_LIMIT:
                    _RECIPES.popitem(last=False)
        if cache_key is not None and len(cache) < TEMPLATE_LIMIT:
            cache[cache_key] = traced
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in traced.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args))
    result: Any = None
    with graph.inserting_before(before):
        for node in traced.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = pytree.tree_map(lambda x: env[x] if isinstance(x, fx.Node) else x, node.args[0])
                break
            assert node.op == "call_function", f"traced replacement produced a {node.op} node"
            new = graph.node_copy(node, lambda n: env[n])
            if tag is not None:
                new.meta[TAG] = dict(tag)
            env[node] = new
    return result


def _distinct(vals: list[Any]) -> list[Any]:
    """``vals`` with each tensor passed again replaced by a fresh fake tensor of its metadata.
    ``make_fx`` binds a tensor to the last placeholder it came in as, so one object passed twice
    (the nodes of one template's copies share their fake values) would trace both arguments as one
    input: a bucket of two summed gradients reduced the first sum twice, and the cached graph did
    so for every later bucket of its key."""
    seen: set[int] = set()
    out = []
    for val in vals:
        if isinstance(val, torch.Tensor) and id(val) in seen:
            val = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        seen.add(id(val))
        out.append(val)
    return out


# The traced graphs of every splice template, without their fake values (which would keep their
# compile's fake mode alive), for the compiles after the first in a process: least recently used last out.
_RECIPES: collections.OrderedDict[Hashable, fx.Graph] = collections.OrderedDict()
_VALUE_META = ("val", "tensor_meta", "eager_input_vals")


def _without_values(traced: fx.Graph) -> fx.Graph:
    recipe = fx.Graph()
    recipe.output(recipe.graph_copy(traced, {}))
    for node in recipe.nodes:
        for key in _VALUE_META:
            node.meta.pop(key, None)
    return recipe


def _retraced(recipe: fx.Graph, vals: Sequence[Any], fake_mode: Any) -> fx.Graph:
    """``recipe`` with fake values of ``fake_mode``: its placeholders take ``vals`` and each op
    is run on its inputs' values, as ``make_fx`` ran it (below autograd, so without grad)."""
    traced = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    traced.output(traced.graph_copy(recipe, env))
    placeholders = [n for n in traced.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(vals), (len(placeholders), len(vals))
    for node, val in zip(placeholders, vals):
        node.meta["val"] = val
    with fake_mode, torch.no_grad():
        for node in traced.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            node.meta["val"] = node.target(*args, **kwargs)
            if isinstance(node.meta["val"], torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])
    return traced


def _input_signature(vals: Sequence[Any]) -> tuple | None:
    """What a trace of a function of ``vals`` can depend on in them: each tensor's shape, stride,
    storage offset, dtype and device; ``None`` (not cacheable) when a size is symbolic."""
    signature = []
    for val in vals:
        if not isinstance(val, torch.Tensor):
            return None
        sizes = (*val.shape, *val.stride(), val.storage_offset())
        if not all(isinstance(s, int) for s in sizes):
            return None
        signature.append((sizes, val.dim(), val.dtype, val.device, val.requires_grad))
    return tuple(signature)


def is_alias_of_input(node: fx.Node) -> bool:
    """True when ``node``'s output shares storage with its first tensor input (a view op, or a
    ``getitem`` of a view op with several outputs: ``split``, ``unbind``)."""
    target = node.target
    if node.op == "call_function" and target is operator.getitem and isinstance(node.args[0], fx.Node):
        return is_alias_of_input(node.args[0])
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


class NodeOrder:
    """Positions of a graph's nodes that stay valid while a pass moves and inserts nodes:
    ``order[a] < order[b]`` exactly when ``a`` comes before ``b``.

    A pass that moves nodes and then compares positions again would otherwise recompute
    ``position(graph)`` after each move, O(n) each time and O(n^2) in all. Here a moved node
    takes the midpoint of its new neighbours' positions (``moved``, O(1)), a node the order has
    not seen (inserted since) is placed between its nearest known neighbours when first read,
    and the graph is renumbered (O(n)) only when floats leave no room between two neighbours.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._pos: dict[fx.Node, float] = {}
        self.renumber()

    def renumber(self) -> None:
        self._pos = {node: float(i) for i, node in enumerate(self.graph.nodes)}

    def __getitem__(self, node: fx.Node) -> float:
        pos = self._pos.get(node)
        if pos is None:
            self.moved(node)
            pos = self._pos[node]
        return pos

    def moved(self, node: fx.Node) -> None:
        """Record that ``node`` now sits where it is in the graph (after a move or an insert)."""
        self._pos.pop(node, None)
        run = [node]  # node and the unknown nodes around it, placed evenly between known ones
        before = node.prev
        while before.op != "root" and before not in self._pos:
            run.insert(0, before)
            before = before.prev
        after = node.next
        while after.op != "root" and after not in self._pos:
            run.append(after)
            after = after.next
        low = self._pos[before] if before.op != "root" else -1.0
        high = self._pos[after] if after.op != "root" else low + len(run) + 1.0
        step = (high - low) / (len(run) + 1)
        if not low < low + step < high - step * 0.5:  # no room left between the neighbours
            self.renumber()
            return
        for i, n in enumerate(run, start=1):
            self._pos[n] = low + step * i


def hoist_before(node: fx.Node, point: fx.Node, order: NodeOrder) -> None:
    """Move ``node`` (and, recursively, its inputs) before ``point`` if it sits after it."""
    if order[node] < order[point] or node.op == "placeholder":
        return
    for inp in node.all_input_nodes:
        hoist_before(inp, point, order)
    point.prepend(node)
    order.moved(node)


def count_targets(graph: fx.Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            name = str(node.target)
            counts[name] = counts.get(name, 0) + 1
    return counts


def sink_below_inputs(graph: fx.Graph) -> None:
    """Move each node that sits above one of its inputs to just below it; all else keeps its order.

    The mirror image of Inductor's ``stable_topological_sort`` (which lifts inputs up to their
    users): a pass that defines a value later than its old uses wants the uses to move down, so the
    new definition stays where the pass put it.
    """
    placed: set[fx.Node] = set()
    waiting: list[fx.Node] = []
    for node in list(graph.nodes):
        if not all(inp in placed for inp in node.all_input_nodes):
            assert node.op != "output", "sink_below_inputs: a value is never defined"
            waiting.append(node)
            continue
        placed.add(node)
        cursor, progress = node, True
        while progress and waiting:
            progress = False
            for pending in list(waiting):
                if all(inp in placed for inp in pending.all_input_nodes):
                    if cursor.op == "output":
                        cursor.prepend(pending)
                    else:
                        cursor.append(pending)
                        cursor = pending
                    placed.add(pending)
                    waiting.remove(pending)
                    progress = True


@dataclasses.dataclass
class Collective:
    """One inserted collective and the nodes that travel with it when it is rescheduled.

    ``issue``: the copy-in nodes feeding only this collective, then the collective itself (the
    "start"); ``finish``: its ``wait_tensor``, then the copy-out nodes that read the result.
    ``full_bytes``: bytes of the full (unsharded) buffer it moves.
    """

    kind: str
    role: str
    units: list[int]
    issue: list[fx.Node]
    finish: list[fx.Node]
    full_bytes: int

    @property
    def start(self) -> fx.Node:
        return self.issue[-1]

    @property
    def wait(self) -> fx.Node:
        return self.finish[0]


def find_collectives(graph: fx.Graph) -> list[Collective]:
    """Every tagged collective of the graph, in graph order of its start."""
    order = position(graph)
    found = []
    for node in graph.nodes:
        kind = COLLECTIVE_KINDS.get(node.target)
        tag = node.meta.get(TAG)
        if kind is None or tag is None:
            continue
        (wait,) = node.users
        issue = _tagged_ancestors(node, tag["role"])
        finish = _tagged_descendants(wait, tag["role"])
        val = full_buffer(node)
        found.append(Collective(kind, tag["role"], list(tag.get("units", [tag["unit"]])),
                                sorted(issue, key=order.__getitem__), sorted(finish, key=order.__getitem__),
                                val.numel() * val.element_size()))
    return found


def _tagged_ancestors(start: fx.Node, role: str) -> set[fx.Node]:
    """``start`` and the tagged nodes of ``role`` whose every use leads only into it (its copy-in),
    including an op that writes a chain member in place (``buffer_reuse``'s ``pack_shards_out``
    into a pooled buffer: an ``out=`` argument, no result)."""
    chain = {start}
    stack = list(start.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in chain or node.op != "call_function" or node.meta.get(TAG, {}).get("role") != role:
            continue
        writers = [u for u in node.users if u.kwargs.get("out") is node and not u.users
                   and u.meta.get(TAG, {}).get("role") == role]
        if not all(user in chain or user in writers for user in node.users):
            continue
        chain.add(node)
        chain.update(writers)
        stack.extend(node.all_input_nodes)
        stack.extend(inp for writer in writers for inp in writer.all_input_nodes)
    return chain


def _tagged_descendants(wait: fx.Node, role: str) -> set[fx.Node]:
    """``wait`` and the nodes computed only from it that are its copy-out: tagged nodes of
    ``role``, and views of them (a view costs nothing, and moving it keeps the chain whole)."""
    chain = {wait}
    stack = list(wait.users)
    while stack:
        node = stack.pop()
        if (node in chain or node.op != "call_function"
                or not (node.meta.get(TAG, {}).get("role") == role or is_alias_of_input(node))
                or not all(inp in chain for inp in node.all_input_nodes)):
            continue
        chain.add(node)
        stack.extend(node.users)
    return chain


def move_before(nodes: Sequence[fx.Node], point: fx.Node, order: NodeOrder | None = None) -> None:
    """Move ``nodes`` (in their given order) to just before ``point``, keeping ``order`` current."""
    for node in nodes:
        if node is not point:
            point.prepend(node)
            if order is not None:
                order.moved(node)


def sink_to_first_use(nodes: Sequence[fx.Node], limit: fx.Node | None = None, order: NodeOrder | None = None) -> None:
    """Move each of ``nodes`` down to just before its earliest user (or ``limit``, whichever is
    first), last node first, so that a chain stays in dependency order. ``order``: the graph's
    ``NodeOrder`` when the caller sinks many chains (built here otherwise)."""
    nodes = list(nodes)
    if not nodes:
        return
    order = order or NodeOrder(nodes[0].graph)
    for node in reversed(nodes):
        candidates = list(node.users) + ([limit] if limit is not None else [])
        first = min(candidates, key=order.__getitem__)
        if order[first] > order[node] and first.prev is not node:  # only ever down
            first.prepend(node)
            order.moved(node)


def saved_tensor_inputs(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The backward inputs of a partitioned pair that are saved tensors, in order. AOTAutograd's
    convention (the min-cut partitioner's): the forward returns its ``num_fwd_outputs`` outputs, then
    the saved tensors, then the saved symbols; the backward takes the saved symbols, then the saved
    tensors, then the tangents."""
    outputs = fwd.graph.output_node().args[0]
    n_saved_symbols = sum(1 for v in outputs[num_fwd_outputs:] if is_symbol(v))
    return [n for n in bwd.graph.nodes if n.op == "placeholder"][n_saved_symbols:]


def save_for_backward(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int,
                      values: Sequence[fx.Node]) -> list[fx.Node]:
    """Hand forward nodes ``values`` over to the backward of a partitioned pair, as the first saved
    tensors (``saved_tensor_inputs``' convention): new forward outputs, and new backward inputs,
    returned in the order of ``values``. The pair must have a tangent or a saved tensor already
    (a backward input to insert before)."""
    first_saved = saved_tensor_inputs(fwd, bwd, num_fwd_outputs)[0]  # a saved tensor or a tangent
    fwd_out = fwd.graph.output_node()
    outputs = list(fwd_out.args[0])
    fwd_out.args = (outputs[:num_fwd_outputs] + list(values) + outputs[num_fwd_outputs:],)
    inputs = []
    with bwd.graph.inserting_before(first_saved):
        for value in values:
            placeholder = bwd.graph.placeholder(f"{value.name}_saved")
            placeholder.meta["val"] = value.meta["val"]
            inputs.append(placeholder)
    return inputs


def is_symbol(value: Any) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.SymInt | torch.SymFloat | torch.SymBool)


def readable_result(node: fx.Node) -> fx.Node:
    """Where ``node``'s value can be read: ``node`` itself, or, for a collective (an all-gather
    whose output buffer is the gathered storage, with no copy-out after it), its ``wait_tensor``."""
    if node.target in COLLECTIVE_KINDS:
        return next(u for u in node.users if u.target is WAIT)
    return node
