"""Sharded checkpoints of a compiled model and its optimizer, resumable at another world size.

Saving and loading are ``torch.distributed.checkpoint`` (DCP) over the state dicts of
``torch.distributed.checkpoint.state_dict``: each rank writes only its own ``DTensor`` shards, and
a job of another world size loads the byte ranges its new ``Shard(0)`` layout covers (DCP's
resharding; nothing here re-cuts tensors). Optimizer state is keyed by parameter name.

Guarantees (docs/checkpoints.md tells them in full; every check runs on every rank, and every
rank raises the same ``CheckpointError`` when one finds a problem, so no rank waits for a peer
that gave up):

- complete or absent: written into ``<path>.incomplete``, marked complete last, renamed over
  ``path``; only a previous zerograph checkpoint, an empty directory or zerograph's own leftovers
  are ever replaced, anything else is refused before any byte is written;
- verified at load: the marker, every file's size and ``XXH3-128`` digest, then a strict fit both
  ways, as ``nn.Module.load_state_dict``;
- no code from the checkpoint runs at load: its pickles are read with allow-lists
  (``io.checkpoint_unpickle``).

Source: ``torch.distributed.checkpoint.save`` / ``load`` and ``state_dict.get_state_dict`` /
``set_state_dict`` (the route FSDP2 documents); the write-then-rename commit of a directory is the
usual way to make a multi-file write appear all at once.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .io.checkpoint_agreement import CheckpointError, agree, attempt, dcp_call, gather, group_of, raise_first
from .io.checkpoint_unpickle import RestrictedFileSystemReader, WeightsOnlyLoadPlanner
from .runtime.state import state_of

log = logging.getLogger(__name__)

MARKER = ".zerograph_complete"  # written last, inside the checkpoint directory
STAGING_TAG = ".zerograph_staging"  # written first into <path>.incomplete: the staging dir is ours
TOKEN_PREFIX = ".zerograph_rank"  # one per rank: proves every rank's files are visible to every rank
FORMAT_VERSION = 2  # 2: the marker lists every file's size and XXH3-128 digest; 1 (no digests) still loads
CHECKSUM = "xxh3_128"
_INCOMPLETE_SUFFIX = ".incomplete"
_REPLACED_SUFFIX = ".replaced"
_LISTED = 8  # keys named in a misfit message


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Write a sharded checkpoint of ``model`` and ``optimizer`` to the directory ``path``.

    Collective: every rank of the model's process group must call it with the same ``path`` on a
    file system they all see. Each rank writes its own parameter and optimizer-state shards
    (DCP's ``.distcp`` files); an existing zerograph checkpoint at ``path`` is replaced only once
    the new one is complete. Saving never changes the model or the optimizer.

    Args:
        model: a model returned by ``zerograph.compile``.
        optimizer: the optimizer over ``model.parameters()``. One that has taken no step yet is
            saved without state (``load`` then leaves the loading optimizer without state too).
        path: the checkpoint directory to create or replace.

    Raises:
        CheckpointError: on every rank, before any byte is written, when ``path`` (or
            ``<path>.incomplete`` / ``<path>.replaced``) exists and is not a zerograph checkpoint
            or zerograph's leftover, or ranks passed different paths; later, when ranks do not see
            each other's files, or writing failed (DCP's ``CheckpointException``, an ``OSError``).
        CollectiveError: a peer rank died or stopped during the save.
        ShardingError: ``model`` was not compiled by zerograph.
        ProcessGroupError: the model's process group was destroyed.
    """
    group = group_of(model)
    from .runtime.fake import refuse_in_fake_world  # fake-world guard (zerograph/runtime/fake.py): values are meaningless
    refuse_in_fake_world("zerograph.checkpoint.save", group)
    path = os.fspath(path)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    staging = path + _INCOMPLETE_SUFFIX
    views = gather(group, (path, attempt(lambda: _target_problem(path)), uuid.uuid4().hex), "agreeing on the path")
    paths = [view[0] for view in views]
    if len(set(paths)) > 1:
        other = next(r for r, p in enumerate(paths) if p != paths[0])
        raise CheckpointError(f"ranks passed different paths to checkpoint.save: rank 0 {paths[0]!r}, rank {other} "
                              f"{paths[other]!r}; every rank must pass the same path, on a file system all ranks share")
    raise_first([view[1] for view in views])
    nonce = views[0][2]  # rank 0's: tokens of an earlier save cannot pass for this one's
    agree(group, attempt(lambda: _prepare_staging(staging)) if rank == 0 else None, "preparing the save")
    agree(group, attempt(lambda: _write_token(staging, rank, nonce)), "preparing the save")
    has_state = bool(optimizer.state)
    model_state, optim_state = get_state_dict(model, optimizer)
    if not has_state:
        # get_state_dict filled the empty state with a zero-learning-rate step (AdamW's step
        # count becomes 1); undo it, or the next real step would use the wrong bias correction
        optimizer.state.clear()
        optim_state = {"state": {}, "param_groups": optim_state["param_groups"]}
    dcp_call(lambda: dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=staging,
                               process_group=group), f"writing the checkpoint to {staging!r}")
    # every rank sees every rank's token, then hashes its share of the files; rank 0 gets all digests
    shares = gather(group, attempt(lambda: _hash_share(staging, size, rank, nonce)), "hashing the files")
    raise_first([share if isinstance(share, str) else None for share in shares])
    problem = None
    if rank == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        contents = {"format": FORMAT_VERSION, "world_size": size, "stage": state_of(model).runtime.stage,
                    "optimizer_state": has_state, "optimizer_class": _class_name(optimizer),
                    "checksum": CHECKSUM, "files": files}
        problem = attempt(lambda: _complete(staging, path, contents))
    agree(group, problem, "completing the save")  # no rank returns before ``path`` is the new checkpoint


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Restore ``model`` and ``optimizer`` in place from the checkpoint directory ``path``.

    Collective, like ``save``. The world size and stage may differ from the saved job's: each rank
    reads the rows its own shards cover. The optimizer gets the saved state and hyperparameters;
    when the saved optimizer had taken no step, its state is emptied and its hyperparameters kept.

    Args:
        strict: as ``nn.Module.load_state_dict``'s. ``True``: the checkpoint's keys (model and
            optimizer state, flattened as DCP names them, e.g. ``model.0.weight``) must equal the
            model's and optimizer's, and the optimizer class the saved one. ``False``: load the
            keys both have, leave the others as they are. Global shapes must match either way.

    Raises:
        CheckpointError: on every rank: ``path`` does not exist or holds no completion marker (an
            interrupted save, or a directory not written by ``save``); the marker is malformed; a
            file is missing, truncated or corrupt (the message says "corrupt" and names the file);
            the checkpoint does not fit (the first line names a key: missing, unexpected, or of
            another shape, or the optimizer class); a pickle in it names a type outside DCP's
            metadata and plain data (the message names the type; nothing of it ran).
        CollectiveError: a peer rank died or stopped during the load.
        ShardingError: ``model`` was not compiled by zerograph.
        ProcessGroupError: the model's process group was destroyed.
    """
    group = group_of(model)
    path = os.fspath(path)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    found = gather(group, attempt(lambda: _read_complete(path)), "checking the checkpoint")
    raise_first([f if isinstance(f, str) else None for f in found])
    marker: dict = found[0]
    agree(group, attempt(lambda: _verify_share(path, marker, size, rank)), "verifying the files")
    with_optimizer = marker.get("optimizer_state", True)
    if with_optimizer:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    else:
        state = {"model": get_model_state_dict(model)}
    agree(group, attempt(lambda: _fit_problem(state, path, marker, optimizer, strict)), "checking the fit")
    groups_params = [list(g["params"]) for g in state.get("optimizer", {}).get("param_groups", [])]
    dcp_call(lambda: dcp.load(state, storage_reader=RestrictedFileSystemReader(path), process_group=group,
                               planner=WeightsOnlyLoadPlanner(allow_partial_load=not strict)),
              f"reading the checkpoint at {path!r}")
    for group_state, params in zip(state.get("optimizer", {}).get("param_groups", []), groups_params):
        group_state["params"] = params  # this optimizer's parameter names, not the saved list
    if with_optimizer:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
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
        ProcessGroupError: the model's process group was destroyed.
    """
    group_of(model)  # fail clearly on a model zerograph did not compile, or a destroyed group
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(model, options=options)


