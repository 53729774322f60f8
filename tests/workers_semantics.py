"""Rank worker of the semantics matrix (``tests/test_semantics.py``).

Every parameter-level PyTorch feature a training script relies on, one *case* each, trained by a
model compiled by zerograph on this rank's slice of a global batch and by an eager copy on the whole
batch (the loss a mean over rows, so the ranks' averaged gradients are the global batch's). A case
returns plain data: the losses, every parameter's gradient after each backward (``None`` kept
as ``None``), the parameters and buffers after each step, and whatever else the case records; or
the refusal it raised, by class name and message. The test compares them with 1e-5.

One spawned phase runs every case at every stage with and without unit templates
(``semantics_runs``); a case that raises anything other than a zerograph refusal returns its
traceback, so it fails only its own test.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

import zerograph
from tests.distributed import run_case_in_step
from zerograph.errors import ZeroGraphError
from zerograph.graph import ops
from zerograph.shard import flat

STEPS, LR, ROWS, WIDTH = 2, 0.05, 4, 8  # AdamW steps, learning rate, rows of the global batch, block width


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def global_mean(value: torch.Tensor, compiled: bool) -> float:
    """A loss over this rank's rows as the global batch's (the mean over ranks); eager's as it is."""
    total = value.detach().float().clone()
    if compiled and dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item()


# ---------------------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Two identical blocks (one unit kind: a template at ``unit_templates=True``) between a root
    input and output layer."""

    def __init__(self, block: Callable[[], nn.Module] = Block) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList([block(), block()])
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).pow(2).mean()


class UnusedBlock(Block):
    """A block one of whose layers never reaches the output: its parameters' ``.grad`` stay
    ``None`` in eager. ``branch``: a data-dependent branch too, so the block's template cannot be
    traced and the kind runs inline on its flat shard."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch and bool(x.sum() > 1e9):  # never taken, but needs the value: no fake-tensor trace
            return x + self.unused(x)
        return super().forward(x)


