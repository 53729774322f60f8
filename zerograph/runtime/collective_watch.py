"""The collectives' debug mode (``ZEROGRAPH_DEBUG_COLLECTIVES=1``): every functional collective's
buffers checked from its issue to its wait.

Invariant checked: an asynchronous collective owns its buffers until its ``wait_tensor`` (gloo's
thread or NCCL's stream reads the input and writes the output meanwhile); anything else that
writes either buffer, reads the output or frees either one in that window corrupts memory without
an error. ``CollectiveWatch`` is a ``TorchDispatchMode`` the runtime enters around each graph call
and eager fallback when the variable is set. At each ``_c10d_functional`` collective's issue it
records each buffer's storage (a weak reference), address range, version counter and, for inputs,
a checksum (torch ops on the tensor's own device). Then:

- an op that writes a pending collective's input or output (``out=``, in place: the schema's write
  annotation), or reads its output (any op but a view), raises at once;
- an op whose result takes the address of a pending buffer whose storage moved (a released
  ``resize_(0)`` storage handed on) or, for an output, was freed, raises at once;
- ``wait_tensor`` checks each buffer's liveness (outputs), address, size, version counter and
  input checksum; the scope's end checks that every collective issued in it was waited.

Each failure raises ``CollectiveBufferError`` naming the collective (its op and issue order in the
scope), the buffer (input or output, shape, dtype) and what happened. Writes by code that bypasses
the dispatcher (Inductor's C++ kernels, a C++ thread) are caught only at the wait. What is a fault
and what is not (an input dropped before the wait): docs/inspection.md, section "Checking the
collectives' buffers".

Source: the invariant FSDP2 and ``ProcessGroupNCCL`` rely on (``record_stream``,
``TORCH_NCCL_AVOID_RECORD_STREAMS``); ``TorchDispatchMode`` (``torch.utils._python_dispatch``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import CollectiveBufferError

ENV = "ZEROGRAPH_DEBUG_COLLECTIVES"
WAIT = torch.ops._c10d_functional.wait_tensor.default
_COLLECTIVE_NAMESPACE = "_c10d_functional"


def enabled() -> bool:
    """Whether ``ZEROGRAPH_DEBUG_COLLECTIVES`` asks for the checks (any value but empty or ``0``)."""
    return os.environ.get(ENV, "0") not in ("", "0")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``t`` may touch."""
    if t.numel() == 0:
        return (0, 0)
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return start, start + extent * t.element_size()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), ``None`` for an inference tensor."""
    return None if t.is_inference() else t._version


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 on ``t``'s device: the sum of ``t``'s bytes, and their sum weighted by position
    (mod 251, plus 1), so that a change or a move of bytes shows. Torch ops only: CPU or CUDA."""
    data = t.detach().reshape(-1).contiguous().view(torch.uint8).to(torch.int64)
    weights = torch.arange(data.numel(), device=data.device) % 251 + 1
    return torch.stack([data.sum(), (data * weights).sum()])


