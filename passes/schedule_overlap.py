"""Place every collective's wait as late as its consumers and the memory bound allow.

Pre: a forward, backward or inference graph with tagged collectives (``find_collectives``).
Post: the same nodes, reordered; every start still precedes its wait, every wait its uses.
- All-gathers: the wait and copy-out sink to just before the first op that reads a gathered
  parameter. A copy-out that allocates (``unpack_gathered``) sinks no further than the copy-in of
  the next gather ``prefetch`` placed after it, so at most ``prefetch_depth + 1`` units are held at
  once; a copy-out of views only sinks to the first use.
- Reductions (reduce-scatter / all-reduce): issued where ``insert_reduce_scatter`` put them; the
  wait, the division by N and the copy-out sink toward the end of backward, with at most
  ``max(1, prefetch_depth)`` reductions in flight, fewer when their bytes would exceed
  ``max_inflight_bytes`` (depth 1: reduction ``j`` runs during the next bucket's backward and is
  waited before ``j + 1`` is issued, as FSDP2 does).
- Two-level reductions (hybrid sharding: reduce-scatter, then an all-reduce across replicas): the
  reduce-scatter is bounded as above, its wait and the all-reduce's start sink together to that
  bound; the all-reduce's wait sinks to its first use, at most to the next bucket's bound.
A wait stays right after its start only where nothing independent exists between them. Why each
bound: docs/design.md, section "Scheduling and buffers".

Source: PyTorch Inductor's ``reorder_compute_and_comm_for_overlap`` (``torch/_inductor/comms.py``);
SimpleFSDP (arXiv 2411.00284) section 4.2; FSDP2's reduce-scatter left in flight during the
next unit's backward.
"""
from __future__ import annotations

import torch.fx as fx

from ._fx import Collective, NodeOrder, find_collectives, sink_to_first_use
from .context import PassContext, PassResult
from .contract import contract
from .prefetch import copy_out_end


def gather_limits(gathers: list[Collective], order: NodeOrder) -> list[fx.Node | None]:
    """For each gather, the node its wait and copy-out must precede (``None``: no bound): the
    first copy-in node of the gathers that start after its wait, when its copy-out allocates."""
    limits: list[fx.Node | None] = []
    for gather in gathers:
        if copy_out_end(gather) is gather.wait:  # views only: the gathered buffer is the parameters
            limits.append(None)
            continue
        later = [node for c in gathers if order[c.start] > order[gather.wait] for node in c.issue]
        limits.append(min(later, key=order.__getitem__, default=None))
    return limits


def reduction_limits(reductions: list[Collective], ctx: PassContext) -> list[fx.Node | None]:
    """For each reduction in issue order, the node its wait must precede (``None``: no bound)."""
    limits: list[fx.Node | None] = []
    for j in range(len(reductions)):
        limit = None
        for m in range(j + 1, len(reductions)):
            inflight = reductions[j : m + 1]
            too_many = len(inflight) > max(1, ctx.schedule.prefetch_depth)
            cap = ctx.schedule.max_inflight_bytes
            too_big = cap is not None and sum(r.full_bytes for r in inflight) > cap
            if too_many or too_big:
                limit = reductions[m].issue[0]
                break
        limits.append(limit)
    return limits


@contract(requires=("gathers",))
def schedule_overlap(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    collectives = find_collectives(graph)
    if not collectives:
        return PassResult(gm, False)
    before = [n.name for n in graph.nodes]
    order = NodeOrder(graph)  # one numbering, kept current through every sink
    gathers = [c for c in collectives if c.role == "gather"]
    for gather, limit in zip(gathers, gather_limits(gathers, order)):  # limits read before any sink
        sink_to_first_use(gather.finish, limit, order=order)
    reductions = sorted((c for c in collectives if c.role == "reduce"), key=lambda c: order[c.start])
    # a reduction whose copy-in holds another's start is that one's second level (hybrid sharding)
    starts = {c.start: c for c in reductions}
    second = {id(starts[node]): c for c in reductions for node in c.issue if node in starts and starts[node] is not c}
    seconds = {id(c) for c in second.values()}
    reductions = [c for c in reductions if id(c) not in seconds]
    limits = reduction_limits(reductions, ctx)
    for j, (reduction, limit) in enumerate(zip(reductions, limits)):
        follow = second.get(id(reduction))
        if follow is None:
            sink_to_first_use(reduction.finish, limit, order=order)
            continue
        sink_to_first_use(follow.finish, limits[j + 1] if j + 1 < len(limits) else None, order=order)
        follow_finish = set(follow.finish)
        first_level = [n for n in reduction.finish if n not in follow_finish]  # its wait .. the next start
        sink_to_first_use(first_level, limit, order=order)
    changed = [n.name for n in graph.nodes] != before
    if changed:
        gm.recompile()
    return PassResult(gm, changed, {"collectives": len(collectives)})