# -- the save's steps ------------------------------------------------------------------------------

def _target_problem(path: str) -> str | None:
    """Why saving to ``path`` would destroy something not ours, or ``None``."""
    if os.path.lexists(path) and not _is_ours(path, MARKER):
        return (f"{path!r} exists and is not a zerograph checkpoint (no completion marker {MARKER}; holds "
                f"{_listing(path)}); save replaces only a previous checkpoint. Choose another path or remove it")
    for sibling, tag, role in ((path + _INCOMPLETE_SUFFIX, STAGING_TAG, "staging directory"),
                               (path + _REPLACED_SUFFIX, MARKER, "previous checkpoint set aside")):
        if os.path.lexists(sibling) and not _is_ours(sibling, tag):
            return (f"{sibling!r} exists and is not zerograph's {role} (no {tag}; holds {_listing(sibling)}); "
                    f"save would delete it. Move it away or choose another path")
    return None


def _is_ours(path: str, tag: str) -> bool:
    """A directory that holds ``tag``, or an empty one (replacing it loses nothing)."""
    return os.path.isdir(path) and not os.path.islink(path) and (
        os.path.isfile(os.path.join(path, tag)) or not os.listdir(path))


def _listing(path: str) -> str:
    if not os.path.isdir(path):
        return "a file, not a directory"
    names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(path))
    return ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _prepare_staging(staging: str) -> None:
    shutil.rmtree(staging, ignore_errors=True)  # ours (checked): left over from an interrupted save
    os.makedirs(staging)
    with open(os.path.join(staging, STAGING_TAG), "w") as f:
        f.write("a zerograph checkpoint being written\n")


