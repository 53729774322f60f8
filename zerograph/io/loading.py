"""Weights into a compiled model's shards: plain state dicts and safetensors files (the record of
which tensors of a meta-built model have received no values yet is ``uninitialised.py``).

Every rank reads the full names and shapes but copies only the rows its ``Shard(0)`` shard covers
(``ParamLayout.rank_rows``); no communication is needed because every rank can see the source.
Both loaders check everything first (keys, shapes, file headers) and copy only when all of it fits,
so a bad input leaves the model's previous values in place.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import ShardingError, ZeroGraphError
from ..runtime.state import runtime_of_model
from ..shard.sharding import ParamLayout
from ..shard.uninitialised import UninitialisedTracker, allocate_meta_buffers_, listed

# UninitialisedTracker and allocate_meta_buffers_ live in uninitialised.py; api.compile reads them here
__all__ = ["LoadError", "UninitialisedTracker", "allocate_meta_buffers_", "load_safetensors", "load_state_dict",
           "local_rows"]

SAFETENSORS_INDEX = "model.safetensors.index.json"  # what save_pretrained writes for a sharded checkpoint
SAFETENSORS_SINGLE = "model.safetensors"


class LoadError(ZeroGraphError, RuntimeError):
    """A state dict or a safetensors checkpoint does not fit the model (missing or unexpected keys,
    shapes), or a file cannot be read. Raised before anything is copied. A ``RuntimeError``, like
    ``nn.Module.load_state_dict``'s own error, whose message format it keeps."""


# -- where this rank's rows are ------------------------------------------------------------------
def local_rows(model: nn.Module) -> dict[int, tuple[ParamLayout, int, int]]:
    """``id(parameter) -> (layout, start, stop)``: the full rows ``[start, stop)`` this rank's shard
    of each parameter holds (all rows for a replicated one). ``model`` must be compiled."""
    runtime = runtime_of_model(model)
    by_fqn = {layout.fqn: layout for layout in runtime.layouts.values()}
    rows = {}
    for name, param in model.named_parameters():  # a tied parameter once, under its first name (= fqn)
        layout = by_fqn[name]
        if layout.sharded:
            total = layout.shape[0]
            start = min(runtime.topology.rank * layout.chunk_rows, total)
            rows[id(param)] = (layout, start, start + layout.rank_rows[runtime.topology.rank])
        else:
            rows[id(param)] = (layout, 0, layout.shape[0] if layout.shape else 1)
    return rows


def _own_rows(full: torch.Tensor, layout: ParamLayout, start: int, stop: int) -> torch.Tensor:
    return full[start:stop] if layout.sharded else full


# -- model.load_state_dict(full plain tensors) ---------------------------------------------------
def load_state_dict(self: nn.Module, state_dict: Mapping[str, Any], strict: bool = True,
                    assign: bool = False) -> _IncompatibleKeys:
    """``nn.Module.load_state_dict`` for a compiled model: full, plain tensors go into the shards.

    Installed on the compiled model's class. Each rank copies only its own rows of each full
    tensor (``DTensor`` values, as ``torch.distributed.checkpoint`` passes them, are copied
    shard to shard as before). ``strict`` and the error messages are ``nn.Module``'s; unlike
    ``nn.Module``, every key and shape is checked before the first copy, so a failed load changes
    nothing. Keys are the unwrapped model's (tied parameters under each of their names).

    Raises:
        LoadError: missing or unexpected keys (``strict``), a shape mismatch (both shapes named),
            or a value that is not a tensor; nothing was copied.
        ShardingError: ``assign=True``, which would replace the shards instead of filling them.

    Source: ``torch.nn.Module.load_state_dict``; ``DTensor``'s ``distribute_tensor`` without the
    scatter (every rank holds the full tensor, so each slices its own rows).
    """
    if assign:
        raise ShardingError("load_state_dict(assign=True) would replace the compiled model's DTensor shards by "
                            "the given tensors; call it without assign, which copies into the shards")
    expected = self.state_dict(keep_vars=True)  # the shards themselves: no communication
    given = dict(state_dict)
    errors = _key_errors(expected.keys(), given.keys(), strict)
    for key in expected.keys() & given.keys():
        value, target = given[key], expected[key]
        if not isinstance(target, torch.Tensor):
            continue  # _extra_state: nn.Module's own logic handles it
        if not torch.overrides.is_tensor_like(value):
            errors.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
                          f"object from checkpoint but received {type(value)}")
        elif not _shape_fits(value.shape, target.shape):
            errors.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                          f"the shape in current model is {target.shape}.")
    if errors:
        raise LoadError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(errors)
                        + "\nNothing was loaded.")
    rows = local_rows(self)
    for key in expected.keys() & given.keys():
        value, target = given[key], expected[key]
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            layout, start, stop = rows[id(target)]
            full = value.detach().reshape(target.shape)  # the (1,) -> 0-d rule, else a no-op
            own = _own_rows(full, layout, start, stop).to(target.device)
            given[key] = DTensor.from_local(own, target.device_mesh, target.placements, run_check=False,
                                            shape=target.shape, stride=target.stride())
    return nn.Module.load_state_dict(self, given, strict=strict)


