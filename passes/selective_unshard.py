"""Stage 3: keep some buckets' gathered parameters from forward to backward instead of re-gathering.

Pre: a stage-3 joint graph after ``insert_allgather`` (every gather chain and every view of a
gathered parameter tagged ``MUST_RECOMPUTE``).
Post: for the chosen gathers, the recompute tags are replaced by ``MUST_SAVE`` on the gathered
parameters, so the partitioner saves them for backward and backward runs no all-gather for them;
their nodes carry ``meta["zerograph"]["kept"] = True`` (the stage-3 check then allows them to be
saved). All other gathers are untouched. The choice: with ``ctx.memory.reshard_root_after_forward``
off, every gather of the root unit alone (FSDP2 never reshards its root after forward; a root
fused into a bucket with other units is not singled out); then gathers in increasing order of
bytes, while their total stays within ``ctx.memory.unshard_budget_bytes`` (full bytes). Smallest first is the order
of highest gather time per byte under any alpha-beta cost (``t / b = alpha / b + beta`` falls
with ``b``), so the choice needs no calibration: small units are the most latency-bound to
re-gather and the cheapest to keep.

Source: DeepCompile (arXiv 2504.09983) section 4.3, selective unsharding; FSDP's
``reshard_after_forward=False`` per unit.
"""
from __future__ import annotations

import logging

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zerograph.graph.vocab import TAG
from zerograph.shard.sharding import ROOT_INDEX

from ._fx import find_collectives, is_alias_of_input
from .context import PassContext, PassResult
from .contract import contract

log = logging.getLogger(__name__)


def choose_kept(sizes: list[int], budget: int) -> list[int]:
    """Indices of the gathers to keep: smallest first while the kept bytes fit ``budget``."""
    kept, used = [], 0
    for i in sorted(range(len(sizes)), key=lambda i: (sizes[i], i)):
        if used + sizes[i] > budget:
            break
        kept.append(i)
        used += sizes[i]
    return sorted(kept)


@contract(requires=("gathers",))
def selective_unshard(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    nothing_kept = ctx.memory.reshard_root_after_forward and not ctx.memory.unshard_budget_bytes
    if ctx.stage != 3 or ctx.graph_kind != "joint" or nothing_kept:
        return PassResult(gm, False)
    gathers = [c for c in find_collectives(gm.graph) if c.role == "gather"]
    root = set() if ctx.memory.reshard_root_after_forward else {i for i, g in enumerate(gathers) if g.units == [ROOT_INDEX]}
    if not ctx.memory.reshard_root_after_forward and not root and any(ROOT_INDEX in g.units for g in gathers):
        log.warning("reshard_root_after_forward=False has no effect: the root unit's all-gather is fused with "
                    "other units' (bucket_bytes=%d); backward gathers it again", ctx.schedule.bucket_bytes)
    rest = [i for i in range(len(gathers)) if i not in root]
    kept = sorted(root | {rest[i] for i in choose_kept([gathers[i].full_bytes for i in rest], ctx.memory.unshard_budget_bytes)})
    for i in kept:
        _keep(gathers[i].issue + gathers[i].finish)
    if kept:
        gm.recompile()
    return PassResult(gm, bool(kept), {"kept": len(kept), "gathers": len(gathers)})


def _keep(chain: list[fx.Node]) -> None:
    """Untag the chain and the views of its outputs; ask the partitioner to save its outputs."""
    stack = list(chain)
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.meta.pop("recompute", None)
        if TAG in node.meta:
            node.meta[TAG]["kept"] = True
        stack.extend(u for u in node.users if is_alias_of_input(u) or u in chain)
    for node in chain:
        if any(TAG not in u.meta and not is_alias_of_input(u) for u in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a gathered parameter read by compute
