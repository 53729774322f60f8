"""Give every comm buffer a slot of a fixed pool, reused every step, by interval-graph colouring.

Pre: a forward, backward or inference graph after the schedule passes (``prefetch``,
``schedule_overlap``): the order, hence every buffer's lifetime, is final.
Post: each *pooled* comm buffer comes from ``zerograph::pool_buffer(pool, role, slot, numel,
dtype, device)`` instead of a fresh allocation:
- an all-gather's output: ``all_gather_into_tensor`` becomes ``all_gather_into_tensor_out(...,
  out=pool_buffer(...))``; it lives from the start to the last use of the gathered parameters (or
  of the copy-out that reads it);
- a packed send buffer (``zerograph::pack_shards``): ``buf = pool_buffer(...)``, then
  ``pack_shards_out(..., out=buf)`` writes it and the collective reads ``buf``; it lives to the
  wait of that collective.
A buffer is pooled only if it dies inside the graph (never one saved for backward or returned)
and belongs to no collective of the root unit. Two buffers share a slot only if they have the same
role (gathered parameters, or send buffers) and their lifetimes (graph positions, inclusive) do not
intersect; greedy colouring in order of start makes the slots number exactly the most buffers of a
role alive at once, each slot the size of the largest buffer it serves (allocated once by the
runtime's ``BufferPool``). The graph's order and every value computed stay the same. Does nothing
without ``ctx.buffer_pool`` or without communication. Why the root is left out, and what the tests
check: docs/design.md, section "Scheduling and buffers"; docs/memory.md, "The comm buffer pool".

Source: ZeRO-R (arXiv 1910.02054) sections 6.2 (constant-size buffers, C_B) and 6.3 (memory
defragmentation, M_D); register allocation by interval-graph colouring (the left-edge algorithm).
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch
import torch.fx as fx

from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG
from zerograph.kernels.ops import PACK_SHARDS
from zerograph.runtime.buffer_pool import PACK_SHARDS_OUT, POOL_BUFFER
from zerograph.shard.sharding import ROOT_INDEX

from ._fx import position
from .context import PassContext, PassResult
from .contract import contract
from .liveness import storage_root

funcol = torch.ops._c10d_functional
ALL_GATHER = funcol.all_gather_into_tensor.default
ALL_GATHER_OUT = funcol.all_gather_into_tensor_out.default


@dataclasses.dataclass(frozen=True)
class PooledBuffer:
    """One comm buffer and its lifetime (graph positions, inclusive), as planned."""

    node: str  # the node that allocates it today (an all-gather or a pack_shards)
    role: str  # what it holds: "gathered" (an all-gather's output) or "send" (a packed send buffer)
    nbytes: int
    first: int
    last: int
    slot: int = -1


def lifetime(node: fx.Node, aliases: list[fx.Node], order: dict[fx.Node, int]) -> int | None:
    """The last position at which ``node``'s buffer (read through ``aliases``: views, waits, out=
    results) is read, or ``None`` if it escapes the graph. A collective keeps its input until its
    wait, so a read by a collective counts at the wait."""
    last = order[node]
    for alias in aliases:
        for user in alias.users:
            if user.op == "output":
                return None
            last = max(last, order[user])
            if user.target in COLLECTIVE_KINDS:
                last = max(last, *(order[w] for w in user.users))
    return last


def _nbytes(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(val.numel(), int):
        return None  # a symbolic size: not a fixed-size slot
    return val.numel() * val.element_size()


def plan_buffers(graph: fx.Graph) -> list[PooledBuffer]:
    """The comm buffers to pool with their slots (plain data; the rewrite applies it).

    Slots, per role: greedy colouring of the interval graph of lifetimes, visiting buffers by
    start, which for an interval graph uses exactly as many colours as the most buffers alive at
    once (``assign_slots``)."""
    order = position(graph)
    aliases: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        aliases.setdefault(storage_root(node), []).append(node)
    found: list[PooledBuffer] = []
    for node in graph.nodes:
        if TAG not in node.meta or node.target not in (ALL_GATHER, PACK_SHARDS):
            continue
        tag = node.meta[TAG]
        if ROOT_INDEX in tag.get("units", [tag.get("unit")]):
            continue  # see the module doc: the root unit's buffers stay transient
        nbytes, last = _nbytes(node), lifetime(node, aliases[node], order)
        if nbytes is None or last is None:
            continue
        role = "gathered" if node.target is ALL_GATHER else "send"
        found.append(PooledBuffer(node.name, role, nbytes, order[node], last))
    return assign_slots(found)


def assign_slots(found: list[PooledBuffer]) -> list[PooledBuffer]:
    """``found`` with slots: buffers of one role whose lifetimes intersect get different slots."""
    overlaps = nx.Graph()
    overlaps.add_nodes_from(range(len(found)))
    overlaps.add_edges_from((i, j) for i, a in enumerate(found) for j, b in enumerate(found[i + 1:], i + 1)
                            if a.role == b.role and a.first <= b.last and b.first <= a.last)
    by_start = sorted(range(len(found)), key=lambda i: (found[i].first, i))
    colour = nx.greedy_color(overlaps, strategy=lambda graph, colours: by_start)
    return [dataclasses.replace(b, slot=colour[i]) for i, b in enumerate(found)]


def slot_bytes(plan: list[PooledBuffer]) -> dict[tuple[str, int], int]:
    """``(role, slot) -> bytes``: each slot sized for the largest buffer it serves."""
    sizes: dict[tuple[str, int], int] = {}
    for b in plan:
        sizes[b.role, b.slot] = max(sizes.get((b.role, b.slot), 0), b.nbytes)
    return sizes


@contract(requires=("gathers",))
def buffer_reuse(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.buffer_pool is None or not ctx.communicates:
        return PassResult(gm, False)
    graph = gm.graph
    plan = plan_buffers(graph)
    nodes = {n.name: n for n in graph.nodes}
    for b in plan:
        node = nodes[b.node]
        val = node.meta["val"]
        with graph.inserting_before(node):
            buf = graph.call_function(POOL_BUFFER, (ctx.buffer_pool, b.role, b.slot, val.numel(), val.dtype,
                                                    val.device))
            if node.target is ALL_GATHER:
                new = graph.call_function(ALL_GATHER_OUT, node.args, {"out": buf})
                new.meta.update(node.meta)
            else:  # the pack writes into the buffer, the collective reads the buffer
                packed = graph.call_function(PACK_SHARDS_OUT, node.args[:3], {"out": buf})
                packed.meta.update({k: v for k, v in node.meta.items() if k != "val"}, val=None)
                new = buf
        buf.meta.update(val=val, **{TAG: dict(node.meta[TAG], pooled_slot=b.slot)})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    if plan:
        gm.recompile()
    sizes = slot_bytes(plan)
    return PassResult(gm, bool(plan), {"pooled": len(plan), "slots": len(sizes), "slot_bytes": sum(sizes.values())})
