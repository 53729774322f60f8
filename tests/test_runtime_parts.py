"""The runtime's parts (``zerograph/runtime/runtime.py``): reached by name, none referring back to
the runtime. In process, a fake world of 2 ranks; nothing communicates."""
from __future__ import annotations

import pytest

import zerograph
from zerograph.runtime.accounting import StepAccounting
from zerograph.runtime.comm_schedule import ScheduleCheck
from zerograph.runtime.eager import EagerCollectives
from zerograph.runtime.grad_buffers import GradientBuffers
from zerograph.runtime.runtime import Runtime
from zerograph.runtime.state import runtime_of_model
from zerograph.runtime.topology import Topology

from .distributed import fake_rank
from .models import build

PARTS = {"topology": Topology, "accounting": StepAccounting, "schedule_check": ScheduleCheck,
         "eager": EagerCollectives, "grad_buffers": GradientBuffers}


def _compiled_runtime() -> Runtime:
    return runtime_of_model(zerograph.compile(build("mlp"), stage=3))


def test_parts_are_reached_by_name() -> None:
    """Each part is an attribute of its own type; the runtime holds none of its parts' names, and a
    write to one of them (``requires_gradient_sync``, which the gradient buffers hold) raises
    instead of setting a name nothing reads."""
    with fake_rank(2, rank=1):
        runtime = _compiled_runtime()
        for name, cls in PARTS.items():
            assert isinstance(getattr(runtime, name), cls), name
        assert runtime.topology.rank == 1 and runtime.topology.world_size == 2
        for name in ("rank", "world_size", "mesh_rank", "graph_memory", "check_schedule", "requires_gradient_sync",
                     "unsynced_bytes", "gradients"):
            assert not hasattr(runtime, name), name
        with pytest.raises(AttributeError):
            runtime.requires_gradient_sync = False  # type: ignore[attr-defined]
        assert runtime.grad_buffers.requires_gradient_sync


def _refers_to(value: object, target: object) -> bool:
    """Whether ``value`` is ``target``, or a function bound to it or closing over it."""
    if value is target or getattr(value, "__self__", None) is target:
        return True
    cells = getattr(value, "__closure__", None) or ()
    return any(cell.cell_contents is target for cell in cells)


def test_no_part_refers_back_to_the_runtime() -> None:
    """The parts are built each from the ones before it: none holds the runtime, a method of it or
    a closure over it (the gradient buffers reduce through ``eager``, which they hold)."""
    with fake_rank(2):
        runtime = _compiled_runtime()
        for name in PARTS:
            part = getattr(runtime, name)
            held = [attr for attr, value in vars(part).items() if _refers_to(value, runtime)]
            assert not held, f"runtime.{name} refers back to the runtime through {held}"
        assert runtime.grad_buffers.eager is runtime.eager
