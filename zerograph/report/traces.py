"""Busy time per stream and the exposed-communication fraction, read off a profiler trace file
(the Chrome / Kineto JSON that ``torch.profiler``'s ``export_chrome_trace`` writes, from this
machine or another) with Perfetto's trace processor instead of hand-written event parsing.

The trace processor parses the file and answers SQL; this module classifies its slices the way
``zerograph.bench`` classifies ``torch.profiler``'s in-process events, so the numbers compare:

* GPU trace (it has ``kernel`` slices): communication is the NCCL kernels (name contains
  ``nccl``), compute the other kernels, memcpys and memsets; a stream is a GPU track (Kineto:
  ``pid`` the device, ``tid`` the CUDA stream).
* CPU trace: communication is the ``gloo:*`` / ``nccl:*`` slices of the process group's worker
  threads; compute is the outermost operator slices (``ns::op`` not nested in another operator)
  of the other threads, collective launches and waits (``c10d::*``, ``_c10d_functional::*``)
  excepted; a stream is a thread.

``exposed_comm_s`` is the time some collective is in flight and no compute runs, ``bench``'s
"exposed comm"; ``wait_s`` is the time compute threads sat in ``wait_tensor``, what
``zerograph.report.timeline.measure`` calls exposed. Without a trace processor binary
(``ZEROGRAPH_TRACE_PROCESSOR``, ``bin_path``, ``trace_processor_shell`` on ``PATH``),
``read_trace`` raises ``TraceToolError``; it downloads one only with ``download=True``
(docs/inspection.md, section "Which numbers come from which tool").

Source: Perfetto trace processor (``perfetto.trace_processor.TraceProcessor``, tables ``slice``,
``thread_track``, ``thread``, ``process``); Kineto's trace format (categories ``kernel``,
``gpu_memcpy``, ``gpu_memset``, ``cpu_op``, ``user_annotation``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import platform
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import ZeroGraphError
from .timeline import Event, schedule_from_events

log = logging.getLogger(__name__)

TRACE_PROCESSOR_ENV = "ZEROGRAPH_TRACE_PROCESSOR"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_THREAD_PREFIXES = ("gloo:", "nccl:")  # events a process group's worker threads record
COMM_OP_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")  # launches and waits
WAIT_NAMES = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor")
_OP_NAME = re.compile(r"^[A-Za-z_]\w*::[A-Za-z_]\w*$")  # as zerograph.report.timeline.is_top_level_op
_NS = 1e-9

# every slice on a thread track (Kineto's CPU threads and GPU streams are all thread tracks of a
# JSON trace), with its thread and process; times in ns
SLICES_SQL = """
SELECT s.id AS id, s.ts AS ts, s.dur AS dur, s.name AS name, s.category AS category,
       s.depth AS depth, s.parent_id AS parent_id, t.tid AS tid, t.name AS thread_name,
       p.pid AS pid, p.name AS process_name
