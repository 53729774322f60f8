"""Numbers read off a profiler trace file with Perfetto's trace processor (``zerograph.report.traces``).

The classification and arithmetic are checked on hand-made slices with known answers (no tool
needed); the trace processor itself reads a CPU trace that ``torch.profiler`` writes of one
in-process step (world size 1: a small model's forward and backward with a functional all-gather
in flight under it, then one waited at once), and its numbers are compared with the
hand-written ones ``zerograph.bench`` computes from the same profile's in-process events. That
test skips, with the reason, where no ``trace_processor_shell`` is at hand: the ``perfetto``
package downloads it from Google's storage on first use, which this project's machines and CI
cannot reach.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerograph import bench
from zerograph.report import traces
from zerograph.report.traces import Slice, breakdown

MS = 1e-3


def _slice(id: int, start_ms: float, end_ms: float, name: str, stream: str, *, category: str | None = None,
           parent: int | None = None, tid: int = 1) -> Slice:
    return Slice(id=id, start_s=start_ms * MS, dur_s=(end_ms - start_ms) * MS, name=name, category=category,
                 parent=parent, pid=0, tid=tid, stream=stream)


def test_gpu_trace_nccl_kernels_against_the_other_kernels():
    slices = [_slice(1, 0, 10, "sm90_gemm", "stream 7", category="kernel", tid=7),
              _slice(2, 12, 20, "elementwise", "stream 7", category="kernel", tid=7),
              _slice(3, 20, 22, "Memcpy DtoD", "stream 7", category="gpu_memcpy", tid=7),
              _slice(4, 5, 15, "ncclDevKernel_AllGather_RING_LL", "stream 20", category="kernel", tid=20),
              _slice(5, 0, 30, "aten::mm", "python [1]", category="cpu_op")]  # CPU side: not counted on GPU
    whole = breakdown(slices, 0.0, 30 * MS)
    assert whole.device == "cuda"
    assert whole.streams == pytest.approx({"stream 7": 20 * MS, "stream 20": 10 * MS})
    assert whole.comm_streams == ("stream 20",)
    assert (whole.compute_s, whole.comm_s, whole.overlap_s) == pytest.approx((20 * MS, 10 * MS, 8 * MS))
    assert whole.exposed_comm_s == pytest.approx(2 * MS) and whole.exposed_fraction == pytest.approx(0.2)
    cut = breakdown(slices, 0.0, 14 * MS)  # a step window cuts the slices that cross it
    assert (cut.compute_s, cut.comm_s, cut.exposed_comm_s) == pytest.approx((12 * MS, 9 * MS, 2 * MS))


def test_cpu_trace_gloo_threads_against_top_level_ops():
    main, gloo = "python [1] / main [1]", "python [1] / gloo [2]"
    slices = [_slice(1, 0, 30, bench.STEP_LABEL, main, category="user_annotation"),
              _slice(2, 1, 5, "aten::linear", main, category="cpu_op", parent=1),
              _slice(3, 2, 4, "aten::addmm", main, category="cpu_op", parent=2),  # nested: part of linear
              _slice(4, 5, 6, "_c10d_functional::all_reduce", main, category="cpu_op", parent=1),
              _slice(5, 6, 10, "aten::add", main, category="cpu_op", parent=1),
              _slice(6, 10, 14, "_c10d_functional::wait_tensor", main, category="cpu_op", parent=1),
              _slice(7, 6, 13, "gloo:all_reduce", gloo, category="user_annotation", tid=2)]
    got = breakdown(slices, 0.0, 30 * MS)
    assert got.device == "cpu" and got.comm_streams == (gloo,)
    assert got.streams == pytest.approx({main: 8 * MS, gloo: 7 * MS})
    assert (got.compute_s, got.comm_s, got.overlap_s, got.exposed_comm_s) == pytest.approx(
        (8 * MS, 7 * MS, 4 * MS, 3 * MS))
    assert got.wait_s == pytest.approx(4 * MS) and got.exposed_fraction == pytest.approx(3 / 7)
    quiet = breakdown(slices[:3], 0.0, 30 * MS)  # no communication: nothing exposed, no division by 0
    assert (quiet.comm_s, quiet.exposed_fraction) == (0.0, 0.0)


def test_missing_trace_processor_is_a_clear_error(tmp_path, monkeypatch):
    trace = tmp_path / "trace.json"
    trace.write_text('{"traceEvents": []}')
    monkeypatch.setenv(traces.TRACE_PROCESSOR_ENV, str(tmp_path / "no_such_binary"))
    with pytest.raises(traces.TraceToolError, match="no trace_processor_shell"):
        traces.read_trace(str(trace))
    with pytest.raises(FileNotFoundError):
        traces.read_trace(str(tmp_path / "missing.json"))


class _FakeProcessor:
    """Stands in for ``perfetto.trace_processor.TraceProcessor``: answers the two queries
    ``read_slices`` sends with fixed rows (times in ns), so the glue is checked without the binary."""

    closed = False

    def __init__(self, trace, config):
        self.trace, self.config = trace, config

    def query(self, sql):
        from types import SimpleNamespace as Row

        if "FROM stats" in sql:
            return [Row(name="json_parser_failure", idx=None, value=2)]
        assert "JOIN thread_track" in sql
        return [Row(id=1, ts=1_000_000, dur=4_000_000, name="aten::mm", category="cpu_op", depth=0, parent_id=None,
                    tid=11, thread_name="python", pid=10, process_name="train"),
                Row(id=2, ts=2_000_000, dur=4_000_000, name="gloo:all_gather", category="user_annotation", depth=0,
                    parent_id=None, tid=12, thread_name=None, pid=10, process_name="train")]

    def close(self):
        _FakeProcessor.closed = True


def test_read_trace_through_the_trace_processor_api(tmp_path, monkeypatch, caplog):
    import perfetto.trace_processor as tp

    trace = tmp_path / "trace.json"
    trace.write_text("{}")
    binary = tmp_path / "trace_processor_shell"
    binary.write_text("")
    monkeypatch.setenv(traces.TRACE_PROCESSOR_ENV, str(binary))
    monkeypatch.setattr(tp, "TraceProcessor", _FakeProcessor)
    (got,) = traces.read_trace(str(trace))
    assert got.streams == pytest.approx({"train [10] / python [11]": 4 * MS, "train [10] / tid 12": 4 * MS})
    assert (got.window_s, got.compute_s, got.comm_s, got.exposed_comm_s) == pytest.approx((5 * MS, 4 * MS, 4 * MS, MS))
    assert _FakeProcessor.closed and "json_parser_failure[None]=2" in caplog.text
    with pytest.raises(traces.TraceToolError, match="no slice named 'step'"):
        traces.read_trace(str(trace), window="step")

    def refuse(trace, config):
        raise OSError("cannot start")

    monkeypatch.setattr(tp, "TraceProcessor", refuse)
    with pytest.raises(traces.TraceToolError, match="could not load") as failure:
        traces.read_trace(str(trace))
    assert isinstance(failure.value.__cause__, OSError)


def _profiled_step(path: str) -> tuple[list, object]:
    """Profile one in-process step and export its trace to ``path``; returns the profile's events
    and its step window (``bench.STEP_LABEL``)."""
    from tests.models import build, global_batch

    if not dist.is_initialized():  # world size 1, as zerograph.compile would create it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD.group_name
    functional = torch.ops._c10d_functional
    model, batch = build("gpt"), global_batch("gpt", 0, 4)
    flat = torch.randn(1_000_000)

    def step():  # at world size 1 gloo's all-gather is a copy on its worker thread (its all-reduce: nothing)
        in_flight = functional.all_gather_into_tensor(flat, 1, group)  # copies while the model runs: hidden
        model(*batch).backward()
        functional.wait_tensor(in_flight)
        functional.wait_tensor(functional.all_gather_into_tensor(flat, 1, group))  # waited at once: exposed

    step()
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
          torch.profiler.record_function(bench.STEP_LABEL)):
        step()
    prof.export_chrome_trace(path)
    events = list(prof.events())
    (window,) = bench._step_windows(events)
    return events, window


# both tools read the same profile (the trace file holds the in-process events' times to the ns);
# the slack covers the file's µs rounding and a slice the trace processor re-nests
ABS_TOL_S, REL_TOL = 20e-6, 0.01


def test_trace_processor_agrees_with_the_hand_written_numbers(tmp_path):
    if traces.find_trace_processor() is None:
        pytest.skip("no trace_processor_shell: the perfetto package downloads it from Google's storage on "
                    f"first use, which this machine cannot reach (set {traces.TRACE_PROCESSOR_ENV} to a copy)")
    path = str(tmp_path / "step.json")
    events, window = _profiled_step(path)
    hand = bench.comm_breakdown(events, window, torch.device("cpu"))
    (waits,) = bench._zerograph_wait_breakdown(events, [window])
    (tool,) = traces.read_trace(path, window=bench.STEP_LABEL)
    assert hand["comm_s"] > 0 and tool.comm_streams  # the step did communicate
    for key in ("step_s", "compute_s", "comm_s", "exposed_comm_s"):
        ours = tool.window_s if key == "step_s" else getattr(tool, key)
        assert ours == pytest.approx(hand[key], rel=REL_TOL, abs=ABS_TOL_S), key
    assert tool.wait_s == pytest.approx(waits, rel=REL_TOL, abs=ABS_TOL_S)
    assert sum(tool.streams[s] for s in tool.comm_streams) >= tool.comm_s - ABS_TOL_S
