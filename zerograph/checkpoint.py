"""Sharded checkpoints of a compiled model and its optimizer, resumable at another world size.

Saving and loading are ``torch.distributed.checkpoint`` (DCP) over the state dicts of
``torch.distributed.checkpoint.state_dict``: each rank writes only its own ``DTensor`` shards, and
the checkpoint's metadata records every shard's global offsets, so a job with another world size
loads by reading the byte ranges that its new ``Shard(0)`` layout covers (DCP's resharding; nothing
here re-cuts tensors). Parameters with ``requires_grad=False`` (frozen weights) are saved and
loaded like the others; optimizer state is keyed by parameter name, not by position.

Atomicity: a checkpoint is written into a sibling directory ``<path>.incomplete``; after every rank
finished writing, group rank 0 writes a completion marker into it and renames it to ``path``
(``os.replace``, atomic on POSIX within one file system). A crash at any point leaves at ``path``
the previous complete checkpoint, the new complete one, or nothing (then the previous one waits in
``<path>.replaced``), and ``load`` refuses a directory without the marker.

Buffers (e.g. BatchNorm running statistics) are plain tensors, one copy per rank; DCP saves one
rank's copy and every rank loads it (as with FSDP2 and DDP checkpoints).

An optimizer that has taken no step is saved without state: ``get_state_dict`` would otherwise
initialise it with a zero-learning-rate step, and AdamW's step count would start at 1 in both the
running job and every job resumed from the checkpoint.

Source: ``torch.distributed.checkpoint.save`` / ``load`` and ``state_dict.get_state_dict`` /
``set_state_dict`` (the route FSDP2 documents); the write-then-rename commit of a directory is the
usual way to make a multi-file write appear all at once.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from .state import state_of
from .errors import ZeroGraphError

MARKER = ".zerograph_complete"  # written last, inside the checkpoint directory
FORMAT_VERSION = 1
_INCOMPLETE_SUFFIX = ".incomplete"
_REPLACED_SUFFIX = ".replaced"


class CheckpointError(ZeroGraphError):
    """A checkpoint directory is missing, was never completed, or does not fit the model."""


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to the directory ``path``.

    Collective: every rank of the model's process group must call it with the same ``path`` on a
    file system they all see. Each rank writes its own parameter and optimizer-state shards
    (DCP's ``.distcp`` files); an existing checkpoint at ``path`` is replaced only once the new
    one is complete. Saving never changes the model or the optimizer.

    Args:
        model: a model returned by ``zerograph.compile``.
        optimizer: the optimizer over ``model.parameters()``. One that has taken no step yet is
            saved without state (``load`` then leaves the loading optimizer without state too).
        path: the checkpoint directory to create or replace.

    Raises:
        ShardingError: ``model`` was not compiled by zerograph.
    """
    group = state_of(model).runtime.group
    path = os.fspath(path)
    staging = path + _INCOMPLETE_SUFFIX
    if _is_coordinator(group):
        shutil.rmtree(staging, ignore_errors=True)  # left over from an interrupted save
    dist.barrier(group=group)
    has_state = bool(optimizer.state)
    model_state, optim_state = get_state_dict(model, optimizer)
    if not has_state:
        # get_state_dict filled the empty state with a zero-learning-rate step (AdamW's step
        # count becomes 1); undo it, or the next real step would use the wrong bias correction
        optimizer.state.clear()
        optim_state = {"state": {}, "param_groups": optim_state["param_groups"]}
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=staging, process_group=group)
    dist.barrier(group=group)  # every rank's shards are on disk before the commit
    if _is_coordinator(group):
        _write_marker(staging, {"format": FORMAT_VERSION, "world_size": dist.get_world_size(group),
                                "stage": state_of(model).runtime.stage, "optimizer_state": has_state})
        _commit(staging, path)
    dist.barrier(group=group)  # no rank returns before ``path`` is the new checkpoint


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Restore ``model`` and ``optimizer`` in place from the checkpoint directory ``path``.

    Collective, like ``save``. The model and optimizer must have the same parameter names (and
    optimizer class) as the saved ones; the world size and stage may differ: each rank reads the
    rows its own shards cover. The optimizer gets the saved state and hyperparameters; when the
    saved optimizer had taken no step, its state is emptied and its hyperparameters are kept.

    Raises:
        CheckpointError: ``path`` does not exist or holds no completion marker (a save that was
            interrupted, or a directory not written by ``zerograph.checkpoint.save``), or its
            tensors do not fit the model (other names), on every rank.
        ShardingError: ``model`` was not compiled by zerograph.
    """
    group = state_of(model).runtime.group
    path = os.fspath(path)
    problem = _completeness_problem(path)
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)  # all ranks raise together, none waits
    reported = next((p for p in problems if p is not None), None)
    if reported is not None:
        raise CheckpointError(reported)
    if _read_marker(path).get("optimizer_state", True):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        _read_shards(state, path, group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}
        _read_shards(state, path, group)
        set_model_state_dict(model, state["model"])
        optimizer.state.clear()


def full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's unsharded state dict as plain tensors, for export (e.g. ``torch.save`` or a
    plain ``nn.Module.load_state_dict``).

    Collective (every parameter is all-gathered). The behaviour is FSDP2's
    ``StateDictOptions(full_state_dict=True, cpu_offload=...)``:

    - ``cpu_offload=True`` (default): only group rank 0 receives the tensors, on the CPU; every
      other rank gets ``{}``, so a large model is materialised once, not once per rank.
    - ``cpu_offload=False``: every rank receives the full tensors on the parameters' device.

    Keys are the model's ``state_dict`` keys (tied parameters appear under each of their names);
    values have the full (unsharded) shapes and the parameters' dtypes. Buffers are this rank's.

    Raises:
        ShardingError: ``model`` was not compiled by zerograph.
    """
    state_of(model)  # fail clearly on a model zerograph did not compile
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(model, options=options)