FROM slice s
JOIN thread_track tt ON s.track_id = tt.id
JOIN thread t ON tt.utid = t.utid
LEFT JOIN process p ON t.upid = p.upid
ORDER BY s.ts
"""
IMPORT_ERRORS_SQL = "SELECT name, idx, value FROM stats WHERE severity IN ('error', 'data_loss') AND value > 0"


class TraceToolError(ZeroGraphError):
    """The trace processor is unavailable (no binary and no download) or could not read the trace."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """One slice of the trace as the trace processor reports it (times in seconds).

    ``parent`` is the ``id`` of the enclosing slice on the same thread, ``None`` at depth 0;
    ``stream`` names the thread or GPU stream (``"<process> [pid] / <thread> [tid]"``).
    """

    id: int
    start_s: float
    dur_s: float
    name: str
    category: str | None
    parent: int | None
    pid: int | None
    tid: int | None
    stream: str

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclasses.dataclass(frozen=True)
class TraceBreakdown:
    """Busy and exposed times of one window of a trace, in seconds.

    Attributes:
        device: ``"cuda"`` when the trace has GPU kernels (then streams are GPU streams), else ``"cpu"``.
        window_s: length of the window (a named annotation slice, or the whole trace).
        streams: stream -> busy time of its compute or communication slices (overlaps counted once).
        comm_streams: the streams that carry communication.
        compute_s: time some compute slice runs, over all compute streams.
        comm_s: time some communication slice runs.
        overlap_s: time both run (hidden communication).
        exposed_comm_s: ``comm_s - overlap_s``.
        wait_s: time compute threads sat in ``wait_tensor`` (0 on a trace without CPU ops).
    """

    device: str
    window_s: float
    streams: dict[str, float]
    comm_streams: tuple[str, ...]
    compute_s: float
    comm_s: float
    overlap_s: float
    exposed_comm_s: float
    wait_s: float

    @property
    def exposed_fraction(self) -> float:
        """Share of communication time not hidden under compute, in [0, 1] (0 without communication)."""
        return self.exposed_comm_s / self.comm_s if self.comm_s > 0 else 0.0


def find_trace_processor() -> str | None:
    """Path of a ``trace_processor_shell`` usable without a download: ``$ZEROGRAPH_TRACE_PROCESSOR``,
    then ``trace_processor_shell`` on ``PATH``, then the copy the ``perfetto`` package cached on an
    earlier download; ``None`` when there is none."""
    explicit = os.environ.get(TRACE_PROCESSOR_ENV)
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    on_path = shutil.which("trace_processor_shell")
    if on_path:
        return on_path
    return _perfetto_cached_binary()


def _perfetto_cached_binary() -> str | None:
    """Where ``perfetto.prebuilts.get_perfetto_prebuilt`` keeps the pinned binary once downloaded
    (``~/.local/share/perfetto/prebuilts/<name>-<sha256[:16]>``), if it is there."""
    try:
        from perfetto.prebuilts.manifests import trace_processor_shell as pinned
    except ImportError:
        return None
    machine, plat = platform.machine().lower(), sys.platform.lower()
    for entry in pinned.TRACE_PROCESSOR_SHELL_MANIFEST:
        if entry.get("platform") == plat and machine in entry.get("machine", []):
            root, ext = os.path.splitext(entry["file_name"])
            path = os.path.join(os.path.expanduser("~"), ".local", "share", "perfetto", "prebuilts",
                                f"{root}-{entry['sha256'][:16]}{ext}")
            return path if os.path.isfile(path) else None
    return None


def read_slices(path: str, *, bin_path: str | None = None, download: bool = False) -> list[Slice]:
    """Every slice on a thread track of the trace at ``path``, through the trace processor.

    ``bin_path``: the ``trace_processor_shell`` to run (default ``find_trace_processor()``); with
    ``download=True`` and none found, the ``perfetto`` package downloads its pinned binary.
    Raises ``TraceToolError`` when ``perfetto`` is not installed, no binary is available, or the
    trace processor fails on the file (cause chained); ``FileNotFoundError`` when ``path`` is missing.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    try:
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    except ImportError as e:
        raise TraceToolError("reading a trace needs the perfetto package (pip install perfetto)") from e
    bin_path = bin_path or find_trace_processor()
    if bin_path is None and not download:
        raise TraceToolError(
            "no trace_processor_shell: the perfetto package downloads it from Google's storage on first "
            f"use; set {TRACE_PROCESSOR_ENV} to a copy, put it on PATH, or pass download=True")
    try:
        processor = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=bin_path))
    except Exception as e:  # the package raises plain Exception / CalledProcessError for a failed start
        raise TraceToolError(f"the trace processor could not load {path}: {e}") from e
    try:
        problems = [f"{row.name}[{row.idx}]={row.value}" for row in processor.query(IMPORT_ERRORS_SQL)]
        if problems:
            log.warning("the trace processor dropped or misread events of %s: %s", path, ", ".join(problems))
        return [Slice(id=int(row.id), start_s=row.ts * _NS, dur_s=max(row.dur, 0) * _NS, name=row.name or "",
                      category=row.category, parent=None if row.parent_id is None else int(row.parent_id),
                      pid=row.pid, tid=row.tid, stream=_stream_name(row))
                for row in processor.query(SLICES_SQL)]
    except Exception as e:
        raise TraceToolError(f"the trace processor failed on {path}: {e}") from e
    finally:
        processor.close()


def _stream_name(row: Any) -> str:
    process = f"{row.process_name} [{row.pid}]" if row.process_name else f"pid {row.pid}"
    thread = f"{row.thread_name} [{row.tid}]" if row.thread_name else f"tid {row.tid}"
    return f"{process} / {thread}"


