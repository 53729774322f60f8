"""Compile work that must not grow with depth faster than the graph does: the passes'
order bookkeeping, the splice templates shared by identical blocks, and the per-pass times the
dump's summary shows. In process, one rank of a fake world; structure only, never wall-clock."""
from __future__ import annotations

import collections
import random
import re

import pytest
import torch
import torch.fx as fx

import zerograph
from zerograph.dump.report import build_report, summary_markdown
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.passes import _fx
from zerograph.passes.manager import PASS_TIMES, pipeline
from zerograph.runtime.state import graphs_of, runtime_of_model, state_of

from .distributed import fake_rank

# the splice templates serve the per-parameter build, whose passes splice each block's
# collectives into the graph (the default build's blocks are one templated op each)
PER_PARAMETER = zerograph.Config(unit_templates=False)


def _chain_graph(n: int) -> fx.Graph:
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [x]
    for _ in range(n):
        nodes.append(graph.call_function(torch.neg, (x,)))
    graph.output(nodes[-1])
    return graph


def test_node_order_follows_moves_and_inserts() -> None:
    """After any sequence of moves and inserts, ``NodeOrder`` orders nodes as the graph does."""
    rng = random.Random(0)
    graph = _chain_graph(60)
    order = _fx.NodeOrder(graph)
    x = next(iter(graph.nodes))
    for step in range(400):
        body = [n for n in graph.nodes if n.op == "call_function"]
        node, point = rng.sample(body, 2)
        if step % 5 == 0:  # an insert the order has not seen
            with graph.inserting_before(point):
                graph.call_function(torch.abs, (x,))
        else:
            point.prepend(node)
            order.moved(node)
        if step % 40 == 0:  # also the worst case for floats: many moves into one gap
            for other in body[:30]:
                point.prepend(other)
                order.moved(other)
        truth = _fx.position(graph)
        ranked = sorted(truth, key=order.__getitem__)
        assert ranked == list(graph.nodes), f"order diverged from the graph after step {step}"


def _compile_gpt(blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=blocks, n_embd=32, n_head=2, block_size=16))
    model = zerograph.compile(model, 3, config=PER_PARAMETER)
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx).backward()
    return model


class _Block(torch.nn.Module):
    def __init__(self, width: int, bias: bool, extra: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, width, bias=bias)
        self.out = torch.nn.Linear(width, 16)
        self.gate = torch.nn.Parameter(torch.ones(16)) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(torch.relu(self.fc(x)))
        return x + (y * self.gate if self.gate is not None else y)


