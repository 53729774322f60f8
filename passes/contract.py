"""What each pass requires of the graph and what it provides, checked before a pipeline runs.

A pass declares its contract with ``@contract(requires=..., provides=...)``; the capabilities are
plain words (``CAPABILITIES``). ``check_pipeline`` walks a pipeline in order, starting from what
the graph of that kind already holds when it arrives, and refuses it, naming the pass and the
missing capability, when a pass would run without what it needs or the pipeline would end
without what the next stage of capture needs (every marker expanded). ``Config`` runs the check
over every pipeline when it is built, so ``disabled_passes=("insert_allgather",)`` fails there,
not at the first forward.

Source: DeepSpeed DeepCompile's pass contracts (``deepspeed/compile``); ``torch.fx``'s
``PassBase.requires`` / ``ensures``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

CAPABILITIES = {
    "markers": "the graph holds zerograph::unshard / reduce_grad markers (capture leaves them)",
    "buckets": "markers carry the bucket they are gathered or reduced in (bucketing)",
    "gathers": "every unshard marker is expanded into copy-in, all-gather, wait, copy-out (insert_allgather)",
    "reductions": "every reduce_grad marker is expanded into its reduction (insert_reduce_scatter)",
    "units_expanded": "no zerograph::unit_call is left: each templated unit's ops are in the graph (expand_unit_calls)",
    "saved_tensors_first": "the pair's saved tensors come before its saved opaque objects, as AOTAutograd's runtime "
                           "reads them (saved_opaque_objects_last)",
}

# what a graph of each kind holds when its pipeline starts: the partitioned pair comes out of the
# partitioner, after the joint pipeline expanded the gathers, and its pipeline expands the unit
# calls before the forward and backward graphs go on alone; an inference graph (no_grad) never was
# joint
START = {"joint": {"markers"}, "partitioned": {"markers", "gathers"},
         "forward": {"markers", "gathers", "units_expanded"}, "backward": {"markers", "gathers", "units_expanded"},
         "inference": {"markers"}}
# what the graph of each kind must hold when its pipeline ends (capture's checks need it)
END = {"joint": {"gathers"}, "partitioned": {"gathers", "units_expanded", "saved_tensors_first"},
       "forward": {"gathers"}, "backward": {"reductions"}, "inference": {"gathers", "units_expanded"}}


@dataclasses.dataclass(frozen=True)
class PassContract:
    """``requires``: capabilities the graph must hold before the pass; ``provides``: those it holds after."""

    requires: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()


def contract(*, requires: Iterable[str] = (), provides: Iterable[str] = ()) -> Callable[[Any], Any]:
    """Decorator: attach a ``PassContract`` to a pass function (as ``fn.contract``)."""
    declared = PassContract(frozenset(requires), frozenset(provides))
    unknown = (declared.requires | declared.provides) - CAPABILITIES.keys()
    assert not unknown, f"unknown capabilities {sorted(unknown)}"

    def attach(fn: Any) -> Any:
        fn.contract = declared
        return fn

    return attach


def contract_of(pass_fn: Any) -> PassContract:
    return getattr(pass_fn, "contract", PassContract())


def pipeline_problem(kind: str, passes: Sequence[Any], disabled: Iterable[str] = ()) -> str | None:
    """Why ``passes`` (minus ``disabled``) cannot run on a graph of ``kind``, or ``None`` when they can."""
    disabled = set(disabled)
    held = set(START[kind])
    for pass_fn in passes:
        name = pass_fn.__name__
        if name in disabled:
            continue
        missing = contract_of(pass_fn).requires - held
        if missing:
            return (f"pass {name!r} of the {kind} pipeline requires {sorted(missing)} "
                    f"({CAPABILITIES[sorted(missing)[0]]}), which {_providers(passes, missing)} would provide")
        held |= contract_of(pass_fn).provides
    missing = END[kind] - held
    if missing:
        return (f"the {kind} pipeline must end with {sorted(missing)} ({CAPABILITIES[sorted(missing)[0]]}), "
                f"which {_providers(passes, missing)} would provide")
    return None


def _providers(passes: Sequence[Any], capabilities: set[str]) -> str:
    names = [p.__name__ for p in passes if contract_of(p).provides & capabilities]
    return " / ".join(repr(n) for n in names) if names else "no pass"