def _read_shards(state: dict, path: str, group: dist.ProcessGroup) -> None:
    """Fill the template ``state`` (this rank's shards) in place from the checkpoint at ``path``."""
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except dcp.CheckpointException as exc:  # DCP gathers every rank's failure, so all ranks raise
        raise CheckpointError(f"the checkpoint at {path!r} does not fit this model and optimizer "
                              f"(other parameter names or optimizer class?): {exc}") from exc


def _is_coordinator(group: dist.ProcessGroup) -> bool:
    return dist.get_rank(group) == 0


def _write_marker(directory: str, contents: dict) -> None:
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump(contents, f)
        f.flush()
        os.fsync(f.fileno())  # the marker must not reach the disk after the rename does


def _read_marker(path: str) -> dict:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def _commit(staging: str, path: str) -> None:
    """Make ``staging`` appear as ``path`` in one rename; a previous checkpoint there is moved
    aside first (a directory cannot be renamed onto a non-empty one) and deleted after."""
    replaced = path + _REPLACED_SUFFIX
    if os.path.exists(path):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)
    os.replace(staging, path)
    _fsync_directory(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(replaced, ignore_errors=True)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _completeness_problem(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` when it is."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return None
    if os.path.isdir(path):
        return (f"{path!r} has no completion marker ({MARKER}): its save was interrupted or it was not "
                "written by zerograph.checkpoint.save; refusing to load it. Resume from an earlier checkpoint.")
    if os.path.isdir(path + _INCOMPLETE_SUFFIX):
        return (f"no checkpoint at {path!r}, only {path + _INCOMPLETE_SUFFIX!r}, the remains of a save that "
                "was interrupted; refusing to load it. Resume from an earlier checkpoint.")
    if os.path.isdir(path + _REPLACED_SUFFIX):
        return (f"no checkpoint at {path!r}: a save was interrupted while replacing it; the previous complete "
                f"checkpoint is {path + _REPLACED_SUFFIX!r} (rename it back to load it)")
    return f"no checkpoint at {path!r}"
