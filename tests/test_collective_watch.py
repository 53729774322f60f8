"""The collectives' debug mode (``ZEROGRAPH_DEBUG_COLLECTIVES=1``, ``zerograph/runtime/collective_watch.py``):
each way a collective's buffers can be touched between its issue and its wait raises
``CollectiveBufferError`` naming the collective and the buffer; correct use passes. In process, on
PyTorch's fake process group (``zerograph.fake_world``): the checks look at the buffers, not at
what a peer sent."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import zerograph
from zerograph.runtime.collective_watch import watching
from zerograph.runtime.runtime import CommSchedule
from zerograph.runtime.state import runtime_of_model

from .distributed import fake_rank
from .models import build, global_batch

funcol = torch.ops._c10d_functional


@pytest.fixture
def group_name():
    with fake_rank(2) as group:
        yield group.group_name


class Issuer:
    """Issues collectives over a group and waits every one of them at the test's end (outside any
    watch), so that no test leaves a collective unwaited in c10d's registry."""

    def __init__(self, name: str):
        self.name, self.issued = name, []

    def gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        result = (funcol.all_gather_into_tensor(x, 2, self.name) if out is None
                  else funcol.all_gather_into_tensor_out(x, 2, self.name, out=out))
        self.issued.append(result)
        return result

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        self.issued.append(funcol.reduce_scatter_tensor(x, "sum", 2, self.name))
        return self.issued[-1]

    def wait_all(self) -> None:
        for t in self.issued:
            funcol.wait_tensor(t)


@pytest.fixture
def issuer(group_name: str):
    issuer = Issuer(group_name)
    yield issuer
    issuer.wait_all()


def _input_written(c: Issuer) -> None:
    x = torch.ones(8)
    c.gather(x)
    x.add_(1)


def _output_read(c: Issuer) -> None:
    c.gather(torch.ones(8)) + 1


def _slot_taken_again(c: Issuer) -> None:  # an out= buffer handed to a second collective before the wait
    out = torch.empty(16)
    c.gather(torch.ones(8), out=out)
    c.gather(torch.ones(8), out=out)


def _input_released(c: Issuer) -> None:
    x = torch.ones(8)
    out = c.reduce_scatter(x)
    x.untyped_storage().resize_(0)
    funcol.wait_tensor(out)


def _output_released(c: Issuer) -> None:
    out = c.gather(torch.ones(8))
    out.untyped_storage().resize_(0)
    funcol.wait_tensor(out)


def _wait_dropped(c: Issuer) -> None:
    c.gather(torch.ones(8))


FAULTS: dict[str, tuple[Callable[[Issuer], None], str]] = {
    "input written": (_input_written, r"collective #0 \(_c10d_functional.all_gather_into_tensor.default\): its input "
                                      r"buffer \(\(8,\) torch.float32 on cpu\): written by aten.add_.Tensor before the wait"),
    "output read": (_output_read, r"its output buffer \(\(16,\) torch.float32 on cpu\): read by aten.add.Tensor before "
                                  r"the wait"),
    "out= slot taken again": (_slot_taken_again, r"its output buffer .*: written by "
                                                 r"_c10d_functional.all_gather_into_tensor_out.default before the wait"),
    "input released": (_input_released, r"reduce_scatter_tensor.*its input buffer .*: its storage released or "
                                        r"reallocated before the wait"),
    "output released": (_output_released, r"its output buffer .*: its storage released or reallocated before the "
                                          r"wait \(64 bytes at issue, 0 now\)"),
    "wait dropped": (_wait_dropped, r"collective #0 .* never waited"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_names_the_collective_and_the_buffer(issuer: Issuer, fault: str) -> None:
    body, message = FAULTS[fault]
    with pytest.raises(zerograph.CollectiveBufferError, match=message):
        with watching("a scope", True):
            body(issuer)
    if fault != "output released":  # the watch off: nothing checked, nothing raised
        body(issuer)


def test_correct_use_passes_and_dropped_inputs_are_the_groups_to_hold(issuer: Issuer) -> None:
    with watching("a scope", True):
        send = torch.ones(8)
        gathered = issuer.gather(send)
        reduced = issuer.reduce_scatter(send * 2)  # its input dropped at once
        del send  # the group holds (or copied) what it still reads
        funcol.wait_tensor(issuer.gather(torch.ones(8), out=torch.empty(16)))
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
        issuer = Issuer(runtime.topology.group_name)
        with pytest.raises(zerograph.CollectiveBufferError, match="a graph: collective #0 .* never waited"):
            runtime.run_graph(schedule, lambda args: issuer.gather(torch.ones(4)), [])
        issuer.wait_all()


def test_inference_tensors_and_higher_order_operators_pass(issuer: Issuer) -> None:
    """What eval and dropout graphs hold: an inference tensor (no version counter) as a collective's
    buffer, and a higher-order operator (no schema: RNG state saved around a random op); and a
    tensor without storage of its own to watch (sparse) next to a pending collective."""
    from torch._prims.rng_prims import run_and_save_rng_state

    with watching("sparse", True):
        pending = issuer.gather(torch.ones(4))
        (torch.ones(3).to_sparse() * 2).to_dense()
        funcol.wait_tensor(pending)

    with torch.inference_mode(), watching("eval", True):
        funcol.wait_tensor(issuer.gather(torch.ones(8))).sum()
    with watching("dropout", True):
        run_and_save_rng_state(torch.ops.aten.rand.default, [4], device=torch.device("cpu"))