@dataclasses.dataclass
class Buffer:
    """One buffer of a pending collective, as it was at the collective's issue."""

    role: str  # "input" or "output"
    tensor_text: str  # shape, dtype, device
    tensor: "weakref.ReferenceType[torch.Tensor]"  # weak: the watch must not keep a freed buffer alive
    device: torch.device
    storage: StorageWeakRef
    address: tuple[int, int]  # absolute byte range in memory
    storage_nbytes: int
    version: int | None  # None: an inference tensor, which keeps no version counter
    sum: torch.Tensor | None  # inputs only (an output is the collective's to write)

    @classmethod
    def of(cls, role: str, t: torch.Tensor) -> "Buffer":
        storage = t.untyped_storage()
        start, end = _byte_range(t)
        return cls(role, f"{tuple(t.shape)} {t.dtype} on {t.device}", weakref.ref(t), t.device, StorageWeakRef(storage),
                   (storage.data_ptr() + start, storage.data_ptr() + end), storage.nbytes(), _version(t),
                   checksum(t) if role == "input" else None)

    def overlaps(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in this buffer's live storage, on bytes the buffer covers."""
        if self.storage.expired() or StorageWeakRef(t.untyped_storage()) != self.storage:
            return False
        base = t.untyped_storage().data_ptr()
        start, end = _byte_range(t)
        return start < end and base + start < self.address[1] and self.address[0] < base + end

    def takes_address(self, t: torch.Tensor) -> bool:
        """Whether ``t``, of another storage, occupies this buffer's memory: the buffer's own
        storage must have been freed or moved for the allocator to hand that memory out."""
        if t.device != self.device or StorageWeakRef(t.untyped_storage()) == self.storage:
            return False
        if self.role == "input" and self.storage.expired():  # dropped, not released: the group holds what it reads
            return False
        start, end = _byte_range(t)
        base = t.untyped_storage().data_ptr()
        return start < end and base + start < self.address[1] and self.address[0] < base + end

    def fault_at_wait(self) -> str | None:
        """What went wrong with this buffer between issue and wait, or ``None``. A buffer whose
        tensor is gone but whose storage lives (a view of it is held) is checked for being freed only."""
        if self.storage.expired():
            return "freed before the wait" if self.role == "output" else None
        t = self.tensor()
        if t is None:
            return None
        storage = t.untyped_storage()
        if storage.data_ptr() + _byte_range(t)[0] != self.address[0] or storage.nbytes() != self.storage_nbytes:
            return (f"its storage released or reallocated before the wait ({self.storage_nbytes} bytes at issue, "
                    f"{storage.nbytes()} now)")
        if _version(t) != self.version:
            return f"written in place before the wait (version {self.version} at issue, {_version(t)} now)"
        if self.sum is not None and not torch.equal(checksum(t), self.sum):
            return "its bytes changed before the wait (checksum)"
        return None


@dataclasses.dataclass
class Pending:
    """A collective issued and not yet waited."""

    name: str  # e.g. "collective #3 (_c10d_functional.all_gather_into_tensor_out.default)"
    buffers: list[Buffer]


def _tensors(values: object) -> list[torch.Tensor]:
    """The tensors among ``values`` that have bytes of their own to watch (not a subclass
    wrapper, a sparse tensor or a meta tensor)."""
    return [v for v in tree_leaves(values) if isinstance(v, torch.Tensor) and type(v) in (torch.Tensor, torch.nn.Parameter)
            and v.layout == torch.strided and v.device.type != "meta"]


# ops that read only their argument's metadata (shape, dtype, device), never its bytes
_METADATA_ONLY = frozenset({"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like",
                            "new_zeros", "new_ones", "new_full", "sym_size", "sym_stride", "sym_numel",
                            "sym_storage_offset", "is_same_size"})


def _written_and_read(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list, list]:
    """The tensor arguments ``func`` writes (schema ``(a!)``) and those it reads (all others,
    except for a view op or a metadata-only op, which read no bytes). A higher-order operator
    (no schema: ``run_and_save_rng_state`` and the like) is taken to read every tensor it gets."""
    if not isinstance(func, torch._ops.OpOverload):
        return [], _tensors((args, kwargs))
    written, read = [], []
    returns_alias = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
    returns_alias = returns_alias or func._opname in _METADATA_ONLY
    for i, arg in enumerate(func._schema.arguments):
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        tensors = _tensors(value)
        if arg.alias_info is not None and arg.alias_info.is_write:
            written += tensors
        elif not returns_alias:
            read += tensors
    return written, read


class CollectiveWatch(TorchDispatchMode):
    """The debug mode's checks over one scope (a graph call, an eager fallback) named ``scope``
    (module docstring). Raises ``CollectiveBufferError``."""

    supports_higher_order_operators = True  # graphs hold some (RNG state around a dropout)

    def __init__(self, scope: str):
        super().__init__()
        self.scope = scope
        self.pending: list[Pending] = []
        self.issued = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is WAIT:
            out = func(*args, **kwargs)
            self._waited(args[0])
            return out
        written, read = _written_and_read(func, args, kwargs)
        self._check_access(str(func), written, read)
        out = func(*args, **kwargs)
        self._check_addresses(str(func), _tensors(out))
        if getattr(func, "namespace", None) == _COLLECTIVE_NAMESPACE:
            self._issued(func, written or _tensors(out), [t for t in read if not any(t is w for w in written)])
        return out

    def _fail(self, pending: Pending, buffer: Buffer, what: str) -> None:
        self.pending.remove(pending)  # reported once; the scope's end does not report it again
        raise CollectiveBufferError(
            f"{self.scope}: {pending.name}: its {buffer.role} buffer ({buffer.tensor_text}): {what}. A collective's "
            "buffers are its own until its wait_tensor: the collective may still be reading or writing them")

    def _issued(self, func, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        name = f"collective #{self.issued} ({func})"
        self.issued += 1
        buffers = [Buffer.of("input", t) for t in inputs] + [Buffer.of("output", t) for t in outputs]
        self.pending.append(Pending(name, buffers))

    def _check_access(self, op: str, written: list[torch.Tensor], read: list[torch.Tensor]) -> None:
        for pending in list(self.pending):
            for buffer in pending.buffers:
                if any(buffer.overlaps(t) for t in written):
                    self._fail(pending, buffer, f"written by {op} before the wait")
                if buffer.role == "output" and any(buffer.overlaps(t) for t in read):
                    self._fail(pending, buffer, f"read by {op} before the wait")

    def _check_addresses(self, op: str, results: list[torch.Tensor]) -> None:
        for pending in list(self.pending):
            for buffer in pending.buffers:
                if any(buffer.takes_address(t) for t in results):
                    self._fail(pending, buffer, f"freed before the wait: {op}'s result took its memory")

    def _waited(self, t: torch.Tensor) -> None:
        storage = StorageWeakRef(t.untyped_storage())  # by storage: a released one has moved
        pending = next((p for p in self.pending if any(b.role == "output" and b.storage == storage
                                                       for b in p.buffers)), None)
        if pending is None:  # another output of a coalesced collective, already checked at its first wait
            return
        for buffer in pending.buffers:
            fault = buffer.fault_at_wait()
            if fault is not None:
                self._fail(pending, buffer, fault)
        self.pending.remove(pending)

    def check_all_waited(self) -> None:
        """The scope ended: a collective still pending had its wait dropped."""
        if self.pending:
            names = ", ".join(p.name for p in self.pending)
            self.pending.clear()
            raise CollectiveBufferError(f"{self.scope}: {names} never waited: its buffers may still be read or "
                                        "written after the scope returned (a dropped wait_tensor)")


@contextlib.contextmanager
def watching(scope: str, on: bool) -> Iterator[None]:
    """``CollectiveWatch(scope)`` around the block when ``on``; the block's end checks that every
    collective it issued was waited (unless the block raised)."""
    if not on:
        yield
        return
    watch = CollectiveWatch(scope)
    with watch:
        yield
    watch.check_all_waited()
