"""zerograph's passes in PyTorch's structured trace (read by ``tlparse``) and the dump's web page
(``zerograph inspect DIR --html``).

One step of the tiny GPT at stage 3 (world size 1, in this process) runs with the structured trace
on (a ``LazyTraceHandler`` on ``torch._logging``'s trace log, what ``TORCH_TRACE=dir`` installs)
and a dump directory; the tests read both.
"""
from __future__ import annotations

import glob
import html
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import zerograph
from zerograph import cli
from zerograph.passes.manager import pipeline

from .models import build, global_batch

KINDS = ("joint", "partitioned", "forward", "backward")
RENDERED = ("joint", "forward", "backward")  # the partitioned pair has a pass log only: it goes on into the other two


def _tlparse() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "tlparse")  # the venv's, as `pip install tlparse` puts it
    return beside if os.path.exists(beside) else shutil.which("tlparse")


@pytest.fixture(scope="module")
def traced_step(tmp_path_factory) -> dict:
    from torch._logging._internal import LazyTraceHandler, TorchLogsFormatter, trace_log

    base = tmp_path_factory.mktemp("reports")
    trace_dir, dump_dir = str(base / "trace"), str(base / "dump")
    os.makedirs(trace_dir)
    handler = LazyTraceHandler(trace_dir)
    handler.setFormatter(TorchLogsFormatter(trace=True))
    trace_log.addHandler(handler)
    try:
        model = zerograph.compile(build("gpt"), stage=3, config=zerograph.Config(dump_dir=dump_dir))
        model(*global_batch("gpt", 0, 4)).backward()
        zerograph.explain(model)  # the summary's totals, for the page
    finally:
        trace_log.removeHandler(handler)
        handler.close()
    (log,) = glob.glob(os.path.join(trace_dir, "*.log"))
    return {"log": log, "dump": dump_dir, "base": str(base)}


def _artifacts(log: str) -> dict[str, list[str]]:
    """Artifact name -> payloads, read from the structured trace (one JSON record a line, the
    payload on the tab-indented lines after it)."""
    found: dict[str, list[str]] = {}
    name = None
    with open(log) as f:
        for line in f:
            if line.startswith("\t"):
                if name is not None:
                    found[name][-1] += line[1:]
                continue
            record = json.loads(line[line.index("{"):])
            name = record.get("artifact", {}).get("name")
            if name is not None:
                found.setdefault(name, []).append("")
    return found


def test_tlparse_report_names_every_pass(traced_step, tmp_path):
    tlparse = _tlparse()
    if tlparse is None:
        pytest.skip("tlparse is not installed (pip install tlparse; it is in the test extra)")
    out = tmp_path / "tl_out"
    subprocess.run([tlparse, traced_step["log"], "-o", str(out), "--overwrite", "--no-browser"], check=True,
                   capture_output=True, timeout=120)
    report = (out / "index.html").read_text()
    for kind in KINDS:
        assert f"zerograph_{kind}_00_input" in report
        for number, pass_fn in enumerate(pipeline(kind), start=1):
            assert f"zerograph_{kind}_{number:02d}_{pass_fn.__name__}" in report, (kind, pass_fn.__name__)
        if kind in RENDERED:
            assert f"zerograph_{kind}_memory" in report and f"zerograph_{kind}_collectives" in report
    for kind in ("forward", "backward"):
        assert f"zerograph_{kind}_schedule" in report


def test_trace_artifacts_match_the_dump(traced_step):
    artifacts = _artifacts(traced_step["log"])
    for kind in KINDS:
        graph_dir = os.path.join(traced_step["dump"], "rank0", f"graph0_{kind}")
        with open(os.path.join(graph_dir, "passes.json")) as f:
            entries = json.load(f)
        for entry in entries[1:]:  # each pass: its one-line summary and time, as passes.json has them
            (text,) = artifacts[f"zerograph_{kind}_{entry['number']:02d}_{entry['pass']}"]
            assert text.startswith(f"# pass {entry['number']:02d} {entry['pass']}: {entry['summary']} (")
            assert re.match(r"# pass .*\(\d+\.\d ms\)\n", text)
            if entry.get("file"):  # the graph after the pass, as the dump's file (headers aside)
                with open(os.path.join(graph_dir, entry["file"])) as f:
                    body = f.read().split("\n", 2)[2]
                assert text.rstrip("\n").endswith(body.rstrip("\n"))
        if kind not in RENDERED:
            continue
        with open(os.path.join(graph_dir, "memory.json")) as f:
            assert json.loads(artifacts[f"zerograph_{kind}_memory"][0]) == json.load(f)
        with open(os.path.join(graph_dir, "memory.json")) as f:
            marks = json.load(f)["collectives"]
        collectives = json.loads(artifacts[f"zerograph_{kind}_collectives"][0])
        assert [(c["start"], c["kind"]) for c in collectives] == [(m["position"], m["kind"]) for m in marks]


