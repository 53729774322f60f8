"""Communication buffers allocated once and reused every step: the run-time half of ``buffer_reuse``.

``passes/buffer_reuse.py`` assigns every comm buffer of a graph (an all-gather's output, a packed
send buffer) to a numbered *slot*, so that buffers whose lifetimes overlap get different slots,
and rewrites the graph to take the buffer from the pool:

    buf = zerograph::pool_buffer(pool, role, slot, numel, dtype, device)  # a view of slot's bytes
    out = _c10d_functional.all_gather_into_tensor_out(send, N, group, out=buf)
    zerograph::pack_shards_out(shards, chunk_rows, N, out=buf)            # pack_shards into buf

A slot (a role, "gathered" or "send", and a number) is one flat byte buffer per device, allocated the first time a
graph asks for it and
grown (reallocated) only when a graph compiled later asks for more bytes; every graph of a model
shares the model's pool, which is safe because no pooled buffer outlives the graph call that
filled it (``buffer_reuse`` pools only buffers that die inside their graph, and every collective
is waited inside its graph). After the first step has run every graph, no comm buffer is
allocated again: ``BufferPool.allocations`` stops growing (the test counts it).

Source: ZeRO-R (arXiv 1910.02054) section 6.2, constant-size buffers (C_B), and section 6.3,
memory defragmentation (M_D: long-lived buffers allocated once, up front); the out= functional
collectives Inductor uses for its own comm buffer reuse (``all_gather_into_tensor_out``).
"""
from __future__ import annotations

import itertools
import os
import weakref

import torch

from ..errors import PoolCorruptionError
from ..kernels.ops import _check, _pieces, pack_shards_numel
from ..kernels.packing import pack, pack_reference

_POOLS: dict[int, "weakref.ReferenceType[BufferPool]"] = {}
_POOL_IDS = itertools.count()