class _LookAlikes(torch.nn.Module):
    """Blocks of one class that differ: in width, in a bias, in an extra parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(32, True, False), _Block(32, True, False), _Block(48, True, False),
                                           _Block(32, False, False), _Block(32, True, True), _Block(32, True, False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _compile_look_alikes(blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = zerograph.compile(_LookAlikes(), 3, config=PER_PARAMETER)
    model(torch.randn(4, 16)).backward()
    return model


def _traces_and_code(blocks: int, monkeypatch: pytest.MonkeyPatch, limit: int,
                     build=None, first_in_process: bool = True, keep: dict | None = None) -> tuple[int, dict[str, str]]:
    """Splice traces (``make_fx`` calls) and the final graphs' code of a stage-3 GPT of ``blocks``
    blocks (or ``build(blocks)``'s model), with at most ``limit`` templates kept per compile (0:
    every splice traces); as the first compile of a process (no traced splice kept from an
    earlier one) unless ``first_in_process`` is False. ``keep`` gets the graphs, the dump's
    report (built in the fake world) and the splices the compile kept (``_fx._RECIPES``)."""
    traces = 0
    real = _fx.make_fx

    def counting(*args, **kwargs):
        nonlocal traces
        traces += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_fx, "make_fx", counting)
    monkeypatch.setattr(_fx, "TEMPLATE_LIMIT", limit)
    if first_in_process:
        monkeypatch.setattr(_fx, "_RECIPES", collections.OrderedDict())
    with fake_rank(2):
        model = (build or _compile_gpt)(blocks)
        record = graphs_of(model)[0]
        # the buffer pool's number differs from model to model; all else must match
        code = {kind: re.sub(r"pool_buffer\.default\(\d+,", "pool_buffer.default(POOL,", record[kind].code)
                for kind in ("forward", "backward")}
        if keep is not None:
            report = build_report(runtime_of_model(model), state_of(model).captured, None)
            keep.update(record=record, report=report, text=summary_markdown(report), recipes=_fx._RECIPES)
    return traces, code


@pytest.fixture(scope="module")
def first_gpt_compile() -> dict:
    """The stage-3 GPT of 2 blocks as the first compile of the process, once for the three tests
    that read it (each compiled it before): its splice traces and final code, and what ``keep``
    of ``_traces_and_code`` holds."""
    kept: dict = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        kept["traces"], kept["code"] = _traces_and_code(2, monkeypatch, _fx.TEMPLATE_LIMIT, keep=kept)
    return kept


@pytest.mark.slow  # two GPTs of 3 blocks
def test_identical_blocks_share_splice_traces_and_graphs_are_unchanged(first_gpt_compile,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPT of 3 blocks traces as many splice replacements as one of 2 (each block's all-gather
    and reduce-scatter are copies of one template), and its final graphs are exactly those built
    without templates."""
    blocks = 3  # two blocks past the first: each would trace its own splices without templates
    traces_2 = first_gpt_compile["traces"]
    traces, code = _traces_and_code(blocks, monkeypatch, _fx.TEMPLATE_LIMIT)
    untemplated, plain_code = _traces_and_code(blocks, monkeypatch, 0)
    assert traces == traces_2, (traces_2, traces)
    # without templates every block after the first traces its gather and its reduction anew
    assert untemplated >= traces + 2 * (blocks - 1), (traces, untemplated)
    assert code == plain_code


def test_a_second_compile_in_the_process_traces_no_splice_and_builds_the_same_graphs(
        first_gpt_compile, monkeypatch: pytest.MonkeyPatch) -> None:
    """The splices of a later compile of the same model re-run the first compile's traced ops on
    their own fake values (``_fx._retraced``): no ``make_fx`` call, and the final graphs equal
    those of the first compile, which traced every template."""
    first_traces, first_code = first_gpt_compile["traces"], first_gpt_compile["code"]
    assert first_traces > 0 and first_gpt_compile["recipes"]  # what the first compile kept
    monkeypatch.setattr(_fx, "_RECIPES", first_gpt_compile["recipes"])  # and only that
    traces, code = _traces_and_code(2, monkeypatch, _fx.TEMPLATE_LIMIT, first_in_process=False)
    assert traces == 0
    assert code == first_code


def test_look_alike_blocks_get_their_own_splices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of one class that differ in width, bias or an extra parameter share no template
    they should not: the graphs equal those built without templates, and fewer traces are made
    only for the repeated identical blocks."""
    traces, code = _traces_and_code(6, monkeypatch, _fx.TEMPLATE_LIMIT, _compile_look_alikes)
    untemplated, plain_code = _traces_and_code(6, monkeypatch, 0, _compile_look_alikes)
    assert code == plain_code
    assert traces < untemplated


def test_summary_shows_each_pass_time_per_graph(first_gpt_compile) -> None:
    record, report, text = (first_gpt_compile[k] for k in ("record", "report", "text"))
    for kind in ("joint", "partitioned", "forward", "backward"):
        times = record[kind].meta[PASS_TIMES]
        assert list(times["seconds"]) == [p.__name__ for p in pipeline(kind)]
        if kind != "partitioned":  # the pair's graphs go on into the forward / backward pipelines
            assert times["nodes_out"] == len(record[kind].graph.nodes)
    assert "## Compile time of the passes" in text
    assert [(r["kind"], list(r["seconds"])) for r in report["passes"]] == [
        (kind, [p.__name__ for p in pipeline(kind)]) for kind in ("joint", "partitioned", "forward", "backward")]
    assert "insert_reduce_scatter" in text.split("## Compile time of the passes")[1]
