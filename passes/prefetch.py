"""Start each all-gather ``prefetch_depth`` buckets ahead of its use.

Pre: a forward, backward or inference graph whose all-gathers were inserted by
``insert_allgather`` (start and wait adjacent, or wherever the partitioner put them).
Post: the same nodes, reordered. With the gathers numbered 0, 1, ... in the order their results
are first needed, gather ``i``'s copy-in and start sit right after gather ``i - d``'s wait and
copy-out (so that copy-out's input buffer is free before gather ``i``'s output is taken), i.e.
before any compute of the bucket ``d`` places earlier, where ``d = prefetch_depth`` unless the
gathered bytes of gathers ``i - d .. i`` would exceed ``max_inflight_bytes`` (then ``d`` shrinks,
down to 0 = no prefetch). The first ``d`` gathers (nothing earlier to hide behind) start as soon as
their shards exist, at the top of the graph. Waits and copy-outs stay where they are (``schedule_overlap`` sinks them to their
first use), so at most ``d + 1`` buckets' gathered parameters are in flight or in use at once.
In backward the same rule prefetches in reverse unit order (the order backward needs them).

Invariant beyond the graph: every rank issues its collectives in the same order. Copy-in chains
differ between ranks (a rank with fewer rows pads), so a start is only ever placed relative to
other collectives (after a wait, never above an earlier start), not relative to other nodes.

Source: FSDP's forward/backward prefetch (``set_modules_to_forward_prefetch``); DeepSpeed ZeRO-3's
prefetch bucket; DeepCompile (arXiv 2504.09983) section 4.2, prefetching.
"""
from __future__ import annotations

import logging

import torch.fx as fx

from zerograph.graph.vocab import COLLECTIVE_KINDS, TAG

from ._fx import Collective, NodeOrder, find_collectives, hoist_before, is_alias_of_input, move_before
from .context import PassContext, PassResult
from .contract import contract

log = logging.getLogger(__name__)


def prefetch_distance(gathers: list[Collective], i: int, depth: int, max_inflight_bytes: int | None) -> int:
    """How many gathers ahead gather ``i`` may start, within the depth and the byte budget."""
    for d in range(min(depth, i), 0, -1):
        inflight = sum(g.full_bytes for g in gathers[i - d : i + 1])
        if max_inflight_bytes is None or inflight <= max_inflight_bytes:
            return d
    return 0


def within_budget(gathers: list[Collective], max_inflight_bytes: int | None) -> bool:
    return max_inflight_bytes is None or sum(g.full_bytes for g in gathers) <= max_inflight_bytes


def after_previous_start(gather: Collective, graph: fx.Graph) -> fx.Node:
    """The node after the last collective start that precedes ``gather``'s (or the graph top)."""
    previous = None
    for node in graph.nodes:
        if node is gather.start:
            break
        if node.target in COLLECTIVE_KINDS:
            previous = node
    return previous.next if previous is not None else next(n for n in graph.nodes if n.op != "placeholder")


def copy_out_end(gather: Collective) -> fx.Node:
    """The last node that copies out of a gather's output (e.g. ``unpack_gathered``), or its wait
    when the copy-out is views only: views keep the output alive anyway, and they may sit far
    down at the parameters' uses."""
    copies = [n for n in gather.finish if n is gather.wait or (TAG in n.meta and not is_alias_of_input(n))]
    return copies[-1]


def outside_inputs(issue: list[fx.Node]) -> list[fx.Node]:
    chain = set(issue)
    return [inp for node in issue for inp in node.all_input_nodes if inp not in chain]


def is_free_view(node: fx.Node) -> bool:
    """A view of a graph input (e.g. a shard's reshape): free to compute anywhere above."""
    while is_alias_of_input(node):
        node = node.all_input_nodes[0]
    return node.op == "placeholder"


def earliest_point(issue: list[fx.Node], graph: fx.Graph, order: NodeOrder) -> fx.Node:
    """The node right after the last input the copy-in chain reads from outside itself, not
    counting views of graph inputs (they move up with the chain)."""
    fixed = [inp for inp in outside_inputs(issue) if inp.op != "placeholder" and not is_free_view(inp)]
    last = max(fixed, key=order.__getitem__, default=None)
    if last is None:
        return next(n for n in graph.nodes if n.op != "placeholder")
    return last.next


@contract(requires=("gathers",))
def prefetch(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    order = NodeOrder(graph)  # kept current through the moves: one O(n) numbering for the pass
    gathers = sorted((c for c in find_collectives(graph) if c.role == "gather"),
                     key=lambda c: order[c.wait])
    moved = 0
    for i, gather in enumerate(gathers):
        earliest = earliest_point(gather.issue, graph, order)
        if i < ctx.schedule.prefetch_depth and within_budget(gathers[: i + 1], ctx.schedule.max_inflight_bytes):
            # nothing earlier to overlap with but what precedes the first use; hoist, but never
            # above a collective issued before it: copy-ins differ by rank (padding), so only
            # collectives may order collectives, or ranks could issue them in different orders
            point = max(earliest, after_previous_start(gather, graph), key=order.__getitem__)
        else:
            d = prefetch_distance(gathers, i, ctx.schedule.prefetch_depth, ctx.schedule.max_inflight_bytes)
            if d < min(ctx.schedule.prefetch_depth, i):
                log.debug("%s graph: gather %d (units %s) starts %d ahead instead of %d: %d bytes in flight "
                          "would exceed max_inflight_bytes=%d", ctx.graph_kind, i, gather.units, d,
                          min(ctx.schedule.prefetch_depth, i),
                          sum(g.full_bytes for g in gathers[i - d - 1: i + 1]), ctx.schedule.max_inflight_bytes)
            point = copy_out_end(gathers[i - d]).next if d else gather.wait
        if order[earliest] > order[point]:  # a shard is made late (never for placeholders)
            log.debug("%s graph: gather %d (units %s) cannot start before %s, which its copy-in reads",
                      ctx.graph_kind, i, gather.units, earliest.name)
            point = earliest
        inputs = dict.fromkeys(outside_inputs(gather.issue))  # ordered: the same hoists on every rank and run
        while point in inputs:  # landed on a view the chain reads: go below it
            point = point.next
        if point in gather.issue:  # already there
            continue
        if order[point] < order[gather.start]:
            moved += 1
        for view in (inp for inp in inputs if inp.op != "placeholder"):
            hoist_before(view, point, order)  # only free views can sit below ``point``
        move_before(gather.issue, point, order)
    if moved:
        gm.recompile()
    return PassResult(gm, bool(moved), {"prefetched": moved, "gathers": len(gathers)})