class BufferPool:
    """One model's comm buffers on this rank: ``slot -> flat uint8 buffer`` per device.

    What reuse relies on, stated once. A slot is *taken* when a graph's ``pool_buffer`` node runs
    and *released* when that graph call returns; ``buffer_reuse`` gives two buffers one slot only
    when their lifetimes in the graph do not meet, and a send buffer's lifetime runs to the
    ``wait_tensor`` of its collective. So every reuse is ordered after the previous user by the
    graph itself:
    - on CPU (gloo) ``wait_tensor`` returns only when the collective finished reading and writing;
    - on CUDA (NCCL) ``wait_tensor`` makes the compute stream wait for the collective's stream, so
      the copy-out and every later compute-stream write come after it; and ProcessGroupNCCL makes
      its stream wait for the current stream before it launches a collective, so a collective that
      writes into a slot starts after the compute stream's last read of the slot's previous
      buffer. No ``record_stream`` is needed: the slots never return to the caching allocator
      while the pool lives, so no other tensor can be handed their memory behind a stream's back.
    - No pooled buffer may outlive its graph call (``buffer_reuse`` pools only buffers that die
      inside the graph; under Inductor, whose memory planner could hand a dead buffer's storage
      to an output, the pool is off).
    ``ZEROGRAPH_DEBUG_POOL=1`` checks these guarantees at run time: when a graph call returns, its
    slots are filled with ``POISON``; when a slot is taken again, its bytes must still be the
    poison, or ``PoolCorruptionError`` names the slot (something wrote into it after release). A
    tensor that wrongly outlives its graph in a slot reads poison, so parity tests fail loudly.

    Attributes:
        id: the number graphs name this pool by (an int node argument).
        allocations: buffers allocated so far (first use of a slot, or growth).
        buffers: ``(role, slot, device) -> torch.uint8`` tensor of the slot's bytes.
        debug: the poison-and-check mode is on.
    """

    POISON = 0xA5  # a byte pattern no collective of the tests produces across a whole slot

    def __init__(self, debug: bool | None = None) -> None:
        self.id = next(_POOL_IDS)
        self.allocations = 0
        self.buffers: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        self.debug = os.environ.get("ZEROGRAPH_DEBUG_POOL", "0") not in ("", "0") if debug is None else debug
        self._poisoned: set[tuple[str, int, torch.device]] = set()
        _POOLS[self.id] = weakref.ref(self)

    def release_all(self) -> None:
        """A graph call returned: its slots are free. Debug mode: poison every taken slot."""
        if not self.debug:
            return
        for key, buf in self.buffers.items():
            if key not in self._poisoned:
                buf.fill_(self.POISON)
                self._poisoned.add(key)

    def _check_untouched(self, key: tuple[str, int, torch.device], buf: torch.Tensor) -> None:
        """Debug mode: the slot still holds the poison it got at release (or raise)."""
        if key in self._poisoned:
            self._poisoned.discard(key)
            written = int((buf != self.POISON).sum())
            if written:
                raise PoolCorruptionError(
                    f"pooled comm buffer slot {key[1]} ({key[0]!r}, {key[2]}) was written after its graph "
                    f"released it ({written} of {buf.numel()} bytes changed): an asynchronous collective "
                    "outlived its wait, or a tensor outlived its graph in pooled memory")

    def nbytes(self, role: str | None = None) -> int:
        """Bytes held by the pool: all slots, or those of one role ("gathered": all-gather outputs,
        i.e. gathered parameters; "send": packed send buffers of all-gathers and reductions)."""
        return sum(b.numel() for (r, _, _), b in self.buffers.items() if role in (None, r))

    def take(self, role: str, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Slot ``(role, slot)``'s buffer as a 1-D ``dtype`` tensor of ``numel`` elements (uninitialised).

        Byte buffers, so one slot serves collectives of any dtype; offset 0 keeps every dtype
        aligned."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        key = (role, slot, torch.device(device))
        buf = self.buffers.get(key)
        if buf is not None and self.debug:
            self._check_untouched(key, buf)
        if buf is None or buf.numel() < nbytes:
            self.buffers[key] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.allocations += 1
        return buf[:nbytes].view(dtype)


def pool_of(pool_id: int) -> BufferPool:
    pool = _POOLS.get(pool_id)
    pool = pool() if pool is not None else None
    if pool is None:
        raise RuntimeError(f"zerograph buffer pool {pool_id} no longer exists (its model was freed)")
    return pool


@torch.library.custom_op("zerograph::pool_buffer", mutates_args=())
def pool_buffer(pool: int, role: str, slot: int, numel: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Slot ``(role, slot)`` of pool ``pool`` as an uninitialised 1-D tensor of ``numel`` ``dtype`` elements.

    The result aliases the pool's storage, not any input: the graph's comm buffer, reused by the
    next graph call that takes the same slot. Raises ``RuntimeError`` if the pool's model is gone."""
    return pool_of(pool).take(role, slot, numel, dtype, device)


@pool_buffer.register_fake
def _pool_buffer_fake(pool, role, slot, numel, dtype, device):
    return torch.empty(numel, dtype=dtype, device=device)


@torch.library.custom_op("zerograph::pack_shards_out", mutates_args=("out",))
def pack_shards_out(shards: list[torch.Tensor], chunk_rows: list[int], world_size: int, out: torch.Tensor) -> None:
    """``zerograph::pack_shards`` written into ``out`` (1-D, ``pack_shards_numel`` elements, of the
    send dtype) instead of a new tensor. Returns nothing (Inductor lowers a mutating op only then):
    the collective reads ``out`` after this node, in graph order. Raises ``ValueError`` as
    ``pack_shards`` does, or when ``out`` has the wrong number of elements."""
    _check_out(shards, chunk_rows, world_size, out)
    pieces, padded = _pieces(shards, chunk_rows, world_size)
    pack_reference(pieces, padded, out.dtype, out=out)


@pack_shards_out.register_kernel("cuda")
def _pack_shards_out_cuda(shards, chunk_rows, world_size, out):
    _check_out(shards, chunk_rows, world_size, out)
    pieces, padded = _pieces(shards, chunk_rows, world_size)
    pack(pieces, padded, out.dtype, out=out)


@pack_shards_out.register_fake
def _pack_shards_out_fake(shards, chunk_rows, world_size, out):
    _check_out(shards, chunk_rows, world_size, out)


def _check_out(shards, chunk_rows, world_size, out) -> None:
    _check(shards, chunk_rows, world_size)
    if out.dim() != 1 or out.numel() != pack_shards_numel(shards, chunk_rows, world_size):
        raise ValueError(f"pack_shards_out: out has shape {tuple(out.shape)}, the packed buffer "
                         f"{pack_shards_numel(shards, chunk_rows, world_size)} elements")

POOL_BUFFER = torch.ops.zerograph.pool_buffer.default
PACK_SHARDS_OUT = torch.ops.zerograph.pack_shards_out.default