def _write_token(staging: str, rank: int, nonce: str) -> None:
    if not os.path.isdir(staging):
        raise CheckpointError(f"rank {rank} does not see the staging directory {staging!r} that rank 0 "
                              "created: the ranks do not share a file system at this path")
    with open(os.path.join(staging, f"{TOKEN_PREFIX}{rank}"), "w") as f:
        f.write(nonce)


def _hash_share(staging: str, size: int, rank: int, nonce: str) -> dict[str, dict] | str:
    """Check that every rank's token is visible here, then digest this rank's share of the files."""
    for other in range(size):
        token = os.path.join(staging, f"{TOKEN_PREFIX}{other}")
        if not os.path.isfile(token) or _read_text(token) != nonce:
            return (f"rank {rank} does not see rank {other}'s files in {staging!r}: the ranks do not share "
                    "a file system at this path (or it does not show one rank's writes to another)")
    sizes = {e.name: e.stat().st_size for e in os.scandir(staging) if e.is_file() and e.name != MARKER}
    return {name: {"bytes": sizes[name], CHECKSUM: _digest(os.path.join(staging, name))}
            for name in _share(sizes, size, rank)}


def _read_text(file: str) -> str:
    with open(file) as f:
        return f.read()


def _share(sizes: dict[str, int], size: int, rank: int) -> list[str]:
    """The files ``rank`` hashes: largest first, each to the least loaded rank (same on every rank)."""
    load = [0] * size
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = load.index(min(load))
        load[target] += sizes[name]
        if target == rank:
            mine.append(name)
    return mine


def _digest(file: str) -> str:
    h = xxhash.xxh3_128()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _complete(staging: str, path: str, contents: dict) -> None:
    listed = {e.name for e in os.scandir(staging) if e.is_file() and e.name != MARKER}
    if listed != set(contents["files"]):
        raise CheckpointError(f"the ranks saw different files in {staging!r} (rank 0: {sorted(listed)}, hashed: "
                              f"{sorted(contents['files'])}): the file system does not show every write to every rank")
    _write_marker(staging, contents)
    _commit(staging, path)


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _write_marker(directory: str, contents: dict) -> None:
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump(contents, f)
        f.flush()
        os.fsync(f.fileno())  # the marker must not reach the disk after the rename does


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


# -- the load's checks -----------------------------------------------------------------------------

