"""Reading a dump back, checked against its manifests: what ``zerograph inspect`` shows.

``read_dump(path)`` returns the ranks and graphs it can read and one line per problem: a file or
folder missing, truncated or changed since it was written, a ``passes.json`` that is not JSON or
not of this schema, a graph the rank was still writing (a partial dump), a rank folder or graph
folder left from another run (stale). Only ``path`` not being a dump at all raises.

No torch: the CLI reads dumps without compiling anything.

Source: the dump's layout (``zerograph.dump``) and manifests (``zerograph.dump.manifest``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import DumpError
from .manifest import (
    FORMAT,
    GRAPH_DIR,
    MANIFEST,
    RANK_DIR,
    SCHEMA,
    read_json,
    zerograph_version,
)

KIND_ORDER = ("joint", "partitioned", "forward", "backward", "inference")
PASS_KEYS = {"number": int, "pass": str, "summary": str}  # what each passes.json entry must hold


@dataclass
class GraphView:
    """One ``graph<g>_<kind>/`` folder; ``passes`` is ``None`` when its ``passes.json`` is unreadable."""
    name: str
    path: str
    passes: list[dict[str, Any]] | None


@dataclass
class RankView:
    """One ``rank<r>/`` folder (``rank`` is ``None`` for a lone graph folder); ``manifest`` is ``None``
    when missing or unreadable."""
    rank: int | None
    path: str
    manifest: dict[str, Any] | None
    graphs: list[GraphView] = field(default_factory=list)


@dataclass
class DumpView:
    """What ``read_dump`` found: readable ranks by number, one line per problem, notes for the reader."""
    path: str
    ranks: dict[int, RankView] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def graph_order(name: str) -> tuple[int, int]:
    match = GRAPH_DIR.match(name)
    return (int(match.group(1)), KIND_ORDER.index(match.group(2))) if match else (1 << 30, 0)


def read_dump(path: str) -> DumpView:
    """Read the dump at ``path``: its root (``rank<r>/`` inside), one rank's folder, or one graph's.

    Raises ``DumpError`` when ``path`` is not a directory or holds no zerograph dump; every other
    problem is a line of ``DumpView.problems``.
    """
    if not os.path.isdir(path):
        raise DumpError(f"{path} is not a directory")
    view = DumpView(path)
    manifest_path = os.path.join(path, MANIFEST)
    if GRAPH_DIR.match(os.path.basename(os.path.normpath(path))) and not os.path.exists(manifest_path):
        rank_dir = os.path.dirname(os.path.normpath(path)) or "."
        rank = _read_rank(view, rank_dir, "", only=os.path.basename(os.path.normpath(path)))
        view.ranks[rank.rank if rank.rank is not None else 0] = rank
        return view
    root = _load_manifest(view, manifest_path, MANIFEST) if os.path.exists(manifest_path) else None
    if root is not None and "rank" in root:  # one rank's folder
        rank = _read_rank(view, path, "")
        view.ranks[rank.rank if rank.rank is not None else 0] = rank
        return view
    rank_dirs = {int(m.group(1)): name for name in os.listdir(path)
                 if (m := RANK_DIR.match(name)) and os.path.isdir(os.path.join(path, name))}
    if not os.path.exists(manifest_path):
        graphs = [name for name in os.listdir(path) if GRAPH_DIR.match(name)]
        if not rank_dirs and not graphs:
            raise DumpError(f"{path} is not a zerograph dump: no {MANIFEST} and no rank<r>/ folders (a dump is written "
                            "where ZEROGRAPH_DUMP or Config(dump_dir=) points, once a step has run)")
        if graphs:  # one rank's folder without a manifest (an older dump)
            view.ranks[0] = _read_rank(view, path, "")
            return view
        view.problems.append(f"{MANIFEST}: missing: written by an older zerograph, or rank 0 died before writing it")
    if root is not None and not _same_schema(view, root, MANIFEST):
        return view
    world = root.get("world_size") if isinstance(root, dict) else None
    run = root.get("run") if isinstance(root, dict) else None
    if isinstance(world, int):
        for missing in sorted(set(range(world)) - set(rank_dirs)):
            view.problems.append(f"rank{missing}: missing: the dump's world size is {world} (the rank wrote "
                                 "nothing, or died before its first file)")
    for number in sorted(rank_dirs):
        label = f"{rank_dirs[number]}/"
        if isinstance(world, int) and number >= world:
            view.problems.append(f"{label[:-1]}: stale: rank {number} is outside this dump's world size {world} "
                                 "(left from an earlier run; not shown)")
            continue
        rank = _read_rank(view, os.path.join(path, rank_dirs[number]), label)
        other = rank.manifest.get("run") if rank.manifest else None
        if run and other and other != run:
            view.problems.append(f"{label[:-1]}: stale: written by another run ({other[:8]}, this dump's is {run[:8]}; "
                                 "not shown)")
            continue
        view.ranks[number] = rank
    return view


def _load_manifest(view: DumpView, path: str, label: str) -> dict[str, Any] | None:
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        view.problems.append(f"{label}: unreadable, truncated or corrupt ({exc})")
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        view.problems.append(f"{label}: not a zerograph dump manifest")
        return None
    return data


def _same_schema(view: DumpView, manifest: dict[str, Any], label: str) -> bool:
    """False (with a problem line) when ``manifest`` is of another schema; a note when another
    zerograph version wrote it."""
    version = manifest.get("zerograph_version")
    if manifest.get("schema") != SCHEMA:
        view.problems.append(f"{label}: dump schema {manifest.get('schema')!r} (zerograph {version}); this zerograph "
                             f"({zerograph_version()}) reads schema {SCHEMA}: read it with the version that wrote it")
        return False
    if version != zerograph_version() and f"zerograph {version}" not in " ".join(view.notes):
        view.notes.append(f"written by zerograph {version}; this is {zerograph_version()}")
    return True


def _read_rank(view: DumpView, rank_dir: str, label: str, only: str | None = None) -> RankView:
    """Read one rank's folder into a ``RankView``, adding its problems to ``view``. ``label``: the
    folder as problems name it (``rank1/``); ``only``: read this graph folder alone."""
    m = RANK_DIR.match(os.path.basename(os.path.normpath(rank_dir)))
    manifest_label = f"{label}{MANIFEST}"
    manifest = _load_manifest(view, os.path.join(rank_dir, MANIFEST), manifest_label)
    if manifest is not None and not _same_schema(view, manifest, manifest_label):
        return RankView(int(m.group(1)) if m else None, rank_dir, None)
    if manifest is None and only is None and not os.path.exists(os.path.join(rank_dir, MANIFEST)):
        view.problems.append(f"{manifest_label}: missing: written by an older zerograph, or the rank died before "
                             "its first file (files cannot be checked)")
    rank = RankView(manifest.get("rank") if manifest else (int(m.group(1)) if m else None), rank_dir, manifest)
    listed = manifest.get("graphs", {}) if manifest else {}
    on_disk = [name for name in os.listdir(rank_dir) if GRAPH_DIR.match(name)
               and os.path.isdir(os.path.join(rank_dir, name))] if only is None else [only]
    prefix = label if only is None else ""
    for name in sorted(set(on_disk) | (set(listed) if only is None else set()), key=graph_order):
        graph_label = f"{prefix}{name}/"
        if name not in on_disk:
            view.problems.append(f"{graph_label[:-1]}: missing (listed in {manifest_label}): deleted after the dump")
            continue
        if manifest is not None and name not in listed:
            view.problems.append(f"{graph_label[:-1]}: stale: not in {manifest_label} (left from another run; not shown)")
            continue
        record = listed.get(name, {})
        graph_dir = os.path.join(rank_dir, name)
        reported = _check_files(view, graph_dir, graph_label, record.get("files", {}))
        if record.get("state") == "writing":
            view.problems.append(f"{graph_label[:-1]}: incomplete: the rank stopped while writing this graph "
                                 "(a partial dump: the pipeline failed or the process died)")
        rank.graphs.append(GraphView(name, graph_dir, _read_passes(view, graph_dir, graph_label, record, reported)))
    if only is None and manifest is not None:
        _check_files(view, rank_dir, prefix, manifest.get("files", {}))
    return rank


def _check_files(view: DumpView, directory: str, label: str, files: dict[str, int]) -> set[str]:
    """One problem line per listed file that is missing, shorter or other than written (``passes.json``
    is checked by ``_read_passes``); returns the names reported."""
    reported = set()
    for name, written in files.items():
        path = os.path.join(directory, name)
        if name == "passes.json":
            continue
        problem = _size_problem(path, written)
        if problem:
            reported.add(name)
            view.problems.append(f"{label}{name}: {problem}")
    return reported


def _size_problem(path: str, written: int | None) -> str | None:
    try:
        size = os.path.getsize(path)
    except OSError:
        return "missing (listed in the manifest)" if written is not None else "missing"
    if written is None or size == written:
        return None
    if size < written:
        return f"truncated ({size:,} of the {written:,} bytes written)"
    return f"changed since the dump wrote it ({size:,} bytes, {written:,} written)"


def _read_passes(view: DumpView, graph_dir: str, label: str, record: dict[str, Any],
                 reported: set[str]) -> list[dict[str, Any]] | None:
    """The graph's ``passes.json`` entries, or ``None`` with one problem line; also names pass
    files (``NN_<pass>.py`` / ``.diff``) it refers to that are missing and not reported yet."""
    path = os.path.join(graph_dir, "passes.json")
    written = record.get("files", {}).get("passes.json")
    where = f"{label}passes.json"
    try:
        entries = read_json(path)
    except FileNotFoundError:
        view.problems.append(f"{where}: missing" + (" (listed in the manifest)" if written is not None else ""))
        return None
    except (OSError, ValueError) as exc:
        problem = _size_problem(path, written)
        view.problems.append(f"{where}: " + (problem if problem and problem.startswith("truncated")
                                             else f"corrupt, not JSON ({exc})"))
        return None
    shape = _schema_problem(entries)
    if shape:
        view.problems.append(f"{where}: not of dump schema {SCHEMA}: {shape}")
        return None
    problem = _size_problem(path, written)
    if problem:
        view.problems.append(f"{where}: {problem}")
    for entry in entries:
        for key in ("file", "diff"):
            name = entry.get(key)
            if name and name not in reported and not os.path.exists(os.path.join(graph_dir, name)):
                reported.add(name)
                view.problems.append(f"{label}{name}: missing (named by passes.json, pass {entry['number']:02d} "
                                     f"{entry['pass']})")
    return entries


def _schema_problem(entries: Any) -> str | None:
    if not isinstance(entries, list):
        return f"expected a list of passes, found a JSON {type(entries).__name__}"
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            return f"entry {i} is a {type(entry).__name__}, not an object"
        for key, kind in PASS_KEYS.items():
            if not isinstance(entry.get(key), kind):
                return f"entry {i} has no {kind.__name__} {key!r}"
    return None
