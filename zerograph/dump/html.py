"""A dump as one static web page (``zerograph inspect DIR --html``): per rank and graph, the passes
in order with their one-line summaries and syntax-highlighted diffs, the SVG graph where Graphviz
drew one, the memory PNG, links to the schedules for Perfetto, the units and totals table, and
the problems ``read_dump`` found. Files only, no server: open ``index.html`` in a browser.

Source: Jinja2 (``jinja2.Environment`` with HTML autoescaping) for the page, Pygments
(``DiffLexer``, ``HtmlFormatter``) for the diffs.
"""
from __future__ import annotations

import os
from typing import Any

from .manifest import read_json
from .reader import DumpView, read_dump


def write_html(path: str, out: str | None = None) -> tuple[str, DumpView]:
    """Write the page of the dump at ``path`` to ``out`` (default ``<path>/index.html``); returns
    ``(the page's path, what read_dump found)``. Links are relative, so the page must stay beside
    the dump. Raises ``DumpError`` when ``path`` is not a dump; ``OSError`` when ``out`` cannot be written.
    """
    import jinja2
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import DiffLexer

    view = read_dump(path)
    out = out or os.path.join(path, "index.html")
    base = os.path.dirname(os.path.abspath(out))
    formatter = HtmlFormatter(cssclass="highlight")

    def link(file: str) -> str | None:
        return os.path.relpath(file, base) if os.path.exists(file) else None

    ranks = []
    for number, rank in sorted(view.ranks.items()):
        summary = _summary(os.path.join(rank.path, "summary.json"))
        graphs = []
        for graph in rank.graphs:
            passes = []
            for entry in graph.passes or []:
                diff = entry.get("diff")
                diff_path = os.path.join(graph.path, diff) if diff else None
                diff_html = None
                if diff_path and os.path.exists(diff_path):
                    with open(diff_path, errors="replace") as f:
                        text = f.read()
                    diff_html = highlight(text, DiffLexer(), formatter) if text else "<p>(no textual change)</p>"
                passes.append({"name": entry["pass"], "summary": entry["summary"], "seconds": entry.get("seconds"),
                               "diff": diff, "diff_html": diff_html})
            graphs.append({"name": graph.name, "anchor": f"rank{number}-{graph.name}", "passes": passes,
                           "svg": link(os.path.join(graph.path, "graph.svg")),
                           "memory_png": link(os.path.join(graph.path, "memory.png")),
                           "schedule": link(os.path.join(graph.path, "schedule.json"))})
        ranks.append({"number": number, "summary": summary, "graphs": graphs,
                      "schedule": link(os.path.join(rank.path, "schedule.json"))})
    manifest: dict[str, Any] = next((r.manifest for r in view.ranks.values() if r.manifest), {}) or {}
    env = jinja2.Environment(loader=jinja2.PackageLoader("zerograph.dump", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    page = env.get_template("index.html.j2").render(
        title=os.path.basename(os.path.abspath(path)), path=path, version=manifest.get("zerograph_version"),
        world_size=manifest.get("world_size"), notes=view.notes, problems=view.problems, ranks=ranks,
        pygments_css=formatter.get_style_defs(".highlight"))
    with open(out, "w") as f:
        f.write(page)
    return out, view


SUMMARY_UNIT_KEYS = ("index", "name", "parameters", "elements", "shard_elements", "shard_bytes", "gathered",
                     "released", "reduced")


def _summary(path: str) -> dict[str, Any] | None:
    """``summary.json`` when it has the shape the page shows, else ``None`` (the table is left out;
    ``read_dump`` names a listed file that is missing or damaged)."""
    try:
        summary = read_json(path)
    except (OSError, ValueError):
        return None
    units = summary.get("units") if isinstance(summary, dict) else None
    if not isinstance(units, list) or not all(isinstance(u, dict) and all(k in u for k in SUMMARY_UNIT_KEYS)
                                              for u in units):
        return None
    totals = summary.get("totals")
    if totals is not None and not (isinstance(totals, dict) and {"num_params", "comm_elements_total", "comm_psi",
                                   "paper_comm_psi", "resident_bytes", "formula_bytes"} <= set(totals)):
        summary = {**summary, "totals": None}
    return summary