def read_trace(path: str, *, window: str | None = None, bin_path: str | None = None,
               download: bool = False) -> list[TraceBreakdown]:
    """Breakdowns of the trace at ``path``: one per slice named ``window`` (e.g. ``"ProfilerStep#3"``,
    or ``zerograph.bench.STEP_LABEL``), in time order, or one for the whole trace when ``window``
    is ``None``. Raises ``TraceToolError`` as ``read_slices`` does, and when no slice is named
    ``window``."""
    slices = read_slices(path, bin_path=bin_path, download=download)
    if window is None:
        if not slices:
            return [breakdown(slices, 0.0, 0.0)]
        return [breakdown(slices, min(s.start_s for s in slices), max(s.end_s for s in slices))]
    windows = sorted((s for s in slices if s.name == window), key=lambda s: s.start_s)
    if not windows:
        raise TraceToolError(f"{path}: no slice named {window!r} to take as the step window")
    return [breakdown(slices, w.start_s, w.end_s) for w in windows]


def breakdown(slices: Sequence[Slice], start_s: float, end_s: float) -> TraceBreakdown:
    """Classify ``slices`` (as the module docstring says) and measure them inside ``[start_s, end_s]``."""
    by_id = {s.id: s for s in slices}
    device = "cuda" if any(s.category == "kernel" for s in slices) else "cpu"
    waits: list[Slice] = []
    if device == "cuda":
        gpu = [s for s in slices if s.category in GPU_CATEGORIES]
        comm = [s for s in gpu if "nccl" in s.name.lower()]
        compute = [s for s in gpu if "nccl" not in s.name.lower()]
    else:
        comm_threads = {(s.pid, s.tid) for s in slices if s.name.startswith(COMM_THREAD_PREFIXES)}
        comm = [s for s in slices if (s.pid, s.tid) in comm_threads and s.name.startswith(COMM_THREAD_PREFIXES)]
        ops = [s for s in slices if (s.pid, s.tid) not in comm_threads and _is_top_level_op(s, by_id)]
        compute = [s for s in ops if not s.name.startswith(COMM_OP_PREFIXES)]
        waits = [s for s in ops if s.name in WAIT_NAMES]
    comm_events = _clipped(comm, "comm", start_s, end_s)
    compute_events = _clipped(compute, "compute", start_s, end_s)
    whole = schedule_from_events(comm_events + compute_events)
    streams: dict[str, float] = {}
    for name in sorted({e.name for e in comm_events + compute_events}):
        on_stream = schedule_from_events([e for e in comm_events + compute_events if e.name == name])
        streams[name] = on_stream.compute_s + on_stream.comm_s  # one of the two is 0 on a stream
    overlap = whole.overlap_s()
    return TraceBreakdown(
        device=device, window_s=end_s - start_s, streams=streams,
        comm_streams=tuple(sorted({e.name for e in comm_events})), compute_s=whole.compute_s,
        comm_s=whole.comm_s, overlap_s=overlap, exposed_comm_s=whole.comm_s - overlap,
        wait_s=schedule_from_events([], _clipped(waits, "comm", start_s, end_s)).exposed_comm_s)


def _is_top_level_op(s: Slice, by_id: dict[int, Slice]) -> bool:
    """An operator slice (``ns::op``) with no operator among its ancestors on its thread."""
    if not _OP_NAME.match(s.name):
        return False
    parent = by_id.get(s.parent) if s.parent is not None else None
    while parent is not None:
        if _OP_NAME.match(parent.name):
            return False
        parent = by_id.get(parent.parent) if parent.parent is not None else None
    return True


def _clipped(slices: Iterable[Slice], track: str, start_s: float, end_s: float) -> list[Event]:
    """``timeline.Event``s named by their stream, cut to ``[start_s, end_s]`` (times from ``start_s``)."""
    out = []
    for s in slices:
        lo, hi = max(s.start_s, start_s), min(s.end_s, end_s)
        if hi > lo:
            out.append(Event(s.stream, track, lo - start_s, hi - lo, kind=s.name))
    return out


__all__ = ["Slice", "TraceBreakdown", "TraceToolError", "breakdown", "find_trace_processor", "read_slices",
           "read_trace"]