def _passes(dump: str, kind: str) -> list[dict]:
    with open(os.path.join(dump, "rank0", f"graph0_{kind}", "passes.json")) as f:
        return json.load(f)


def test_html_page_lists_every_pass_with_highlighted_diffs(traced_step, capsys):
    dump = traced_step["dump"]
    assert cli.main(["inspect", dump, "--html"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {os.path.join(dump, 'index.html')}"
    with open(os.path.join(dump, "index.html")) as f:
        page = f.read()
    entries = {kind: _passes(dump, kind) for kind in KINDS}
    assert page.count('<div class="highlight">') == sum(
        1 for kind in KINDS for e in entries[kind]
        if e.get("diff") and os.path.getsize(os.path.join(dump, "rank0", f"graph0_{kind}", e["diff"])))
    assert '<span class="gd">' in page and '<span class="gi">' in page  # Pygments' deleted / inserted lines
    for kind in KINDS:
        section = page[page.index(f'id="rank0-graph0_{kind}"'):]
        for entry in entries[kind]:
            assert f"<b>{entry['pass']}</b>: {html.escape(entry['summary'])}" in section, (kind, entry["pass"])
        if kind in RENDERED:
            assert f'src="rank0/graph0_{kind}/memory.png"' in section
    assert 'href="rank0/schedule.json"' in page and "https://ui.perfetto.dev" in page
    assert "<h3>Totals of the last finished step, Ψ = " in page
    assert "<td>blocks.0</td>" in page  # the units table
    for link in re.findall(r'(?:src|href)="(rank0/[^"]+)"', page):
        assert os.path.exists(os.path.join(dump, link)), link


def test_html_page_of_a_damaged_dump_lists_its_problems(traced_step, tmp_path, capsys):
    copy = str(tmp_path / "dump")
    shutil.copytree(traced_step["dump"], copy)
    os.remove(os.path.join(copy, "rank0", "graph0_forward", "passes.json"))
    out = str(tmp_path / "page.html")
    assert cli.main(["inspect", copy, "--html", out]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "zerograph inspect: rank0/graph0_forward/passes.json: missing (listed in the manifest)"
    with open(out) as f:
        page = f.read()
    assert "<h2>Problems</h2>" in page and "rank0/graph0_forward/passes.json: missing" in page
    assert 'src="dump/rank0/graph0_backward/memory.png"' in page  # links relative to where the page is
    assert cli.main(["inspect", copy, "--html", str(tmp_path / "no" / "such" / "page.html")]) == 1
    assert "cannot write the page" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the page in a real browser: its script runs and draws what the data says

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _chromium() -> str | None:
    """The Chromium to drive: ``ZEROGRAPH_CHROMIUM`` when set, else the first of CHROMIUM_NAMES on PATH."""
    explicit = os.environ.get("ZEROGRAPH_CHROMIUM")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def open_in_chromium(page_path: str, screenshot: str, *, full_page: bool = True) -> dict:
    """Open ``page_path`` (a file) in headless Chromium through Playwright, screenshot it to
    ``screenshot``, and return what the browser reported: ``errors`` (console messages of type
    error, uncaught exceptions, failed requests), the pass names listed per graph section, and
    the images that did not load. Skips the calling test when Playwright or Chromium is absent."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the test extra)")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (apt-get install chromium, or set ZEROGRAPH_CHROMIUM); "
                    "`make test` does not install it: that needs root, ~2 minutes and ~350 MB of OS packages")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} ({r.failure})"))
            page.goto("file://" + os.path.abspath(page_path), wait_until="load")
            passes = page.eval_on_selector_all(
                "section[id^='rank'] > section", "sections => Object.fromEntries(sections.map(s => "
                "[s.id, [...s.querySelectorAll('ol.passes > li b')].map(b => b.textContent)]))")
            broken_images = page.eval_on_selector_all(
                "img", "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute('src'))")
            page.locator("ol.passes details > summary").first.click()  # a diff opens, highlighted
            opened = page.locator("ol.passes details[open] .highlight").first.is_visible()
            page.screenshot(path=screenshot, full_page=full_page)
        finally:
            browser.close()
    return {"errors": errors, "passes": passes, "broken_images": broken_images, "diff_opens": opened}


def test_html_page_in_headless_chromium(traced_step, tmp_path):
    from zerograph.dump.html import write_html

    page_path, _ = write_html(traced_step["dump"], str(tmp_path / "dump_report.html"))
    shot = str(tmp_path / "dump_report.png")
    seen = open_in_chromium(page_path, shot)
    assert seen["errors"] == []
    assert seen["broken_images"] == []
    assert seen["diff_opens"]
    assert seen["passes"] == {f"rank0-graph0_{kind}": [e["pass"] for e in _passes(traced_step["dump"], kind)]
                              for kind in KINDS}
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(shot) > 10_000
