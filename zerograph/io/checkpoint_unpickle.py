"""Reading a DCP checkpoint without running code from it: allow-listed unpickling.

A DCP checkpoint holds two kinds of pickles: the ``.metadata`` file (``pickle.dump`` of a
``Metadata``, protocol 4) and each non-tensor value of the state dict (``torch.save`` inside a
``.distcp`` file, e.g. an optimizer's ``lr`` or ``betas``). DCP's ``FileSystemReader`` and
``DefaultLoadPlanner`` read both with a full unpickler, which runs whatever a tampered file asks
for. Here:

- ``.metadata`` is read by ``pickle.Unpickler`` whose ``find_class`` admits only the classes of
  DCP's metadata (``_ADMITTED``), torch dtypes and ``torch.Size``: anything else is refused by name
  before its module is imported or anything of it is called. torch's own ``weights_only``
  unpickler cannot be reused for this file: it reads pickle protocol 2 only.
- non-tensor values are read by ``torch.load(weights_only=True)`` (plain Python data, tensors,
  and what the user admitted with ``torch.serialization.add_safe_globals``).

Tensors were already read with ``weights_only=True`` by DCP.

Source: the "Restricting Globals" recipe of Python's ``pickle`` documentation; ``torch.load``'s
``weights_only`` for the values; ``FileSystemReader.read_metadata`` and
``DefaultLoadPlanner.load_bytes`` are the methods replaced.
"""
from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .checkpoint_agreement import CheckpointError

# What DCP's FileSystemWriter puts in ``.metadata``: the metadata dataclasses, the storage location
# of each item, the path it was saved to (``StorageMeta.checkpoint_id``), and TensorProperties'
# encoding of a layout and a memory format. Constructing any of them runs no user code.
_ADMITTED: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__qualname__): cls for cls in (
        metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
        metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo,
        torch.Size, torch.serialization._get_layout)
}
for _module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes into pathlib._local
    _ADMITTED[(_module, "PosixPath")] = pathlib.PosixPath
# a dtype pickles as its name in ``torch``; vars(), not getattr: torch's module __getattr__ imports
_ADMITTED.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``; any other global raises ``CheckpointError`` naming it."""

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        admitted = _ADMITTED.get((module, name))
        if admitted is None:
            raise CheckpointError(
                f"the DCP metadata of {self._source!r} holds a {module}.{name}, which DCP metadata never does; "
                "refusing to unpickle it (nothing of it was run). The checkpoint was tampered with or written "
                "by a custom DCP planner; admitted are DCP's metadata classes, torch.Size, dtypes and paths")
        return admitted


class RestrictedFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` that runs no code from the checkpoint: ``read_metadata`` admits only
    DCP's metadata types, and ``read_data`` reads the non-tensor values (through the planner's
    ``load_bytes``) before any tensor.

    Pass it as ``dcp.load(..., storage_reader=RestrictedFileSystemReader(path))``, with a
    ``WeightsOnlyLoadPlanner``. It reads any checkpoint written by DCP's ``FileSystemWriter`` with
    the default planner.

    Raises:
        CheckpointError: the metadata names a class outside DCP's metadata (the message names it),
            or unpickles to something other than a ``Metadata``.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            loaded = _MetadataUnpickler(file, str(self.path)).load()
        if not isinstance(loaded, metadata.Metadata):
            raise CheckpointError(f"the DCP metadata of {str(self.path)!r} holds a {type(loaded).__name__}, "
                                  "not a torch.distributed.checkpoint Metadata")
        if loaded.storage_meta is None:  # as DCP's read_metadata: older checkpoints have none
            loaded.storage_meta = metadata.StorageMeta()
        loaded.storage_meta.load_id = self.load_id
        return loaded

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``read_data``, non-tensor values first: a value refused by ``WeightsOnlyLoadPlanner``
        stops the load before any tensor of the state dict is overwritten."""
        values = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        tensors = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        super().read_data(dataclasses.replace(plan, items=values), planner).wait()
        return super().read_data(dataclasses.replace(plan, items=tensors), planner)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: a value holds a type that ``weights_only`` does not admit (the message
            names the key and the type; nothing of it was run).
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:  # the scan names what torch.load's weights_only refusal would bury in a long message
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(value)
            value.seek(0)
            loaded = None if refused else torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"the saved value of {fqn!r} is corrupt or not plain data: {exc}") from exc
        if refused:
            raise CheckpointError(
                f"the saved value of {fqn!r} holds {', '.join(sorted(refused))}, which torch.load(weights_only=True) "
                "does not admit; refusing to unpickle it (nothing of it was run). Tampered with, or a value of "
                "your own type: torch.serialization.add_safe_globals admits a type you trust")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
