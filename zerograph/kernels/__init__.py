"""Hand-written Triton kernels for the optimizer step and the collective buffers, each with a
plain-torch reference of the same signature.

* :func:`adamw_step` - fused AdamW over a flat fp32 shard, optionally writing a bf16 copy.
* :func:`pack` - shards -> one flat, cast, zero-padded send buffer.
* :func:`unpack` - rank-major all-gathered buffer -> full parameter tensors.
* ``torch.ops.zerograph.pack_shards`` (:mod:`.ops`) - ``pack`` as a registered operator with the
  collectives' padding and rank-major layout, for the graph passes' copy-in.
* ``torch.ops.zerograph.unpack_gathered`` (:mod:`.ops`) - ``unpack`` as a registered operator into
  one parameter-major buffer, for the all-gather's copy-out.

Dispatch: Triton for CUDA tensors, or for any tensors under ``TRITON_INTERPRET=1`` (the Triton
interpreter, which must be set before the first Triton dispatch in the process), or with
``use_triton=True``; the ``*_reference`` torch code otherwise.
"""
from ._common import interpreter_requested
from .adamw import adamw_step, adamw_step_reference
from .ops import PACK_SHARDS, UNPACK_GATHERED, pack_shards, pack_shards_numel, unpack_gathered, unpack_gathered_numel
from .packing import default_chunk_rows, pack, pack_reference, unpack, unpack_reference

__all__ = ["PACK_SHARDS", "UNPACK_GATHERED", "adamw_step", "adamw_step_reference", "default_chunk_rows",
           "interpreter_requested", "pack", "pack_reference", "pack_shards", "pack_shards_numel", "unpack",
           "unpack_gathered", "unpack_gathered_numel", "unpack_reference"]
