"""Run a function on several CPU ranks (gloo), each in its own spawned process; or, for checks
that need only one rank's graphs, shards and accounting, as one rank of a fake world in this
process (``fake_rank``: no process start, no gloo, any world size).

A rank that raises makes ``spawn`` kill the others and raise with that rank's traceback; a run
that hangs is killed too (see ``spawn`` for how a hang is told from a slow run on a loaded
machine), so it fails the test instead of stalling the suite.

Ranks are forked from a forkserver that has imported torch and zerograph and compiled once
(``tests.forkserver``), so a rank pays neither the imports a spawned interpreter runs before its
first line nor the first compile's warm-up (docs/benchmarks.md, "The test suite"). Each rank is
still a new process (no state carries from one test to the next); ``start_method="spawn"`` is
for a run that needs a fresh interpreter (one that reads environment variables at process start,
such as glibc's malloc tunables).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import resource
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zerograph
from tests import forkserver, guard_probe  # noqa: F401  (guard_probe: Dynamo's latency probe off in the ranks)
from tests.stress import SPAWN_LOG

# the running rank's store (set by _worker): ranks compare notes through it, outside gloo
_store: dist.Store | None = None
_cases_run = 0  # cases this rank has run through `run_case_in_step`
_outdir = ""  # the running rank's spawn folder: names its spawn in the stress lane's log

# CPU seconds of the ranks forked from the forkserver: they are its children, not this process's,
# so tests/cpu_durations.py adds this to the children's CPU it reads from getrusage
forked_ranks_cpu_s = 0.0


def _write_cpu(outdir: str, rank: int) -> None:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(outdir, f"rank{rank}.cpu"), "w") as f:
        f.write(repr(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime))


def _worker(rank: int, world_size: int, outdir: str, fn: Callable, args: tuple, pg_timeout_s: float,
            teardown_barrier: bool, init_group: bool) -> None:
    torch.set_num_threads(1)  # one intra-op thread per rank: ranks share 2 cores
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    # a rank killed by a signal (a C++ abort, a segfault) leaves no Python traceback of its own:
    # faulthandler writes every thread's stack to the run's folder instead (_errors reads it)
    crash_log = open(os.path.join(outdir, f"rank{rank}.crash"), "w")  # open until the process ends
    faulthandler.enable(crash_log, all_threads=True)
    try:
        store = _rendezvous(rank, world_size, outdir, timeout)
        global _store, _outdir
        _store, _outdir = store, outdir
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store, timeout=timeout)
        else:  # as under torchrun: fn's init_process_group() joins this store from the environment
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        if init_group:
            if teardown_barrier:
                dist.barrier()  # no rank tears gloo down while a peer still talks to it
            dist.destroy_process_group()
        else:
            store.add("done", 1)
            if rank == 0:  # the store's host leaves last: a peer may still read it
                while store.add("done", 0) < world_size:
                    time.sleep(0.01)
        _write_cpu(outdir, rank)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        _write_cpu(outdir, rank)
        os._exit(1)


def _rendezvous(rank: int, world_size: int, outdir: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """The run's TCPStore. Rank 0 binds it on a port the kernel picks and writes the port into
    ``outdir``; the others read it there. A port chosen free beforehand and bound later could be
    taken in between by another job on the host (a concurrent torchrun, the bench's launcher),
    and a rank that reached the wrong job's store would fail obscurely."""
    path = os.path.join(outdir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)  # whole or absent: a reader never sees half a number
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its store's port within {timeout.total_seconds():g} s")
        time.sleep(0.01)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


class RankFailed(RuntimeError):
    pass


class RanksOutOfStep(RuntimeError):
    """After a case of a multi-case run, the ranks disagree on what they ran: a different case, a
    different outcome (one raised, another did not), or a different number of collectives on the
    world group. Their next collectives would pair with different ones of the peer, which gloo
    does not check (it aborts, or reads and writes buffers of another collective: heap corruption)."""


def _log_training(what: str, outdir: str) -> None:
    """Under the stress lane (``SPAWN_LOG`` set), append ``what`` (``spawn``: a run of ranks;
    ``case``: one training of a run of many, ``run_case_in_step``) and the run's folder to its log:
    ``tests/stress.py`` counts the trainings, a run's cases or else the run itself."""
    if os.environ.get(SPAWN_LOG):
        with open(os.environ[SPAWN_LOG], "a") as log:
            log.write(f"{what} {os.path.basename(outdir)}\n")


def timed(fn: Callable[..., dict], *args: Any) -> dict:
    """``fn(*args)``'s result dict with the wall seconds it took added as ``"seconds"``."""
    start = time.perf_counter()
    result = fn(*args)
    result["seconds"] = time.perf_counter() - start
    return result


def run_case_in_step(key: object, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, one case of a worker that runs several in one spawn: its result, or the
    traceback text of its exception (the test of that case reports it); then the ranks check, through the
    run's store and not through gloo, that they are still in step: the same case, both returned
    or both raised, and the same count of collectives run on the world group
    (``ProcessGroup._get_sequence_number_for_group``). Raises ``RanksOutOfStep`` naming each
    rank's case, outcome and count otherwise, so the run stops here with the cause instead of the next
    collective pairing with another one of the peer's."""
    global _cases_run
    if dist.is_initialized() and dist.get_rank() == 0:
        _log_training("case", _outdir)
    try:
        result, outcome = fn(*args), "returned"
    except Exception as exc:  # noqa: BLE001 - the case's own test reports it
        result, outcome = traceback.format_exc(), f"raised {type(exc).__name__}: {str(exc)[:300]}"
    if _store is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return result
    _cases_run += 1
    seq = dist.group.WORLD._get_sequence_number_for_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"case_in_step/{_cases_run}/"
    _store.set(f"{prefix}{rank}", json.dumps([repr(key), outcome.startswith("raised"), seq, outcome]))
    # a peer out of step may sit in a collective until the process group's timeout: wait longer
    _store.wait([f"{prefix}{r}" for r in range(world)], datetime.timedelta(seconds=PG_TIMEOUT_S + STALL_MARGIN_S))
    notes = [json.loads(_store.get(f"{prefix}{r}")) for r in range(world)]
    if any(note[:3] != notes[0][:3] for note in notes):
        raise RanksOutOfStep(f"ranks out of step after case {_cases_run} of this run: " + "; ".join(
            f"rank {r}: case {k}, {out}, {s} collectives on the world group" for r, (k, _, s, out) in enumerate(notes)))
    return result


class SpawnNotMarked(RuntimeError):
    """A test spawned ranks without the ``distributed`` marker (it would run in ``make test-fast``)."""


# set by tests/conftest.py around each test: whether the running test is marked `distributed`
spawn_allowed: Callable[[], bool] = lambda: True  # noqa: E731

WALL_FACTOR = 8  # wall-clock backstop: timeout_s * WALL_FACTOR seconds, whatever the load
STALL_MARGIN_S = 60  # a run whose ranks use no CPU for pg_timeout_s + this long is hung


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants (Inductor's compile
    workers) and reaped children; 0 for a process that is gone."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


# the process group's timeout in a spawned run: above the longest wait for a peer that is still
# compiling when both lanes of `make test` load the 2 cores. At 60 s a rank timed out in one cell
# of a run that records each cell's failure and goes on (the semantics matrix, test_models_real's
# parts), so its peer's next collective met the other rank's final barrier and gloo aborted
# (SIGABRT): the cell's real error never reached the report. Fault tests pass their own, shorter one.
PG_TIMEOUT_S = 180


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240, pg_timeout_s: float = PG_TIMEOUT_S,
          teardown_barrier: bool = True, start_method: str = "forkserver", init_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). ``teardown_barrier=False`` is for runs
    where a rank leaves on purpose. ``start_method``: ``"forkserver"`` (torch already imported;
    the ranks see the environment the server started with) or ``"spawn"`` (a fresh interpreter
    that sees this process's environment now). ``init_group=False``: no process group is made
    for ``fn``; the ranks get torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` / ``MASTER_PORT`` of the run's store, ``TORCHELASTIC_USE_AGENT_STORE``), so
    a script's ``init_process_group()`` joins that store as it joins torchrun's agent's, and
    destroys its own group. Raises ``RankFailed`` with the first failing rank's traceback,
    or when the run is taken for hung:

    - a rank used more than ``timeout_s`` CPU seconds (with its child processes). CPU time, not
      wall time: on a loaded machine a rank gets a fraction of a core, and a wall-clock limit
      failed healthy runs when other jobs shared the cores;
    - no rank used any CPU for ``pg_timeout_s + STALL_MARGIN_S`` seconds: every rank blocked
      longer than any collective may wait (gloo blocks without spinning);
    - a backstop of ``WALL_FACTOR * timeout_s`` wall seconds.

    Raises ``SpawnNotMarked`` inside a pytest test that is not marked ``distributed``.
    """
    if not spawn_allowed():
        raise SpawnNotMarked(f"spawn({fn.__name__}) in a test not marked `distributed`: add "
                             "@pytest.mark.distributed (or pytestmark) so `make test-fast` leaves it out")
    ctx = (forkserver.context() if start_method == "forkserver" else None) or mp.get_context(start_method)
    with tempfile.TemporaryDirectory() as outdir:
        _log_training("spawn", outdir)
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, outdir, fn, args, pg_timeout_s, teardown_barrier, init_group))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        started = last_progress = time.monotonic()
        cpu_used = [0.0] * world_size
        next_sample = started
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    time.sleep(1.0)  # let the others write their own error first
                    raise RankFailed(_errors(outdir, procs) or f"ranks {failed} died")
                now = time.monotonic()
                if now >= next_sample:
                    next_sample = now + 1.0
                    sample = [cpu_seconds(p.pid) if p.is_alive() else used for p, used in zip(procs, cpu_used)]
                    if sample != cpu_used:
                        last_progress = now
                    cpu_used = [max(a, b) for a, b in zip(sample, cpu_used)]
                    hung = None
                    if max(cpu_used) > timeout_s:
                        hung = f"a rank used {max(cpu_used):.0f} CPU s (limit timeout_s={timeout_s:g})"
                    elif now - last_progress > pg_timeout_s + STALL_MARGIN_S:
                        hung = f"no rank used CPU for {now - last_progress:.0f} s"
                    elif now - started > WALL_FACTOR * timeout_s:
                        hung = f"{now - started:.0f} s wall (backstop {WALL_FACTOR} x timeout_s)"
                    if hung:
                        raise RankFailed(f"timed out: {hung}\n{_errors(outdir, procs)}")
                time.sleep(0.05)
            failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
            if failed:
                raise RankFailed(_errors(outdir, procs) or f"ranks {failed} exited non-zero")
            return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            if start_method == "forkserver":
                _count_forked_cpu(outdir, cpu_used)


def _count_forked_cpu(outdir: str, sampled: list[float]) -> None:
    """Add each rank's CPU seconds: what it wrote at its end (its reaped children included) or, if
    more, the last sample of it and its live descendants (Inductor's compile workers outlive that
    write; a killed rank wrote none)."""
    global forked_ranks_cpu_s
    for r, last_sample in enumerate(sampled):
        path = os.path.join(outdir, f"rank{r}.cpu")
        reported = 0.0
        if os.path.exists(path):
            with open(path) as f:
                reported = float(f.read())
        forked_ranks_cpu_s += max(reported, last_sample)


def _errors(outdir: str, procs: list) -> str:
    """Each rank's traceback (``rank<r>.err``); for a rank that ended without one, its exit code
    (a negative code is the signal that ended it) and what faulthandler wrote at the crash; and
    which ranks were still running."""
    parts = []
    for r, proc in enumerate(procs):
        path = os.path.join(outdir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"--- rank {r} ---\n{f.read()}")
        elif proc.exitcode not in (None, 0):
            ended = (f"signal {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0
                     else f"exit code {proc.exitcode}")
            crash = os.path.join(outdir, f"rank{r}.crash")
            stacks = ""
            if os.path.exists(crash):
                with open(crash) as f:
                    stacks = f.read()
            parts.append(f"--- rank {r}: ended by {ended}, no Python exception ---\n{stacks}")
        elif proc.exitcode is None:
            parts.append(f"--- rank {r}: still running when the run failed (stopped here) ---")
    return "\n".join(parts)


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """``zerograph.fake_world`` for a test in the pytest process.

    Earlier in-process tests leave behind the world-1 gloo group that ``zerograph.compile``
    creates without a launcher; it is dropped first (a later test creates a new one), and
    Dynamo's caches are reset so one process may compile many models of one class.
    """
    if dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo":
        dist.destroy_process_group()
    torch._dynamo.reset()
    with zerograph.fake_world(world_size, rank) as group:
        yield group
    torch._dynamo.reset()


def run_as_rank(fn: Callable, world_size: int, *args: Any, rank: int = 0) -> Any:
    """``fn(rank, world_size, *args)`` (a ``spawn`` worker) as rank ``rank`` of a fake world of
    ``world_size`` in this process: its graphs, shards and accounting are that rank's; every value
    that went through a collective is meaningless (``zerograph.fake_world``)."""
    with fake_rank(world_size, rank):
        return fn(rank, world_size, *args)
