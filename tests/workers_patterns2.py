"""Models, rank workers and single-process references for checkpoints, evaluation, BatchNorm
CNNs and dynamic shapes. Workers run on ranks spawned by ``tests.distributed.spawn``
and return plain data; references run single-process and eagerly.

Without SyncBatchNorm each rank normalises its own micro-batch and keeps its own running
statistics (DDP's semantics), so a reference for a model with BatchNorm is not "the model on the
global batch": it runs the model once per rank slice, each time with that rank's copy of the
buffers (``torch.func.functional_call``), and averages the per-rank losses, which is exactly the
loss whose gradient the ranks' averaged gradients are.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

import zerograph
from tests.distributed import run_case_in_step, timed
from zerograph.passes.liveness import timeline
from zerograph.runtime.state import graphs_of, runtime_of_model

from .models import build as build_named
from .models import rank_slice


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


# == checkpoints ===================================================================================

class CheckpointNet(nn.Module):
    """Frozen input projection Linear(7, 10) (a bias of 10 elements: uneven shards at world
    sizes 3 and 4), two trainable Linear units, ``tail.weight`` tied to ``blocks.0.weight``, a
    one-row head (empty shards on every rank but 0) and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(7, 10).requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 5)])
        self.tail = nn.Linear(10, 10)
        self.tail.weight = self.blocks[0].weight
        self.head = nn.Linear(5, 1)
        self.register_buffer("out_scale", torch.tensor([0.5]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        h = torch.tanh(self.blocks[0](h))
        h = torch.tanh(self.tail(h))
        h = torch.tanh(self.blocks[1](h))
        return _mse(self.out_scale * self.head(h), y)


CKPT_BATCH, CKPT_LR, CKPT_SAVE_AFTER, CKPT_STEPS = 12, 1e-2, 2, 4  # 12 rows split 4, 3 and 2 ways


def checkpoint_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(CKPT_BATCH, 7, generator=g), torch.randn(CKPT_BATCH, 1, generator=g)


def build_checkpoint_net(seed: int = 0) -> CheckpointNet:
    torch.manual_seed(seed)
    return CheckpointNet()


def checkpoint_reference() -> dict:
    """Single-process eager AdamW on the global batch, ``CKPT_STEPS`` steps."""
    model = build_checkpoint_net()
    opt = torch.optim.AdamW(model.parameters(), lr=CKPT_LR)
    losses = []
    for step in range(CKPT_STEPS):
        loss = model(*checkpoint_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _checkpoint_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world_size: int,
                     group: dist.ProcessGroup | None = None) -> float:
    loss = model(*rank_slice(checkpoint_batch(step), rank, world_size))
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / world_size


def _compiled_checkpoint_net(seed: int, stage: int,
                             group: dist.ProcessGroup | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = zerograph.compile(build_checkpoint_net(seed), stage=stage, process_group=group)
    return model, torch.optim.AdamW(model.parameters(), lr=CKPT_LR)


def checkpoint_jobs(rank: int, world_size: int, root: str, resumes: tuple[tuple[int, int], ...]) -> dict:
    """The uninterrupted job on all ``world_size`` ranks (stage 3, ``CKPT_STEPS`` steps, saved to
    ``root/ckpt`` after ``CKPT_SAVE_AFTER``), then one resumed job per ``(world size, stage)`` in
    ``resumes`` on the first ranks: a fresh model (another seed) compiled over a process group of
    that size, loaded from the checkpoint, trained the remaining steps.

    The resumed jobs run in the same processes on subgroups (a spawn costs more than the jobs);
    for the model, DCP and every collective their world is the subgroup. Jobs run in order of
    decreasing size, so the ranks of each job have compiled the same models before it (marker
    keys agree). The smallest job also checks refusals, export and overwriting.

    Returns ``{"uninterrupted": ..., <world size>: ... for the jobs this rank was part of}``.
    """
    from zerograph import checkpoint

    path = f"{root}/ckpt"
    model, opt = _compiled_checkpoint_net(seed=0, stage=3, group=None)
    losses = []
    for step in range(CKPT_STEPS):
        if step == 0:
            checkpoint.save(model, opt, f"{root}/initial")  # before any step: an optimizer without state
        if step == CKPT_SAVE_AFTER:
            checkpoint.save(model, opt, path)
        losses.append(_checkpoint_step(model, opt, step, rank, world_size))
    out: dict = {"uninterrupted": {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}}
    smallest = min(size for size, _ in resumes)
    for size, stage in sorted(resumes, reverse=True):
        group = dist.new_group(list(range(size)))  # every rank takes part in creating it
        if rank < size:
            out[size] = _resumed_job(rank, size, stage, group, path, f"{root}/extra" if size == smallest else None)
        dist.barrier()
    return out


def _resumed_job(rank: int, world_size: int, stage: int, group: dist.ProcessGroup, path: str,
                 extra_dir: str | None) -> dict:
    from zerograph import checkpoint

    model, opt = _compiled_checkpoint_net(seed=1, stage=stage, group=group)
    out: dict = {}
    if extra_dir is not None:
        out["refusals"] = _refusals(model, opt, group, extra_dir)
    checkpoint.load(model, opt, path)
    out["local_shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    out["opt_steps"] = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters() if p in opt.state}
    out["loaded"] = {n: _full(p) for n, p in model.named_parameters()}
    out["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    if extra_dir is not None:
        checkpoint.save(model, opt, f"{extra_dir}/resaved")  # overwritten below by the trained state
    out["losses"] = [_checkpoint_step(model, opt, step, rank, world_size, group)
                     for step in range(CKPT_SAVE_AFTER, CKPT_STEPS)]
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    if extra_dir is not None:
        out["full_rank0"] = checkpoint.full_state_dict(model)
        out["full_everywhere"] = checkpoint.full_state_dict(model, cpu_offload=False)
        with torch.no_grad():
            final = model(*rank_slice(checkpoint_batch(CKPT_STEPS), rank, world_size)).detach().clone()
        dist.all_reduce(final, group=group)
        out["final_loss"] = final.item() / world_size
        out["resave"] = _overwrite_and_reload(model, opt, group, stage, f"{extra_dir}/resaved")
        out["from_initial"] = _train_from_initial(rank, world_size, stage, group, f"{os.path.dirname(path)}/initial")
    return out


def _train_from_initial(rank: int, world_size: int, stage: int, group: dist.ProcessGroup, path: str) -> dict:
    """Load the checkpoint saved before the first step into a fresh model and train from it."""
    from zerograph import checkpoint

    model, opt = _compiled_checkpoint_net(seed=2, stage=stage, group=group)
    model(*rank_slice(checkpoint_batch(0), rank, world_size)).backward()
    opt.step()  # this optimizer has state; the checkpoint's had none, so loading must drop it
    opt.zero_grad()
    checkpoint.load(model, opt, path)
    state_after_load = len(opt.state)
    losses = [_checkpoint_step(model, opt, step, rank, world_size, group) for step in range(CKPT_SAVE_AFTER)]
    return {"state_after_load": state_after_load, "losses": losses}


def _refusals(model: nn.Module, opt: torch.optim.Optimizer, group: dist.ProcessGroup, directory: str) -> dict:
    """Error messages of loads that must fail, keyed by how the directory was left (``None``
    where a load wrongly succeeded):

    - ``half_written``: a real ``save`` whose job died after every rank wrote its shards but before
      the commit (simulated by skipping the rename), which leaves only ``<path>.incomplete``;
    - ``no_marker``: a complete DCP checkpoint (shards and metadata) without zerograph's marker;
    - ``mismatch``: a complete checkpoint whose tensors are not those the model and optimizer need;
    - ``missing``: nothing at all.
    """
    import torch.distributed.checkpoint as dcp

    from zerograph import checkpoint

    commit = checkpoint._commit
    checkpoint._commit = lambda staging, path: None  # the job dies right before the rename
    try:
        checkpoint.save(model, opt, f"{directory}/half_written")
    finally:
        checkpoint._commit = commit
    for name in ("no_marker", "mismatch"):
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{directory}/{name}", process_group=group)
    if dist.get_rank(group) == 0:  # complete, but without the optimizer state that load will ask for
        checkpoint._write_marker(f"{directory}/mismatch", {"format": 1, "optimizer_state": True})
    dist.barrier(group=group)
    messages = {}
    for case in ("half_written", "no_marker", "mismatch", "missing"):
        try:
            checkpoint.load(model, opt, f"{directory}/{case}")
            messages[case] = None
        except checkpoint.CheckpointError as exc:
            messages[case] = str(exc)
    return messages


def _overwrite_and_reload(model: nn.Module, opt: torch.optim.Optimizer, group: dist.ProcessGroup, stage: int,
                          path: str) -> dict:
    """Save over the existing checkpoint at ``path`` and load it into another fresh model: the
    new state (parameters and optimizer state, bit for bit) is what loads."""
    from zerograph import checkpoint

    checkpoint.save(model, opt, path)
    other, other_opt = _compiled_checkpoint_net(seed=2, stage=stage, group=group)
    checkpoint.load(other, other_opt, path)
    pairs = list(zip(model.parameters(), other.parameters()))
    return {
        "params_equal": all(torch.equal(a.to_local(), b.to_local()) for a, b in pairs),
        "state_equal": all(torch.equal(_local(opt.state[a][k]), _local(other_opt.state[b][k]))
                           for a, b in pairs if a in opt.state for k in opt.state[a]),
        "states": (len(opt.state), len(other_opt.state)),
        "leftovers": sorted(os.listdir(os.path.dirname(path))),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# == BatchNorm models: per-rank buffers in the reference ============================================

class BatchNormMLP(nn.Module):
    """Linear(7, 9) -> BatchNorm1d(9) -> Tanh -> Linear(9, 3): ``eval()`` changes the output
    (running statistics instead of batch statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9), nn.Tanh(), nn.Linear(9, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # (B, 3)


class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm layers with a residual; a strided 1x1 conv + BatchNorm shortcut
    when the shape changes (the block of He et al., arXiv 1512.03385, section 3.3)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A two-block ResNet for 3x32x32 images: stem conv + BN, blocks 8 -> 8 and 8 -> 16 (stride
    2, projection shortcut), global average pool, Linear(16, 10). Each block is a unit."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stages(self.stem(x))                     # (B, 16, 16, 16)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))  # (B, classes)


def build_bn_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "bn_mlp":
        return BatchNormMLP()
    if name == "small_resnet":
        return SmallResNet()
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    raise KeyError(name)


def bn_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of step ``step``: (inputs, targets); targets are class ids for the CNNs."""
    g = torch.Generator().manual_seed(3000 + step)
    if name == "bn_mlp":
        return torch.randn(size, 7, generator=g), torch.randn(size, 3, generator=g)
    return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)


def bn_loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return _mse(out, target) if name == "bn_mlp" else nn.functional.cross_entropy(out, target)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


class PerRankReference:
    """Single-process eager model that emulates ``world_size`` data-parallel ranks without
    SyncBatchNorm: one set of parameters, one copy of the buffers per rank."""

    def __init__(self, name: str, world_size: int, lr: float) -> None:
        self.name, self.world_size = name, world_size
        self.model = build_bn_model(name)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.rank_buffers = [_buffers(self.model) for _ in range(world_size)]

    def train_step(self, per_rank_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """One AdamW step on the mean of the ranks' losses; returns each rank's loss."""
        self.model.train()
        losses = [bn_loss(self.name, self._call(rank, x), y) for rank, (x, y) in enumerate(per_rank_batches)]
        (sum(losses) / self.world_size).backward()
        self.opt.step()
        self.opt.zero_grad()
        return [loss.item() for loss in losses]

    @torch.no_grad()
    def evaluate(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        return self._call(rank, x)

    def _call(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        # BatchNorm updates the running statistics in place: in this rank's buffers only
        return functional_call(self.model, self.rank_buffers[rank], (x,))


# == evaluation ====================================================================================

EVAL_STAGES, EVAL_STEPS, EVAL_BATCH, EVAL_LR = (1, 2, 3), 2, 8, 1e-2


def eval_input() -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(4000))  # (5, 7): not the train batch size


def eval_reference(world_size: int) -> dict:
    """Per-rank eval outputs before training and after each step, and the training losses."""
    ref = PerRankReference("bn_mlp", world_size, EVAL_LR)
    outputs = [[ref.evaluate(r, eval_input()) for r in range(world_size)]]
    losses = []
    for step in range(EVAL_STEPS):
        batch = bn_batch("bn_mlp", step, EVAL_BATCH)
        losses.append(ref.train_step([rank_slice(batch, r, world_size) for r in range(world_size)]))
        outputs.append([ref.evaluate(r, eval_input()) for r in range(world_size)])
    return {"outputs": outputs, "losses": losses}


def _sharded_baseline(model: nn.Module) -> bool:
    """Every parameter attribute, read outside forward, is the DTensor shard itself (nothing
    gathered stays reachable), with this rank's shard shape, and no gradient exists."""
    runtime = runtime_of_model(model)
    shapes = {layout.fqn: layout.local_shape(runtime.topology.rank) for layout in runtime.layouts.values()}
    for mod_name, mod in model.named_modules():
        for name, param in mod._parameters.items():
            attr = getattr(mod, name)
            if attr is not param or not isinstance(attr, DTensor) or attr.grad is not None:
                return False
            fqn = f"{mod_name}.{name}" if mod_name else name
            if fqn in shapes and tuple(attr.to_local().shape) != shapes[fqn]:
                return False
    return True


def _evaluate_both_modes(model: nn.Module, x: torch.Tensor) -> dict:
    """Eval forward under ``no_grad`` and under ``inference_mode``; the baseline after each."""
    model.eval()
    with torch.no_grad():
        no_grad = model(x)
    baseline_no_grad = _sharded_baseline(model)
    with torch.inference_mode():
        inference = model(x).clone()  # a normal tensor, comparable outside inference mode
    baseline_inference = _sharded_baseline(model)
    model.train()
    return {"no_grad": no_grad, "inference_mode": inference,
            "baseline": [baseline_no_grad, baseline_inference]}


def _inference_memory(model: nn.Module) -> list[dict]:
    """Liveness of each captured inference graph: gathered bytes at its peak and at its end,
    and the gathered values it returns (none may outlive the graph)."""
    facts = []
    for record in graphs_of(model):
        if "inference" in record:
            tl = timeline(record["inference"].graph)
            facts.append({"peak_gathered": tl.peak(("gather",)),
                          "gathered_at_end": tl.live[-1].get("gather", 0) if tl.live else 0,
                          "returned": dict(tl.saved)})
    return facts


def _eval_run(stage: int, rank: int, world_size: int) -> dict:
    # Dynamo keeps its compiled graphs, and its recompile limit (8), per code object: the models
    # of every stage share BatchNormMLP.forward, and 3 graphs each (train, no_grad, inference_mode)
    # would send the third stage's training forward to eager execution. Each stage is a fresh job.
    torch._dynamo.reset()
    model = zerograph.compile(build_bn_model("bn_mlp"), stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=EVAL_LR)
    evals, losses = [_evaluate_both_modes(model, eval_input())], []
    for step in range(EVAL_STEPS):
        x, y = rank_slice(bn_batch("bn_mlp", step, EVAL_BATCH), rank, world_size)
        loss = bn_loss("bn_mlp", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        evals.append(_evaluate_both_modes(model, eval_input()))
    return {"evals": evals, "losses": losses, "inference_graphs": _inference_memory(model),
            "graph_kinds": [sorted(k for k in rec if k != "dynamo") for rec in graphs_of(model)]}


def eval_runs(rank: int, world_size: int, stages: tuple[int, ...] = EVAL_STAGES) -> dict:
    """``{stage: result}`` (or the traceback of a failure), one fresh model per stage."""
    return _each_stage(lambda stage: _eval_run(stage, rank, world_size), stages)


def _each_stage(run: Callable[[int], dict], stages: tuple[int, ...]) -> dict:
    out: dict = {}
    for stage in stages:
        out[stage] = run_case_in_step(stage, timed, run, stage)
    return out


# == BatchNorm CNNs at stage 3 =====================================================================

CNN_STEPS, CNN_PER_RANK, CNN_LR = 2, 2, 1e-3


def cnn_reference(name: str, world_size: int) -> dict:
    ref = PerRankReference(name, world_size, CNN_LR)
    losses = []
    for step in range(CNN_STEPS):
        batch = bn_batch(name, step, CNN_PER_RANK * world_size)
        losses.append(ref.train_step([rank_slice(batch, r, world_size) for r in range(world_size)]))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in ref.model.named_parameters()},
            "rank_buffers": ref.rank_buffers}


def cnn_config(name: str) -> zerograph.Config | None:
    """ResNet-18 gets one unit per residual block (8), as FSDP2 users wrap each block; the
    default would pick only ``layer4``'s two blocks (its largest ``nn.Sequential``)."""
    if name == "resnet18":
        from torchvision.models.resnet import BasicBlock as TorchvisionBasicBlock

        return zerograph.Config(unit_classes=(TorchvisionBasicBlock,))
    return None


def cnn_run(rank: int, world_size: int, name: str, stage: int = 3) -> dict:
    """Train the CNN ``CNN_STEPS`` steps; every rank's own loss, its buffers and the parameters."""
    model = zerograph.compile(build_bn_model(name), stage=stage, config=cnn_config(name))
    opt = torch.optim.AdamW(model.parameters(), lr=CNN_LR)
    losses = []
    for step in range(CNN_STEPS):
        x, y = rank_slice(bn_batch(name, step, CNN_PER_RANK * world_size), rank, world_size)
        loss = bn_loss(name, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()},
            "buffers": _buffers(model), "graphs": len(graphs_of(model)),
            "units": len(runtime_of_model(model).units)}


# == dynamic shapes ================================================================================

DYN_LENGTHS, DYN_STEPS, DYN_PER_RANK, DYN_LR = (8, 12, 16), 4, 2, 1e-3


def dynamic_lengths(step: int, world_size: int) -> list[int]:
    """Sequence length of each rank at ``step``, drawn from ``DYN_LENGTHS`` (seeded, so the
    reference can draw the same)."""
    g = torch.Generator().manual_seed(50 + step)
    picks = torch.randint(0, len(DYN_LENGTHS), (world_size,), generator=g)
    return [DYN_LENGTHS[i] for i in picks.tolist()]


def dynamic_batch(step: int, rank: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's own (inputs, targets), (DYN_PER_RANK, length) token ids of the tiny GPT."""
    g = torch.Generator().manual_seed(5000 + 100 * step + rank)
    x = torch.randint(0, 256, (DYN_PER_RANK, length), generator=g)
    return x, torch.roll(x, -1, dims=1)


def dynamic_reference(world_size: int) -> dict:
    """Loss of a step = mean over ranks of each rank's loss on its own batch; its gradient is
    the ranks' averaged gradient."""
    model = build_named("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=DYN_LR)
    rank_losses = []
    for step in range(DYN_STEPS):
        lengths = dynamic_lengths(step, world_size)
        losses = [model(*dynamic_batch(step, r, lengths[r])) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        opt.step()
        opt.zero_grad()
        rank_losses.append([loss.item() for loss in losses])
    return {"rank_losses": rank_losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def dynamic_run(rank: int, world_size: int) -> dict:
    model = zerograph.compile(build_named("gpt"), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=DYN_LR)
    losses, lengths = [], []
    for step in range(DYN_STEPS):
        length = dynamic_lengths(step, world_size)[rank]
        loss = model(*dynamic_batch(step, rank, length))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        lengths.append(length)
    return {"losses": losses, "lengths": lengths, "graphs": len(graphs_of(model)),
            "params": {n: _full(p) for n, p in model.named_parameters()}}


# == one spawn for several checks =================================================================

def _parts() -> dict[str, Callable[[int, int], dict]]:
    return {
        "eval": eval_runs,
        "small_resnet": lambda rank, world_size: cnn_run(rank, world_size, "small_resnet"),
        "resnet18": lambda rank, world_size: cnn_run(rank, world_size, "resnet18"),
        "dynamic": dynamic_run,
    }


def run_parts(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    """``{name: result, or the traceback of its failure}`` for the named checks, run one after
    the other in this process (a spawn costs more than most checks)."""
    out: dict = {}
    for name in names:
        out[name] = run_case_in_step(name, _parts()[name], rank, world_size)
    return out