class CountingBlock(Block):
    """A block whose forward writes a buffer in place (a call counter, the same on every rank, unlike a
    batch norm's running statistics of the rank's rows) and reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls.add_(1)
        return super().forward(x) * (1 + 0.1 * self.calls)


class RNNBlock(nn.Module):
    """``nn.GRU`` keeps its own list of its parameters (``_flat_weights``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(WIDTH, WIDTH, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x.unsqueeze(1))
        return x + out.squeeze(1)


class MoEBlock(nn.Module):
    """A mixture of experts that loops over the experts which received tokens (Hugging Face's
    ``experts_implementation="eager"``): data-dependent control flow inside one unit, whose graph
    breaks differ from rank to rank as routing does."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(self.router(x), dim=-1)
        choice = weights.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e in torch.unique(choice).tolist():  # the experts that got tokens
            rows = torch.nonzero(choice == e).squeeze(-1)
            out = out.index_add(0, rows, self.experts[e](x[rows]) * weights[rows, e : e + 1])
        return x + out


class Tied(nn.Module):
    """An embedding whose weight the output layer reuses, and a layer called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb((x.abs() * 10).long().clamp(max=10)[:, 0])
        for block in self.blocks:
            h = self.shared(block(h))
        h = self.shared(h)
        return self.head(h).pow(2).mean()


# ------------------------------------------------------------------------------------ the cases
@dataclasses.dataclass
class Case:
    """``build()`` makes the model (with the same seed for both runs); ``prepare(model)`` runs on the
    eager model before the copy and compile (so on both); ``after_compile(model, compiled)`` on each run
    after compile (``compiled`` False for eager); ``step(model, x, opt, i, compiled, record)`` runs
    one step's forward and backward and returns the loss (default: ``model(x)``, then backward);
    ``optimizer(model)`` builds the optimizer (``None``: none, the case steps itself)."""

    build: Callable[[], nn.Module] = Net
    prepare: Callable[[nn.Module], None] | None = None
    after_compile: Callable[[nn.Module, bool], None] | None = None
    step: Callable[..., torch.Tensor] | None = None
    optimizer: Callable[[nn.Module], torch.optim.Optimizer | None] = (
        lambda model: torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    steps: int = STEPS


def _scale_hook(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


def _clamp_hook(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-1e-3, 1e-3)


def _quarter_grad(param: torch.Tensor) -> None:
    param.grad.mul_(0.25)


def _hooks_before_compile(model: nn.Module) -> None:
    """Tensor hooks on parameters of a templated unit and of the root, and module hooks that
    change a unit's input, output and input gradient, all registered before ``compile``."""
    model.get_parameter("blocks.0.fc1.weight").register_hook(_scale_hook)
    model.get_parameter("blocks.1.fc2.bias").register_hook(_clamp_hook)
    model.get_parameter("out.weight").register_hook(_scale_hook)
    model.get_parameter("blocks.0.fc2.weight").register_post_accumulate_grad_hook(_quarter_grad)
    model.blocks[0].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    model.blocks[1].register_forward_hook(lambda m, args, out: out * 1.5)
    model.blocks[1].register_full_backward_hook(lambda m, gin, gout: (gin[0] * 0.5,))
    model.inp.register_forward_hook(lambda m, args, out: torch.relu(out))


def _hooks_after_compile(model: nn.Module, compiled: bool) -> None:
    """Tensor hooks registered on the parameters ``compile`` returned (eager: on its own)."""
    model.get_parameter("blocks.1.fc1.weight").register_hook(_scale_hook)
    model.get_parameter("inp.bias").register_hook(_clamp_hook)
    model.get_parameter("blocks.1.fc1.bias").register_post_accumulate_grad_hook(_quarter_grad)


def _param_groups(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0, "lr": LR * 3}], lr=LR)


def _clip_step(model, x, opt, i, compiled, record):
    loss = model(x)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    record.setdefault("norm", []).append(full(norm).item())
    return loss


def _optimizer_in_backward(model: nn.Module, compiled: bool) -> None:
    """torchtune's ``optimizer_in_bwd``: one optimizer per parameter, stepped by the parameter's
    post-accumulate-grad hook, which then frees the gradient; a tensor hook before it on one."""
    optimizers = {p: torch.optim.AdamW([p], lr=LR, weight_decay=0.1) for p in model.parameters()}

    def step(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    model.get_parameter("blocks.0.fc1.weight").register_hook(_scale_hook)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _substituted_step(model, x, opt, i, compiled, record):
    """Evaluate with every parameter scaled by 0.9 through ``functional_call``, ``stateless`` and
    an in-place swap (EMA / SWA evaluation); at step 1 keep the state dicts, train a step, load
    them back; then train through ``functional_call`` with the model's own parameters."""
    swapped = {name: p.detach() * 0.9 for name, p in model.named_parameters()}
    some = {name: value for name, value in swapped.items() if name.startswith(("blocks.1", "out"))}
    with torch.no_grad():
        record.setdefault("functional_call", []).append(
            global_mean(torch.func.functional_call(model, swapped, (x,)), compiled))
        with torch.nn.utils.stateless._reparametrize_module(model, some):
            record.setdefault("stateless", []).append(global_mean(model(x), compiled))
        saved = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.mul_(0.9)
        record.setdefault("in place", []).append(global_mean(model(x), compiled))
        for p, value in zip(model.parameters(), saved):
            p.copy_(value)
    if i == 1:
        model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt_state = copy.deepcopy(opt.state_dict())
        model(x).backward()
        opt.step()
        opt.zero_grad()
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
    loss = torch.func.functional_call(model, dict(model.named_parameters()), (x,))
    loss.backward()
    return loss


class _Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(0, 1)


def _reparametrized_frozen_checkpointed(model: nn.Module) -> None:
    """``parametrize`` and ``weight_norm`` in every block, one block's layer and a root bias
    frozen, and every block under ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        parametrize.register_parametrization(block.fc1, "weight", _Symmetric())
        torch.nn.utils.parametrizations.weight_norm(block.fc2)
        forward = block.forward
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
    model.blocks[0].fc1.requires_grad_(False)
    model.inp.bias.requires_grad_(False)


class UnusedNet(nn.Module):
    """Two stacks of blocks with a layer that never reaches the output: templated ones, and
    ones whose data-dependent branch keeps them from being templates (islands)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList([UnusedBlock(), UnusedBlock()])
        self.branchy = nn.ModuleList([UnusedBlock(branch=True), UnusedBlock(branch=True)])
        self.side = nn.Linear(WIDTH, WIDTH)  # root, output discarded
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in [*self.blocks, *self.branchy]:
            h = block(h)
        self.side(h)
        return self.out(h).pow(2).mean()


# what autograd.grad and backward(inputs=) name: a used and an unused parameter of a templated block
# (its flat shard) and of an island, and a root layer's
NAMED = ("blocks.0.fc1.weight", "blocks.1.unused.bias", "branchy.0.fc2.weight", "branchy.1.unused.weight", "out.bias")


def _no_sync_step(model, x, opt, i, compiled, record):
    """Two micro-batches, the first accumulated without a collective, the second synced, with
    ``torch.autograd.grad`` of the ``NAMED`` parameters (``None`` for the unused ones) and a
    backward reaching only them (``inputs=``; the others keep what they had): step 0 takes the
    gradients before the micro-batches, discards an unsynced one (``zero_grad()``; step 1:
    ``zero_grad(set_to_none=False)``), runs the first one's backward after leaving ``no_sync``
    (its forward decided: held) and names them in the second's; step 1 names them in the unsynced backward and
    takes the gradients inside ``no_sync``, and runs the second's forward with
    ``set_requires_gradient_sync(False)``, turning it back on before its backward (read then)."""
    if not compiled and dist.is_initialized():  # the global micro-batches are the ranks' halves
        world = dist.get_world_size()
        x = x.view(world, 2, -1, x.shape[-1]).transpose(0, 1).reshape(-1, x.shape[-1])
    first, second = x.chunk(2)
    named = [model.get_parameter(name) for name in NAMED]

    def grad_of_named() -> None:
        grads = torch.autograd.grad(model(first), named, allow_unused=True)
        record.setdefault("autograd.grad", []).append([full(g) for g in grads])

    if i == 0:
        grad_of_named()
    with model.no_sync() if compiled else contextlib.nullcontext():  # a micro-batch discarded:
        model(second).backward()
    # step 0 sets .grad to None, step 1 zeroes it in place: either way what no_sync held goes, as eager's .grad goes
    opt.zero_grad(set_to_none=i == 0)
    with model.no_sync() if compiled else contextlib.nullcontext():
        out = model(first).mul(0.5)
        if i == 1:
            out.backward(inputs=named)
            grad_of_named()
    if i == 0:  # a forward run with sync off, its backward after leaving no_sync: held all the same
        out.backward()
    if compiled and i == 1:  # FSDP2's switch, read at backward: this forward runs with sync off
        model.set_requires_gradient_sync(False)
    loss = model(second).mul(0.5)
    if compiled:
        model.set_requires_gradient_sync(True)
    loss.backward(inputs=named if i == 0 else None)
    return loss


class BufferNet(Net):
    """Blocks that write a buffer in place, the first holding a GRU that the root calls (so the
    block's template finds the GRU unused, then sees it read by its parent), and a GRU in the
    root unit. One GRU per place: each call is a graph break whose frames Dynamo compiles again
    per mode (train, eval), and a second block with one covers nothing the first does not."""

    def __init__(self) -> None:
        super().__init__(CountingBlock)
        self.blocks[0].rnn = RNNBlock()
        self.rnn = RNNBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rnn(self.inp(x))
        h = self.blocks[0].rnn(self.blocks[0](h))
        return self.out(self.blocks[1](h)).pow(2).mean()


def _eval_step(model, x, opt, i, compiled, record):
    """Train mode, then eval mode (the buffers read, not written)."""
    loss = model(x)
    loss.backward()
    model.eval()
    with torch.no_grad():
        record.setdefault("eval", []).append(global_mean(model(x), compiled))
    model.train()
    return loss


def _flip_step(model, x, opt, i, compiled, record):
    """Freeze one layer after the first step, unfreeze another that started frozen."""
    if i == 1:
        model.blocks[1].fc2.weight.requires_grad_(False)
        model.blocks[0].fc1.weight.requires_grad_(True)
    loss = model(x)
    loss.backward()
    return loss


class PairBlock(Block):
    """A block that returns a tuple: its output and a side output through a layer of its own
    (``side``), which reaches nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), self.side(x)


class TwoHeads(Net):
    """``Net`` of ``PairBlock``s with two heads: forward returns both losses, a tuple, and stores
    the blocks' output on the model (``self.last_hidden``), as models keep hidden states for a loss
    of their own. The first block's side output is never read (its ``side`` keeps ``.grad``
    ``None`` in eager); the last block's feeds the second head only."""

    def __init__(self) -> None:
        super().__init__(PairBlock)
        self.other = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h, side = block(h)
        self.last_hidden = h
        return self.out(h).pow(2).mean(), self.other(side).pow(2).mean()


def _partly_read_step(model, x, opt, i, compiled, record):
    """A loss that reads some of a graph's outputs: the second member of the returned tuple (step
    0), the intermediate the model stored (step 1: neither head reached), the first member of a
    second forward's tuple, the first forward's outputs unread (step 2). Eager leaves the heads
    it does not reach ``None``, so AdamW's weight decay leaves them as they are."""
    if i == 0:
        loss = model(x)[1]
    elif i == 1:
        model(x)
        loss = model.last_hidden.pow(2).mean()
    else:
        model(x)
        loss = model(x)[0]
    loss.backward()
    return loss


# each case several features that do not interact, so the matrix costs a few compiles per stage;
# the features each covers are in its name (docs/semantics.md lists them one by one)
CASES: dict[str, Case] = {
    "hooks, param groups, clip_grad_norm_": Case(prepare=_hooks_before_compile, after_compile=_hooks_after_compile,
                                                 optimizer=_param_groups, step=_clip_step),
    "functional_call, stateless, swapped values, state_dict": Case(step=_substituted_step),
    "parametrize, weight_norm, frozen, checkpoint": Case(prepare=_reparametrized_frozen_checkpointed),
    # the tied weight's post-accumulate-grad hook steps it once per backward, with its uses' summed gradient
    "tied and shared parameters, optimizer in backward": Case(build=Tied, after_compile=_optimizer_in_backward,
                                                              optimizer=lambda model: None),
    "unused parameters, no_sync, backward(inputs=), autograd.grad": Case(build=UnusedNet, step=_no_sync_step),
    "in-place buffer updates, RNN modules": Case(build=BufferNet, step=_eval_step),
    "rank-divergent routing": Case(build=lambda: Net(MoEBlock)),
    "outputs read in part: a tuple's member, a stored intermediate, a second forward": Case(
        build=TwoHeads, step=_partly_read_step, steps=3),
}
# left out of the spawned runs: at stage 0 no forward collective lets the schedule check see the
# per-parameter build's ranks run different graphs, and their backward all-reduces then wait for
# the collective timeout (a CollectiveError) and leave the ranks out of step for the next case
NOT_RUN = {("rank-divergent routing", False, 0)}
# (stage, unit_templates) of the matrix: the default build (templates, flat shards, islands) at
# stages 0, 1 and 3; the per-parameter build (Config(unit_templates=False)) at its two ends, stage 0
# (replicated parameters, gradients all-reduced) and stage 3 (gathered in forward and again in
# backward, gradients reduce-scattered). Its stages 1-2 put together pieces of those two (a forward
# gather, a reduce-scatter) that the same per-parameter hooks and markers serve; a cell costs a
# compile. The default build's stage 2 is left out for the same reason: the runtime has no stage
# branch, and its graphs are stage 1's (sharded, one forward gather kept for backward) but for where
# insert_reduce_scatter places each reduce-scatter, after the bucket's last gradient, which is
# stage 3's placement (stage 1's is the end of backward); tests/test_parity.py trains stage 2 against eager.
DEFAULT_BUILDS = ((0, True), (1, True), (3, True))
PER_PARAMETER_BUILDS = ((0, False), (3, False))
BUILDS = DEFAULT_BUILDS + PER_PARAMETER_BUILDS
# refused, by name: the captured graphs decided which gradients are reduced (in process, fake world)
REFUSED_CASES: dict[str, Case] = {
    "requires_grad flips": Case(prepare=lambda model: model.blocks[0].fc1.requires_grad_(False), step=_flip_step),
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def _train(case: Case, model: nn.Module, x: torch.Tensor, compiled: bool) -> dict:
    record: dict = {"losses": [], "grads": [], "params": [], "buffers": []}
    opt = case.optimizer(model)
    for i in range(case.steps):
        if case.step is None:
            loss = model(x)
            loss.backward()
        else:
            loss = case.step(model, x, opt, i, compiled, record)
        record["losses"].append(global_mean(loss, compiled))
        record["grads"].append(_grads(model))
        if opt is not None:
            opt.step()
            opt.zero_grad()
        record["params"].append({n: full(p) for n, p in model.named_parameters()})
        record["buffers"].append({n: full(b) for n, b in model.named_buffers()})
    return record


def run_case(rank: int, world: int, name: str, stage: int, templates: bool) -> dict:
    """One case at one stage: ``{"ours": record, "reference": record}`` or ``{"refused": (class, message)}``."""
    case = CASES.get(name) or REFUSED_CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case.build()
    if case.prepare is not None:
        case.prepare(model)
    reference = copy.deepcopy(model)
    if case.prepare is not None:  # hooks are not deep-copied: prepare the copy the same way
        fresh = case.build()
        case.prepare(fresh)
        fresh.load_state_dict(model.state_dict())
        reference = fresh
    batch = torch.randn(ROWS * world, 4, generator=torch.Generator().manual_seed(1))
    try:
        compiled = zerograph.compile(model, stage=stage, config=zerograph.Config(unit_templates=templates))
        if case.after_compile is not None:
            case.after_compile(compiled, True)
        ours = _train(case, compiled, batch.chunk(world)[rank], True)
    except ZeroGraphError as exc:
        return {"refused": (type(exc).__name__, str(exc))}
    if case.after_compile is not None:
        case.after_compile(reference, False)
    return {"ours": ours, "reference": _train(case, reference, batch, False), "read_frames": _read_frames()}


def _read_frames() -> list[str]:
    """The functions of a parameter read that Dynamo compiled as frames of their own: a read met
    as a frame (eager code after a graph break, e.g. nn.GRU's weight refresh) runs eagerly with
    everything it calls (zerograph.shard.sharding), so this is ``[]``."""
    reads = (DTensor.to_local, torch.distributed.tensor._api._ToTorchTensor.forward, ops._unshard_setup,
             flat.FlatShard.full_parameter, flat.FlatShard.restore_)
    return [fn.__qualname__ for fn in reads if torch._dynamo.eval_frame._debug_get_cache_entry_list(fn)]


def semantics_runs(rank: int, world: int, builds: tuple[tuple[int, bool], ...] = BUILDS,
                   names: tuple[str, ...] | None = None) -> dict:
    """Every case of ``names`` (default all) in each of ``builds`` (``(stage, templates)``):
    ``{(stage, name, templates): result or traceback}``. One process pair for every build: the
    templates traced for one stage serve the others with the same shard layout."""
    out: dict = {}
    for stage, templates in builds:
        for name in names or tuple(CASES):
            if (name, templates, stage) in NOT_RUN:
                continue
            out[stage, name, templates] = run_case_in_step((stage, name, templates), run_case, rank, world, name,
                                                           stage, templates)
    dist.barrier()
    return out
