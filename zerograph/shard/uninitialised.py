"""Which tensors of a meta-built model have received no values yet (``UninitialisedTracker``), and
the storage ``compile`` gives its buffers (``allocate_meta_buffers_``).

Its own module so that ``state`` (which holds the tracker) and ``loading`` (which reads the state)
do not import each other.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ShardingError


class UninitialisedTracker:
    """The parameters and buffers that ``compile`` allocated empty for a meta-built model, until
    something writes them (``init_weights``, ``load_state_dict``, ``load_safetensors``, a DCP load).

    A write is seen through the tensor's version counter, which every in-place op bumps, so any
    loader counts without telling this class. The shards of a unit in one flat buffer
    (``Config(unit_templates=True)``, ``flat.py``) are views of it and share its counter, so a
    write to one moves the counter of all: those (``shared``) are filled with NaN here and count
    as unwritten while every element of their local shard still is NaN (a rank whose shard has
    no rows cannot tell, and goes by the counter). The compiled forward calls ``check`` while
    entries remain: O(entries) per forward (plus a read of each shared shard's rows) until all
    are written, then nothing.
    """

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], shared: frozenset[int] = frozenset()) -> None:
        self.shared = shared
        with torch.no_grad():
            for _, t in tensors:
                if id(t) in self.shared and t.is_floating_point():
                    _local(t).fill_(float("nan"))
        self.entries = [(name, t, versions(t)) for name, t in tensors]

    def _unwritten(self, t: torch.Tensor, version: tuple[int, int]) -> bool:
        now = versions(t)
        if now == version:
            return True
        if id(t) not in self.shared or now[0] != version[0] or not t.is_floating_point():
            return False  # a write through the DTensor itself is this tensor's own
        local = _local(t)  # only the shared counter moved: a write to this shard, or to a neighbour
        return local.numel() > 0 and bool(torch.isnan(local).all())

    def unwritten(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of the tracked tensors and holds no values yet."""
        return any(t is tensor and self._unwritten(t, v) for _, t, v in self.entries)

    def pending(self) -> list[str]:
        """Names not written yet (a written tensor is dropped for good)."""
        self.entries = [(n, t, v) for n, t, v in self.entries if self._unwritten(t, v)]
        return [n for n, _, _ in self.entries]

    def check(self) -> None:
        """Raise ``ShardingError`` naming the tensors that hold no values yet."""
        names = self.pending()
        if names:
            raise ShardingError(
                f"the model was built on the meta device and {len(names)} of its tensors were never "
                f"initialised ({listed(names)}): their shards hold uninitialised memory. Call "
                "zerograph.init_weights(model) (or load weights: model.load_state_dict(...), "
                "zerograph.load_safetensors(model, path)) before running it")


def versions(tensor: torch.Tensor) -> tuple[int, int]:
    """Version counters of a tensor and of its local shard (the same for a plain tensor). Both are
    needed: an in-place op through ``DTensor`` dispatch (``shard.copy_(dtensor)``) bumps the
    DTensor's only, one on ``to_local()`` (a view of the shard) the local tensor's only."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor._version, tensor.to_local()._version
    return tensor._version, tensor._version


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a ``DTensor``'s own local tensor: ``to_local()`` may make a new view)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def listed(names: list[str], limit: int = 6) -> str:
    """The first ``limit`` of ``names`` quoted, and how many more, for an error message."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def allocate_meta_buffers_(model: nn.Module, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Give every buffer of a meta-built ``model`` storage on ``device``, in place: meta buffers
    become uninitialised tensors of their shape and dtype (returned, by first name, for the
    ``UninitialisedTracker``); buffers with values are moved there. Shared buffers stay shared."""
    new_of: dict[int, torch.Tensor] = {}
    fresh = []
    for mod_name, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None:
                continue
            if id(buf) not in new_of:
                new_of[id(buf)] = torch.empty_like(buf, device=device) if buf.is_meta else buf.to(device)
                if buf.is_meta:
                    fresh.append((f"{mod_name}.{name}" if mod_name else name, new_of[id(buf)]))
            mod._buffers[name] = new_of[id(buf)]
    return fresh
