"""The collectives' debug mode (``ZEROGRAPH_DEBUG_COLLECTIVES=1``, ``zerograph/collective_watch.py``):
each way a collective's buffers can be touched between its issue and its wait raises
``CollectiveBufferError`` naming the collective and the buffer; correct use passes. In process, on
PyTorch's fake process group (``zerograph.fake_world``): the checks look at the buffers, not at
what a peer sent."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import zerograph
from zerograph.collective_watch import watching
from zerograph.runtime import CommSchedule
from zerograph.state import runtime_of_model

from .distributed import fake_rank
from .models import build, global_batch

funcol = torch.ops._c10d_functional


@pytest.fixture
def group_name():
    with fake_rank(2) as group:
        yield group.group_name


def _gather(x: torch.Tensor, name: str) -> torch.Tensor:
    return funcol.all_gather_into_tensor(x, 2, name)


FAULTS: dict[str, tuple[Callable[[str], object], str]] = {
    "input written": (lambda name: (lambda x: (_gather(x, name), x.add_(1)))(torch.ones(8)),
                      r"collective #0 \(_c10d_functional.all_gather_into_tensor.default\): its input buffer "
                      r"\(\(8,\) torch.float32 on cpu\): written by aten.add_.Tensor before the wait"),
    "output read": (lambda name: _gather(torch.ones(8), name) + 1,
                    r"its output buffer \(\(16,\) torch.float32 on cpu\): read by aten.add.Tensor before the wait"),
    "out= slot taken again": (
        lambda name: (lambda out: [funcol.all_gather_into_tensor_out(torch.ones(8), 2, name, out=out)
                                   for _ in range(2)])(torch.empty(16)),
        r"its output buffer .*: written by _c10d_functional.all_gather_into_tensor_out.default before the wait"),
    "input released": (
        lambda name: (lambda x: (lambda out: (x.untyped_storage().resize_(0), funcol.wait_tensor(out)))(
            funcol.reduce_scatter_tensor(x, "sum", 2, name)))(torch.ones(8)),
        r"reduce_scatter_tensor.*its input buffer .*: its storage released or reallocated before the wait"),
    "output released": (
        lambda name: (lambda out: (out.untyped_storage().resize_(0), funcol.wait_tensor(out)))(
            _gather(torch.ones(8), name)),
        r"its output buffer .*: its storage released or reallocated before the wait \(64 bytes at issue, 0 now\)"),
    "wait dropped": (lambda name: _gather(torch.ones(8), name), r"collective #0 .* never waited"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_names_the_collective_and_the_buffer(group_name: str, fault: str) -> None:
    body, message = FAULTS[fault]
    with pytest.raises(zerograph.CollectiveBufferError, match=message):
        with watching("a scope", True):
            body(group_name)
    body(group_name) if fault != "output released" else None  # the watch off: nothing checked, nothing raised


def test_correct_use_passes_and_dropped_inputs_are_the_groups_to_hold(group_name: str) -> None:
    with watching("a scope", True):
        send = torch.ones(8)
        gathered = _gather(send, group_name)
        reduced = funcol.reduce_scatter_tensor(send * 2, "sum", 2, group_name)  # its input dropped at once
        del send  # the group holds (or copied) what it still reads
        out = torch.empty(16)
        funcol.wait_tensor(funcol.all_gather_into_tensor_out(torch.ones(8), 2, group_name, out=out))
        funcol.wait_tensor(gathered).sum() + funcol.wait_tensor(reduced).sum()


def test_runtime_checks_its_graphs_and_eager_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the variable set, a compiled model's runtime watches every graph call and eager
    fallback: a stage-3 training (graph break included) passes, and a graph that drops a wait fails."""
    monkeypatch.setenv("ZEROGRAPH_DEBUG_COLLECTIVES", "1")
    with fake_rank(2):
        model = zerograph.compile(build("mlp_break"), stage=3)
        runtime = runtime_of_model(model)
        assert runtime.watch_collectives and runtime.eager.watch_collectives
        x, y = global_batch("mlp_break", 0, 2)
        model(x, y).backward()
        assert runtime.accounting.current.graphs  # graphs ran under the watch
        schedule = CommSchedule("a graph", "forward", (), 0)
        with pytest.raises(zerograph.CollectiveBufferError, match="a graph: collective #0 .* never waited"):
            runtime.run_graph(schedule, lambda args: _gather(torch.ones(4), runtime.group_name), [])


def test_inference_tensors_and_higher_order_operators_pass(group_name: str) -> None:
    """What eval and dropout graphs hold: an inference tensor (no version counter) as a collective's
    buffer, and a higher-order operator (no schema: RNG state saved around a random op)."""
    from torch._prims.rng_prims import run_and_save_rng_state

    with torch.inference_mode(), watching("eval", True):
        funcol.wait_tensor(_gather(torch.ones(8), group_name)).sum()
    with watching("dropout", True):
        run_and_save_rng_state(torch.ops.aten.rand.default, [4], device=torch.device("cpu"))
