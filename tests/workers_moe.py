"""Mixtures of experts whose ranks route tokens to different experts (``tests/test_moe.py``): each
case trained under zerograph on two gloo ranks, each on its half of the global batch, and by
single-process eager on the whole batch, from the same weights."""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerograph
from tests.distributed import run_case_in_step
from zerograph.errors import ZeroGraphError

from .workers_semantics import full, global_mean

STEPS, LR, WIDTH, EXPERTS = 2, 1e-2, 8, 4
# the rows of the global batch; rank 0's half routes to fewer experts than rank 1's (ROUTES)
ROWS, VOCAB, SEQ = 4, 32, 8


def hf_mixtral() -> nn.Module:
    """transformers' Mixtral from a tiny config (no download), its experts looping over the
    experts that got tokens (``experts_implementation="eager"``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, max_position_embeddings=SEQ, use_cache=False,
                           experts_implementation="eager", attn_implementation="eager")
    return MixtralForCausalLM(config)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _router() -> nn.Linear:
    """The router's logits; its last expert's bias so low that no token reaches that expert (its
    parameters keep ``.grad`` ``None`` in eager)."""
    router = nn.Linear(WIDTH, EXPERTS)
    with torch.no_grad():
        router.bias[-1] = -1e3
    return router


def _route(router: nn.Module, experts: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Top-1 routing over the experts that got tokens (a ``set`` of them, in Python), each
    expert's output weighted by its router probability."""
    weights = F.softmax(router(x), dim=-1)
    choice = weights.argmax(dim=-1)
    out = torch.zeros_like(x)
    for e in sorted(set(choice.tolist())):
        rows = torch.nonzero(choice == e).squeeze(-1)
        out = out.index_add(0, rows, experts[e](x[rows]) * weights[rows, e:e + 1])
    return x + out


class MoEBlock(nn.Module):
    """A router and its experts: a unit in a stack of them (``BlocksNet``), a plain module alone
    (``NestedExpertsNet``)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = _router()
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _route(self.router, self.experts, x)


class BlocksNet(nn.Module):
    """Two MoE blocks: the units, each looping over its experts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([MoEBlock(), MoEBlock()])
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).flatten(0, 1)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.out(h), tokens.flatten())


class SkippingNet(BlocksNet):
    """Rank-dependent control flow around the islands: rank 1 skips the first block, so it runs the
    second block's island where rank 0 runs the first's (the same sizes: their gathers would pass
    each other the wrong block's parameters)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).flatten(0, 1)
        for block in self.blocks[dist.get_rank():]:
            h = block(h)
        return F.cross_entropy(self.out(h), tokens.flatten())


class ExpertsNet(nn.Module):
    """The experts are the units (the model's one stack) and the routing loop is the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.router = _router()
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = _route(self.router, self.experts, self.emb(tokens).flatten(0, 1))
        return F.cross_entropy(self.out(h), tokens.flatten())


class NestedExpertsNet(nn.Module):
    """The experts are the units (the model's one stack), below a plain module that loops over
    them (one ``MoEBlock``, no unit), as ``Config(unit_classes=(Expert,))`` makes them in a model
    of MoE layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.moe = MoEBlock()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.moe(self.emb(tokens).flatten(0, 1))
        return F.cross_entropy(self.out(h), tokens.flatten())


def _hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, torch.Tensor], torch.Tensor]]] = {
    "transformers Mixtral, eager experts": (hf_mixtral, _hf_loss),
    "routing loop in a unit, a set of experts": (BlocksNet, lambda model, tokens: model(tokens)),
    "experts as units, routing loop in the root": (ExpertsNet, lambda model, tokens: model(tokens)),
    "islands of different units on the ranks": (SkippingNet, lambda model, tokens: model(tokens)),
    "experts as units, routing loop in a plain module": (NestedExpertsNet, lambda model, tokens: model(tokens)),
}


def batch() -> torch.Tensor:
    """The global batch, ``(ROWS, SEQ)`` token ids: rank 0's rows hold one token throughout, so
    each of its layers routes every token alike (one or two experts), rank 1's hold many."""
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    tokens[:ROWS // 2] = 3
    return tokens


def _train(model: nn.Module, loss_of: Callable, tokens: torch.Tensor, compiled: bool) -> dict:
    record: dict = {"losses": [], "grads": [], "params": []}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        loss = loss_of(model, tokens)
        loss.backward()
        record["losses"].append(global_mean(loss, compiled))
        record["grads"].append({n: full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        record["params"].append({n: full(p.detach()) for n, p in model.named_parameters()})
    return record


def routed_experts(name: str) -> list[list[list[int]]]:
    """Eager's routing of the global batch at the first step: per routing call, the experts each
    rank's half of the rows reaches (the test checks that the ranks differ)."""
    torch.manual_seed(0)
    model = CASES[name][0]()
    seen: list[list[list[int]]] = []

    def record(module: nn.Module, args: tuple, out: torch.Tensor | tuple) -> None:
        choice = out[2] if isinstance(out, tuple) else out.argmax(dim=-1)
        seen.append([sorted(set(half.flatten().tolist())) for half in choice.chunk(2)])

    for module_name, module in model.named_modules():
        if module_name.endswith("router") or module_name.endswith("mlp.gate"):
            module.register_forward_hook(record)
    CASES[name][1](model, batch())
    return seen


def run_case(rank: int, world: int, name: str, stage: int) -> dict:
    """One case at one stage: ``{"ours": record, "reference": record}`` or ``{"refused": (class, message)}``."""
    build, loss_of = CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    tokens = batch()
    try:
        compiled = zerograph.compile(model, stage=stage)
        ours = _train(compiled, loss_of, tokens.chunk(world)[rank], True)
    except ZeroGraphError as exc:
        return {"refused": (type(exc).__name__, str(exc))}
    return {"ours": ours, "reference": _train(reference, loss_of, tokens, False)}


def moe_runs(rank: int, world: int, runs: tuple[tuple[str, int], ...]) -> dict:
    """Each ``(case, stage)`` of ``runs``: ``{(case, stage): result or traceback}``."""
    out: dict = {}
    for name, stage in runs:
        out[name, stage] = run_case_in_step((name, stage), run_case, rank, world, name, stage)
    dist.barrier()
    return out