def _read_complete(path: str) -> dict | str:
    """The marker's contents, or why ``path`` is not a complete checkpoint."""
    problem = _completeness_problem(path)
    if problem is not None:
        return problem
    marker = os.path.join(path, MARKER)
    try:
        with open(marker) as f:
            contents = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"the completion marker {marker!r} is corrupt (not JSON: {exc}); refusing to load"
    if not isinstance(contents, dict) or not isinstance(contents.get("files", {}), dict):
        return f"the completion marker {marker!r} is corrupt (not a JSON object with a 'files' object)"
    if not isinstance(contents.get("format"), int) or contents["format"] > FORMAT_VERSION:
        return (f"the completion marker {marker!r} has format {contents.get('format')!r}; this zerograph "
                f"reads formats 1-{FORMAT_VERSION} (a newer zerograph wrote it?)")
    return contents


def _verify_share(path: str, marker: dict, size: int, rank: int) -> str | None:
    """Check this rank's share of the files the marker lists: size, then digest."""
    files = marker.get("files")
    if files is None:  # format 1 recorded no digests
        log.warning("checkpoint %s has format %s: its files carry no checksums and load unverified",
                    path, marker.get("format"))
        return None
    try:
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        expected = {name: entry[CHECKSUM] for name, entry in files.items()}
    except (KeyError, TypeError, ValueError) as exc:
        return f"the completion marker in {path!r} is corrupt (a file entry lacks bytes or {CHECKSUM}: {exc!r})"
    for name in _share(sizes, size, rank):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file!r} is missing: the checkpoint at {path!r} is corrupt"
        actual = os.path.getsize(file)
        if actual != sizes[name]:
            return f"{file!r} is corrupt (truncated or extended: {actual} bytes, {sizes[name]} saved)"
        if _digest(file) != expected[name]:
            return f"{file!r} is corrupt: its {CHECKSUM} checksum differs from the one recorded at save"
    return None


def _fit_problem(state: dict, path: str, marker: dict, optimizer: torch.optim.Optimizer,
                 strict: bool) -> str | None:
    """Why the checkpoint's keys, shapes or optimizer class do not fit ``state`` (DCP's flattened
    names), or ``None``. The first line names the first offending key."""
    template, _ = flatten_state_dict(state)
    sections = tuple(f"{section}." for section in state)
    try:
        metadata = RestrictedFileSystemReader(path).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:  # unpickling a damaged file raises anything; format 1 has no digest to catch it first
        raise CheckpointError(f"the DCP metadata of {path!r} is corrupt: {type(exc).__name__}: {exc}") from exc
    saved = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(sections)}
    for key in sorted(template.keys() & saved.keys()):
        want, have = template[key], saved[key]
        if isinstance(want, torch.Tensor) != isinstance(have, TensorStorageMetadata) or (
                isinstance(want, torch.Tensor) and tuple(want.shape) != tuple(have.size)):
            shape = tuple(have.size) if isinstance(have, TensorStorageMetadata) else "not a tensor"
            return (f"the checkpoint at {path!r} does not fit this model and optimizer: key {key!r} has shape "
                    f"{shape} in the checkpoint, {tuple(getattr(want, 'shape', ()))} here")
    if not strict:
        return None
    saved_class, mine = marker.get("optimizer_class"), _class_name(optimizer)
    if "optimizer" in state and saved_class is not None and saved_class != mine:
        return (f"the checkpoint at {path!r} does not fit this model and optimizer: optimizer class {saved_class} "
                f"was saved, this one is {mine}\n(load(..., strict=False) loads it anyway)")
    def tensors_first(key: str) -> tuple[bool, str]:  # hyperparameters matter less
        return ".param_groups." in key, key

    missing = sorted(template.keys() - saved.keys(), key=tensors_first)
    unexpected = sorted(saved.keys() - template.keys(), key=tensors_first)
    if not missing and not unexpected:
        return None
    first = f"missing key {missing[0]!r}" if missing else f"unexpected key {unexpected[0]!r}"
    return (f"the checkpoint at {path!r} does not fit this model and optimizer (other parameter names or optimizer "
            f"class?): {first}\n  missing from the checkpoint ({len(missing)}): {missing[:_LISTED]}\n"
            f"  in the checkpoint, not in the model ({len(unexpected)}): {unexpected[:_LISTED]}\n"
            "(load(..., strict=False) loads the keys both have)")


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