def _shape_fits(source: torch.Size, target: torch.Size) -> bool:
    # nn.Module's backward-compatibility rule: a (1,) tensor loads into a 0-d parameter
    return source == target or (len(target) == 0 and tuple(source) == (1,))


def _key_errors(expected: Any, given: Any, strict: bool, *, satisfied: set[str] = frozenset()) -> list[str]:
    """nn.Module's missing / unexpected key messages (empty unless ``strict``); ``satisfied`` names
    expected keys that count as present (an alias of a tied tensor that is present)."""
    if not strict:
        return []
    given_set = set(given)
    missing = [k for k in expected if k not in given_set and k not in satisfied]
    expected_set = set(expected)
    unexpected = [k for k in given if k not in expected_set]
    errors = []
    if missing:
        errors.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    return errors


# -- safetensors -----------------------------------------------------------------------------------
def load_safetensors(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> _IncompatibleKeys:
    """Load a safetensors checkpoint into a compiled model's shards, reading only this rank's rows.

    ``path`` is a ``.safetensors`` file, a ``model.safetensors.index.json`` (a sharded checkpoint,
    as Hugging Face's ``save_pretrained`` writes it), or a directory holding either. Names are the
    model's ``state_dict`` keys; a tied parameter needs only one of its names in the files (as
    ``save_pretrained`` stores shared tensors once). Each sharded parameter is read with
    safetensors' slice API (``safe_open(file).get_slice(name)[start:stop]``), so a rank reads and
    holds its own rows only; replicated tensors (stage 0, 0-d parameters, buffers) are read
    whole. Peak host memory per rank: its shard of the largest tensor being copied, or the largest
    replicated tensor. Values are cast to the parameters' dtypes. Not collective: every rank reads
    the files itself (they must be visible to every rank).

    Every file's header, every name and every shape are checked before the first copy, so a bad
    file leaves the model as it was.

    Args:
        model: a model returned by ``zerograph.compile`` (meta-built or not).
        path: file, index file or directory, as above.
        strict: as ``nn.Module.load_state_dict``: missing and unexpected names are errors.

    Returns:
        ``(missing_keys, unexpected_keys)`` like ``load_state_dict`` (empty under ``strict``).

    Raises:
        LoadError: no checkpoint at ``path``; a file truncated, or with a header safetensors
            cannot parse (the file is named); an index naming a missing file or a tensor its file
            lacks; missing / unexpected names (``strict``); a shape that differs from the model's.
        ShardingError: ``model`` was not compiled by zerograph.

    Source: ``safetensors.safe_open`` / ``get_slice`` (the lazy, sliceable reads FSDP and
    Hugging Face's ``from_pretrained`` use); the index format is Hugging Face's.
    """
    rows = local_rows(model)
    files = _checkpoint_files(os.fspath(path))
    with contextlib.ExitStack() as open_files:
        handles, where, shapes = _open_checkpoint(open_files, files)
        expected = model.state_dict(keep_vars=True)
        present, satisfied = _check_checkpoint(expected, where, shapes, strict,
                                               f"safetensors {os.fspath(path)!r} into {type(model).__name__}")
        _copy_own_rows(expected, present, handles, where, shapes, rows)
    missing = [k for k in expected if k not in present and k not in satisfied]
    return _IncompatibleKeys(missing, [k for k in where if k not in expected])


def _open_checkpoint(open_files: contextlib.ExitStack, files: dict[str, list[str] | None]) -> tuple[dict, dict, dict]:
    """Open every file (closed with ``open_files``) and read its header: ``(handles by file, file by
    tensor name, shape by tensor name)``. Raises ``LoadError`` for a file safetensors cannot read or
    one that lacks a name its index maps to it."""
    from safetensors import SafetensorError, safe_open  # imported only when loading

    handles, where, shapes = {}, {}, {}
    for file, names in files.items():
        try:
            handle = open_files.enter_context(safe_open(file, framework="pt", device="cpu"))
        except (SafetensorError, OSError) as exc:
            raise LoadError(f"cannot read the safetensors file {file!r} (truncated, or not a safetensors "
                            f"file?): {exc}. Nothing was loaded.") from exc
        handles[file] = handle
        keys = set(handle.keys())
        lacking = [n for n in (names or ()) if n not in keys]
        if lacking:
            raise LoadError(f"the index maps {listed(lacking)} to {file!r}, which does not hold them. "
                            "Nothing was loaded.")
        for name in (names if names is not None else keys):
            where[name] = file
            shapes[name] = torch.Size(handle.get_slice(name).get_shape())
    return handles, where, shapes


def _check_checkpoint(expected: Mapping[str, Any], where: dict[str, str], shapes: dict[str, torch.Size],
                      strict: bool, what: str) -> tuple[set[str], set[str]]:
    """The model's keys the files hold (``present``) and those that count as present through a tied
    alias (``satisfied``). Raises ``LoadError`` listing every missing or unexpected key (``strict``)
    and every shape that differs from the model's; ``what`` names the load in the message."""
    aliases = _aliases(expected)
    present = {k for k in expected if k in where}
    satisfied = {k for k in expected if aliases[k] & present}
    errors = _key_errors(expected.keys(), where.keys(), strict, satisfied=satisfied)
    for key in sorted(present):
        if isinstance(expected[key], torch.Tensor) and not _shape_fits(shapes[key], expected[key].shape):
            errors.append(f"size mismatch for {key}: copying a param with shape {shapes[key]} from checkpoint "
                          f"{where[key]!r}, the shape in current model is {expected[key].shape}.")
    if errors:
        raise LoadError(f"Error(s) in loading {what}:\n\t" + "\n\t".join(errors) + "\nNothing was loaded.")
    return present, satisfied


def _copy_own_rows(expected: Mapping[str, Any], present: set[str], handles: dict, where: dict[str, str],
                   shapes: dict[str, torch.Size], rows: dict[int, tuple[ParamLayout, int, int]]) -> None:
    """Copy each present tensor (a tied one once) into the model: a sharded parameter's own rows,
    read by slice, anything else whole."""
    done: set[int] = set()
    with torch.no_grad():
        for key in sorted(present):
            target = expected[key]
            if not isinstance(target, torch.Tensor) or id(target) in done:
                continue
            done.add(id(target))
            handle = handles[where[key]]
            if isinstance(target, DTensor):
                layout, start, stop = rows[id(target)]
                own = (handle.get_slice(key)[start:stop] if layout.sharded and len(shapes[key])
                       else handle.get_tensor(key).reshape(target.shape))
                target.to_local().copy_(own)
            else:
                target.copy_(handle.get_tensor(key).reshape(target.shape))


def _aliases(expected: Mapping[str, Any]) -> dict[str, set[str]]:
    """Each state-dict key -> every key of the same tensor object (a tied parameter's names)."""
    by_id: dict[int, set[str]] = {}
    for key, value in expected.items():
        by_id.setdefault(id(value), set()).add(key)
    return {key: by_id[id(value)] for key, value in expected.items()}


def _checkpoint_files(path: str) -> dict[str, list[str] | None]:
    """``file -> names the index assigns to it`` (``None``: every tensor the file holds)."""
    if os.path.isdir(path):
        for candidate in (SAFETENSORS_INDEX, SAFETENSORS_SINGLE):
            if os.path.isfile(os.path.join(path, candidate)):
                return _checkpoint_files(os.path.join(path, candidate))
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if len(found) == 1:
            return {os.path.join(path, found[0]): None}
        raise LoadError(f"no {SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE} in {path!r}"
                        + (f", and several .safetensors files ({listed(found)}): pass one" if found else ""))
    if not os.path.isfile(path):
        raise LoadError(f"no safetensors checkpoint at {path!r}")
    if not path.endswith(".json"):
        return {path: None}
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"cannot read the safetensors index {path!r}: {exc!r}") from exc
    directory = os.path.dirname(path)
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(os.path.join(directory, file), []).append(name)
    absent = [f for f in files if not os.path.isfile(f)]
    if absent:
        raise LoadError(f"the index {path!r} names files that do not exist: {listed(absent)}. Nothing was loaded.")
    return files
