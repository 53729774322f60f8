"""Hand-written Triton kernels for the optimizer step and the collective buffers, each with a
plain-torch reference of the same signature.

* :func:`adamw_step` - fused AdamW over a flat fp32 shard, optionally writing a bf16 copy.
* :func:`pack` - shards -> one flat, cast, zero-padded send buffer.
* :func:`unpack` - rank-major all-gathered buffer -> full parameter tensors.

Dispatch: Triton for CUDA tensors, or for any tensors under ``TRITON_INTERPRET=1`` (the Triton
interpreter, which must be set before the first Triton dispatch in the process), or with
``use_triton=True``; the ``*_reference`` torch code otherwise.
"""
from ._common import interpreter_requested
from .adamw import adamw_step, adamw_step_reference
from .packing import default_chunk_rows, pack, pack_reference, unpack, unpack_reference

__all__ = ["adamw_step", "adamw_step_reference", "default_chunk_rows", "interpreter_requested", "pack",
           "pack_reference", "unpack", "unpack_reference"]
