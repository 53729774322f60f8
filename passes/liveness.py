"""Live bytes of parameters and gradients after every node of a graph (an analysis, no rewrite).

A tensor's storage is owned by its *root*: the node that allocated it (views and ``wait_tensor``
alias their input). A root is live from its node to the last use of any alias of it (a collective's send buffer to
the collective's wait); a root that reaches the graph's output (saved for backward) stays live to
the end. Roots are classed by the
tag the passes put on their nodes (``gather`` for gathered parameters, ``reduce`` for gradient
buckets) and, for gradients, by being the input of a reduction (``full_grad``).

Used for ``zerograph.stats`` (peak bytes of transient model states) and for memory timelines. The
eager lowering frees at exactly these points (FX codegen drops a value after its last use);
Inductor may reuse buffers but never keeps one longer.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from zerograph.graph.vocab import TAG, WAIT

from ._fx import is_alias_of_input

PARAM_ROLES = ("gather",)
GRAD_ROLES = ("full_grad", "reduce")


@dataclasses.dataclass(frozen=True)
class Timeline:
    """``live[i][role]`` = bytes of that role live after node ``i`` (graph order).

    ``saved`` maps names of graph outputs that carry a role (saved for backward) to (role, bytes).
    """

    names: list[str]
    live: list[dict[str, int]]
    saved: dict[str, tuple[str, int]]

    def peak(self, roles: tuple[str, ...]) -> int:
        return max((sum(step.get(r, 0) for r in roles) for step in self.live), default=0)


# ops whose schema declares no alias but whose output shares its input's storage
SAME_STORAGE = (WAIT, torch.ops.aten._unsafe_view.default)


# out= ops (``buffer_reuse``'s): the result is the ``out`` argument
OUT_ARGUMENT = (torch.ops._c10d_functional.all_gather_into_tensor_out.default,)


def storage_root(node: fx.Node) -> fx.Node:
    while True:
        if node.target in OUT_ARGUMENT:
            node = node.kwargs["out"]
        elif (is_alias_of_input(node) or node.target in SAME_STORAGE) and node.all_input_nodes:
            node = node.all_input_nodes[0]
        else:
            return node


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def reads(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` keeps alive: its inputs and, for a wait, its collective's inputs (the
    process group holds a collective's send buffer until the collective is waited on)."""
    if node.target is WAIT:
        return node.all_input_nodes + [i for c in node.all_input_nodes for i in c.all_input_nodes]
    return node.all_input_nodes


def timeline(graph: fx.Graph, carried: dict[str, tuple[str, int]] | None = None) -> Timeline:
    """Sweep the graph once. ``carried``: roles of placeholders by name (a forward's ``saved``)."""
    carried = carried or {}
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    role: dict[fx.Node, str] = {}
    size: dict[fx.Node, int] = {}
    for node in nodes:
        tag = node.meta.get(TAG, {}).get("role")
        if node.op == "placeholder" and node.name in carried:
            role[node], size[node] = carried[node.name]
        elif tag in ("gather", "reduce") and storage_root(node) is node and _nbytes(node):
            role[node], size[node] = tag, _nbytes(node)
        if tag == "reduce":  # inputs of a reduction's copy-in are full gradients
            for inp in node.all_input_nodes:
                root = storage_root(inp)
                if TAG not in root.meta and root not in role and root.op != "placeholder":
                    role[root], size[root] = "full_grad", _nbytes(root)
    last: dict[fx.Node, int] = {}
    saved: dict[str, tuple[str, int]] = {}
    saved_roots: set[fx.Node] = set()
    for node in nodes:
        for inp in reads(node):
            root = storage_root(inp)
            if root in role:
                last[root] = end if node.op == "output" else max(last.get(root, 0), pos[node])
                if node.op == "output":  # several saved views of one buffer: its bytes count once
                    saved[inp.name] = (role[root], 0 if root in saved_roots else size[root])
                    saved_roots.add(root)
    delta: list[dict[str, int]] = [dict() for _ in range(end + 2)]
    for root, r in role.items():
        delta[pos[root]][r] = delta[pos[root]].get(r, 0) + size[root]
        free_at = last.get(root, pos[root]) + 1
        delta[free_at][r] = delta[free_at].get(r, 0) - size[root]
    live, current = [], {}
    for i in range(end):
        for r, d in delta[i].items():
            current[r] = current.get(r, 0) + d
        live.append(dict(current))
    return Timeline([n.name for n in nodes], live, saved)
