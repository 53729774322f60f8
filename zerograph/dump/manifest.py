"""The dump's manifests: what one run wrote, so a second run never mixes with it and ``inspect`` can
tell a damaged dump from a whole one.

``<root>/manifest.json`` (written by rank 0) names the run and its world size;
``<root>/rank<r>/manifest.json`` lists every file that rank wrote with its size in bytes, per graph
folder and at the rank's root, and marks each graph ``writing`` until its last file is written
(``complete``). Manifests are replaced atomically (written beside, then ``os.replace``), so a rank
that dies mid-write leaves the previous consistent manifest.

Dumping into a folder that holds a dump: each rank starts fresh. Before its first file it deletes
the files its previous manifest lists (and, in the graph folders listed there, the dump's own file
names), then the manifest; rank 0 does the same for ``rank<k>/`` of an earlier, larger world. Files
a manifest does not list are left alone. A ``rank<r>/`` folder that is not empty and holds no
readable manifest of this schema is refused (``DumpError``) before any byte is written: it is not a
zerograph dump, or one too old or too damaged to know which files are its own.

No torch at import: ``zerograph inspect`` reads manifests through this module.

Source: the completion-marker pattern of ``torch.distributed.checkpoint`` (a ``.metadata`` file
written last); ``os.replace`` for atomic renames (POSIX ``rename(2)``).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import uuid
from importlib import metadata
from typing import Any

from ..errors import DumpError

FORMAT = "zerograph-dump"
SCHEMA = 1  # bump when a file's layout changes; ``inspect`` reads this schema only
MANIFEST = "manifest.json"
GRAPH_DIR = re.compile(r"^graph(\d+)_(joint|partitioned|forward|backward|inference)$")
RANK_DIR = re.compile(r"^rank(\d+)$")
# file names the dump writes inside a graph folder (cleared there on a fresh start even if unlisted)
GRAPH_FILE = re.compile(r"^(\d\d_\w+\.(py|diff)|passes\.json|graph\.(dot|svg)|memory\.(json|png)|schedule\.json)$")


def zerograph_version() -> str:
    try:
        return metadata.version("zerograph")
    except metadata.PackageNotFoundError:
        return "unknown"


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path``, atomically (readers see the old or the new file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    """``json.load`` of ``path``; raises ``OSError`` / ``ValueError`` (``json.JSONDecodeError``) as they come."""
    with open(path) as f:
        return json.load(f)


def is_own_manifest(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == FORMAT and data.get("schema") == SCHEMA


class RankManifest:
    """``<root>/rank<r>/manifest.json`` of the dump this process is writing.

    ``graphs``: folder name -> ``{"state": "writing" | "complete", "files": {name: bytes}}``;
    ``files``: the rank folder's own files (summary, schedules) -> bytes.
    """

    def __init__(self, rank_dir: str, rank: int | None, world_size: int | None, run: str | None) -> None:
        self.rank_dir = rank_dir
        self.data: dict[str, Any] = {
            "format": FORMAT, "schema": SCHEMA, "zerograph_version": zerograph_version(), "run": run,
            "rank": rank, "world_size": world_size,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": {}, "graphs": {}}
        os.makedirs(rank_dir, exist_ok=True)
        self.save()

    def start_graph(self, name: str) -> None:
        """Mark graph folder ``name`` as being written (its files are recorded as they come); files
        this process wrote there before (another model's graph of the same number) are deleted."""
        for file in self.data["graphs"].get(name, {}).get("files", {}):
            _remove(os.path.join(self.rank_dir, name, file))
        self.data["graphs"][name] = {"state": "writing", "files": {}}
        self.save()

    def finish_graph(self, name: str) -> None:
        self.data["graphs"].setdefault(name, {"files": {}})["state"] = "complete"
        self.save()

    def record(self, *paths: str) -> None:
        """Record the files at ``paths`` (inside the rank folder or one of its graph folders) with
        their sizes now, and save the manifest."""
        for path in paths:
            rel = os.path.relpath(path, self.rank_dir).split(os.sep)
            size = os.path.getsize(path)
            if len(rel) == 1:
                self.data["files"][rel[0]] = size
            else:
                graph = self.data["graphs"].setdefault(rel[0], {"state": "writing", "files": {}})
                graph["files"]["/".join(rel[1:])] = size
        self.save()

    def save(self) -> None:
        write_json(os.path.join(self.rank_dir, MANIFEST), self.data)


_OPEN: dict[str, RankManifest] = {}  # real path of a rank folder -> the manifest this process writes there


def rank_manifest(rank_dir: str, rank: int | None = None, world_size: int | None = None,
                  run: str | None = None) -> RankManifest:
    """The manifest this process writes in ``rank_dir``; the first call per folder clears the
    previous dump there (``clear_previous``) and starts a new manifest.

    Raises ``DumpError`` when ``rank_dir`` holds files but no manifest of this dump schema.
    """
    key = os.path.realpath(rank_dir)
    manifest = _OPEN.get(key)
    if manifest is None or not os.path.isdir(rank_dir):
        if rank is None and (m := RANK_DIR.match(os.path.basename(key))):
            rank = int(m.group(1))
        clear_previous(rank_dir)
        manifest = _OPEN[key] = RankManifest(rank_dir, rank, world_size, run)
    return manifest


def clear_previous(rank_dir: str) -> None:
    """Delete the files of the zerograph dump recorded in ``rank_dir/manifest.json``, then the
    manifest and the folders left empty. Nothing else is touched.

    Raises ``DumpError`` (before deleting anything) when ``rank_dir`` is not empty and holds no
    readable manifest of this schema.
    """
    if not os.path.isdir(rank_dir) or not os.listdir(rank_dir):
        return
    path = os.path.join(rank_dir, MANIFEST)
    try:
        old = read_json(path)
    except (OSError, ValueError) as exc:
        why = "it has no manifest.json" if isinstance(exc, FileNotFoundError) else f"its manifest.json is unreadable ({exc})"
        raise DumpError(f"zerograph dump: refusing to write into {rank_dir}: the folder is not empty and {why}, so "
                        "it is not a zerograph dump whose files could be replaced; empty it or choose another "
                        "dump directory (ZEROGRAPH_DUMP / Config(dump_dir=))") from exc
    if not is_own_manifest(old):
        raise DumpError(f"zerograph dump: refusing to write into {rank_dir}: its manifest.json is not of dump schema "
                        f"{SCHEMA} (found format {old.get('format') if isinstance(old, dict) else None!r}, schema "
                        f"{old.get('schema') if isinstance(old, dict) else None!r}); empty it or choose another dump directory")
    for name in old.get("files", {}):
        _remove(os.path.join(rank_dir, name))
    for graph, record in old.get("graphs", {}).items():
        graph_dir = os.path.join(rank_dir, graph)
        if not GRAPH_DIR.match(graph) or not os.path.isdir(graph_dir):
            continue
        for name in set(record.get("files", {})) | {n for n in os.listdir(graph_dir) if GRAPH_FILE.match(n)}:
            _remove(os.path.join(graph_dir, name))
        _rmdir_if_empty(graph_dir)
    _remove(path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:  # not empty: files the manifest did not list stay
        pass


def begin_dump(dump_root: str, runtime: Any) -> RankManifest:
    """Start this rank's part of the dump in ``dump_root`` (once per process and folder): agree on
    a run id with the other ranks, clear this rank's previous dump, start its manifest; rank 0 also
    writes ``<dump_root>/manifest.json`` and clears ``rank<k>/`` dumps with ``k >= world size``.

    Collective the first time per folder (one ``broadcast_object_list`` over ``topology.world_group``,
    every rank of the mesh; folders are named by ``topology.mesh_rank``, unique under hybrid sharding):
    every rank must call it at the same point, as ``calibrate_once``. Raises ``DumpError`` when a
    folder is not a zerograph dump (``clear_previous``).
    """
    topology = runtime.topology
    rank_dir = os.path.join(dump_root, f"rank{topology.mesh_rank}")
    key = os.path.realpath(rank_dir)
    if key in _OPEN and os.path.isdir(rank_dir):
        return _OPEN[key]
    run = [uuid.uuid4().hex]
    if topology.dp_size > 1 and not topology.fake_world:  # a fake world has no peers to agree with
        import torch.distributed as dist

        dist.broadcast_object_list(run, src=dist.get_global_rank(topology.world_group, 0), group=topology.world_group)
    if topology.mesh_rank == 0:
        _begin_root(dump_root, run[0], topology.dp_size)
    _OPEN.pop(key, None)
    return rank_manifest(rank_dir, topology.mesh_rank, topology.dp_size, run[0])


def _begin_root(dump_root: str, run: str, world_size: int) -> None:
    os.makedirs(dump_root, exist_ok=True)
    path = os.path.join(dump_root, MANIFEST)
    if os.path.exists(path):
        try:
            old = read_json(path)
        except (OSError, ValueError):
            old = None
        if not (isinstance(old, dict) and old.get("format") == FORMAT):
            raise DumpError(f"zerograph dump: refusing to replace {path}: it is not a zerograph dump manifest; "
                            "choose another dump directory (ZEROGRAPH_DUMP / Config(dump_dir=))")
    for name in os.listdir(dump_root):  # ranks of an earlier, larger world
        m = RANK_DIR.match(name)
        if m and int(m.group(1)) >= world_size and os.path.isfile(os.path.join(dump_root, name, MANIFEST)):
            try:
                clear_previous(os.path.join(dump_root, name))
            except DumpError:  # not ours to clear: ``inspect`` names it as stale
                continue
            _rmdir_if_empty(os.path.join(dump_root, name))
    write_json(path, {"format": FORMAT, "schema": SCHEMA, "zerograph_version": zerograph_version(), "run": run,
                      "world_size": world_size, "ranks": [f"rank{r}" for r in range(world_size)],
                      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
