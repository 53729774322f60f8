"""Rank functions of the meta-device / weight-loading tests (spawned by ``tests.distributed.spawn``).

Each batches several checks per stage so that a world size costs one spawn; they return plain
data (names that differ, losses, maximal differences) and the tests assert on it.
"""
from __future__ import annotations

import ctypes
import json
import os
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import zerograph
from zerograph.bench.side_by_side import _reset_peak
from zerograph.io.loading import local_rows
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.models.llama import Llama, LlamaConfig

# shard sizes that do not divide evenly at world 2 or 4: vocab 251 rows, block 15 rows, qkv 30
# rows (world 4: 8, 8, 8, 6), n_embd 10 rows (world 4: 3, 3, 3, 1)
UNEVEN_GPT = GPTConfig(vocab_size=251, block_size=15, n_layer=2, n_head=2, n_embd=10)
# the memory test's model: 8 blocks, ~100 MB of fp32 parameters, so it dwarfs the fixed costs
BIG_GPT = GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=512)


def gpt_init_passes(model: nn.Module, cfg: GPTConfig) -> list:
    """``GPT.__init__``'s random stream as ``init_weights`` passes (the model's own ``init_passes``)."""
    return model.init_passes()


def meta_gpt(cfg: GPTConfig, stage: int) -> nn.Module:
    with torch.device("meta"):
        model = GPT(cfg)
    return zerograph.compile(model, stage=stage)


def gpt_batch(cfg: GPTConfig, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (size, cfg.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _differing(full: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (or absent)."""
    return [k for k, v in reference.items() if k not in full or not torch.equal(full[k].cpu(), v)]


def write_checkpoints(state: dict[str, torch.Tensor], directory: str) -> tuple[str, str]:
    """A single-file and a two-file (indexed) safetensors checkpoint of ``state``, the tied LM head
    left out as ``save_pretrained`` does. Returns (file, index directory)."""
    state = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    os.makedirs(os.path.join(directory, "sharded"), exist_ok=True)
    single = os.path.join(directory, "model.safetensors")
    save_file(state, single)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({k: state[k] for k in part}, os.path.join(directory, "sharded", file))
    index = {"metadata": {}, "weight_map": {k: f for f, part in halves.items() for k in part}}
    with open(os.path.join(directory, "sharded", "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return single, os.path.join(directory, "sharded")


def train_steps(model: nn.Module, cfg: GPTConfig, rank: int, world_size: int, steps: int, batch: int) -> list[float]:
    """``steps`` AdamW steps on this rank's slice of the global batch; the global mean losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = batch // world_size
    losses = []
    for step in range(steps):
        x, y = gpt_batch(cfg, step, batch)
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def reference_steps(model: nn.Module, cfg: GPTConfig, steps: int, batch: int) -> list[float]:
    """The same steps single-process, eager, on the global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = model(*gpt_batch(cfg, step, batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def max_difference(full: dict[str, torch.Tensor], reference: nn.Module) -> float:
    return max((full[n].cpu() - p.detach()).abs().max().item() for n, p in reference.named_parameters())


def meta_parity(rank: int, world_size: int, stages: list[int], train_stages: list[int], directory: str) -> dict:
    """Per stage: meta build + init_weights vs the ordinary build (bitwise), load_state_dict and
    both safetensors layouts vs the source (bitwise); at ``train_stages`` 3 training steps vs eager."""
    cfg = UNEVEN_GPT
    out: dict = {}
    torch.manual_seed(1)
    source = GPT(cfg)  # other values than seed 0: what the loaders must bring in
    rank_dir = os.path.join(directory, f"rank{rank}")
    single, sharded = write_checkpoints(source.state_dict(), rank_dir)
    for stage in stages:
        result: dict = {}
        started = time.perf_counter()
        model = meta_gpt(cfg, stage)
        try:
            model(*gpt_batch(cfg, 0, 2))
            result["refused_before_init"] = None
        except zerograph.ShardingError as exc:
            result["refused_before_init"] = str(exc)
        torch.manual_seed(0)
        result["left"] = zerograph.init_weights(model, gpt_init_passes(model, cfg))
        torch.manual_seed(0)
        ordinary = GPT(cfg)
        full = zerograph.checkpoint.full_state_dict(model, cpu_offload=False)
        result["init_differs"] = _differing(full, ordinary.state_dict())
        for how, load in (("load_state_dict", lambda m: m.load_state_dict(source.state_dict())),
                          ("safetensors_file", lambda m: zerograph.load_safetensors(m, single)),
                          ("safetensors_index", lambda m: zerograph.load_safetensors(m, sharded))):
            loaded = meta_gpt(cfg, stage)
            load(loaded)
            result[f"{how}_differs"] = _differing(zerograph.checkpoint.full_state_dict(loaded, cpu_offload=False),
                                                  source.state_dict())
            result[f"{how}_pending"] = zerograph.runtime.state.state_of(loaded).uninitialised.pending()
        result["seconds_loading"] = time.perf_counter() - started
        if stage in train_stages:
            result["losses"] = train_steps(model, cfg, rank, world_size, 3, 4)
            full = zerograph.checkpoint.full_state_dict(model, cpu_offload=False)
            result["reference_losses"] = reference_steps(ordinary, cfg, 3, 4)
            result["max_param_difference"] = max_difference(full, ordinary)
        result["seconds"] = time.perf_counter() - started
        out[stage] = result
    if world_size == 2:  # ranks seeded differently: refused on every rank, nothing written
        model = meta_gpt(cfg, 3)
        torch.manual_seed(rank)
        try:
            zerograph.init_weights(model, gpt_init_passes(model, cfg))
            out["diverged_rng"] = None
        except zerograph.ShardingError as exc:
            out["diverged_rng"] = str(exc)
    return out


# torchtitan's recipe at uneven sizes: vocab 61 rows, wk/wv 8 rows, the FFN's 96 rows at world 2 and 4
TITAN_LLAMA = LlamaConfig(dim=16, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=32, max_seq_len=8)


def ordinary_llama(cfg: LlamaConfig, seed: int) -> nn.Module:
    """torchtitan's way on one CPU: build, then ``init_weights()`` (its constructor draws nothing on
    meta, so the seed is set between the two)."""
    model = Llama(cfg)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def llama_meta_init(rank: int, world_size: int, steps: int = 0, forward: bool = True) -> dict:
    """torchtitan's recipe on a meta-built Llama compiled at stage 3: ``init_weights`` through
    ``model.init_module`` (its root re-assigns ``freqs_cis``), then this rank's rows against the
    ordinary build's (bitwise); with ``steps``, AdamW steps against eager on the global batch, else
    one forward (no longer refused) when ``forward``."""
    cfg = TITAN_LLAMA
    with torch.device("meta"):
        model = zerograph.compile(Llama(cfg), stage=3, device="cpu")
    compiled_buffer = model.freqs_cis
    torch.manual_seed(0)
    out: dict = {"left": zerograph.init_weights(model, model.init_module)}
    ordinary = ordinary_llama(cfg, 0)
    rows = local_rows(model)
    out["rows_differ"] = [name for name, p in model.named_parameters() for layout, start, stop in [rows[id(p)]]
                          if not torch.equal(p.to_local(), ordinary.get_parameter(name)[start:stop])]
    out["units"] = [u.name for u in zerograph.runtime.state.state_of(model).runtime.units]
    out["buffer_kept"] = model.freqs_cis is compiled_buffer  # the values were copied into compile's buffer
    out["buffer_equal"] = torch.equal(model.freqs_cis, ordinary.freqs_cis)
    if steps:
        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=torch.Generator().manual_seed(step))
            return x, torch.roll(x, -1, dims=1)

        per = 4 // world_size
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ordinary))
        out["losses"], out["reference_losses"], out["grad_differences"] = [], [], []
        for step in range(steps):
            x, y = batch(step)
            loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            out["losses"].append(mean.item() / world_size)
            ref = ordinary(x, y)
            ref.backward()
            out["reference_losses"].append(ref.item())
            out["grad_differences"].append(max((p.grad.full_tensor() - ordinary.get_parameter(n).grad).abs().max().item()
                                               for n, p in model.named_parameters()))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        out["param_difference"] = max((p.full_tensor() - ordinary.get_parameter(n)).abs().max().item()
                                      for n, p in model.named_parameters())
        out["inline_reasons"] = [k.inline_reason for k in zerograph.runtime.state.state_of(model).unit_kinds]
    elif forward:
        model(*(torch.zeros(1, cfg.max_seq_len, dtype=torch.long),) * 2)  # no longer refused
    return out


def llama_whole_model_init(rank: int, world_size: int, stage: int, through_zerograph: bool) -> dict:
    """torchtitan's whole-model ``init_weights()`` (the root initialising every unit's parameters and
    re-assigning ``freqs_cis``) on a meta-built Llama compiled at ``stage``: called directly, as
    torchtitan does, or handed to ``zerograph.init_weights`` as the root's function. Returns what
    is left uninitialised, the parameters whose rows on this rank differ from the ordinary build's
    and, where the collectives are real, those whose full tensors differ and those (not constant)
    whose two halves are equal: one draw on every rank."""
    cfg = TITAN_LLAMA
    with torch.device("meta"):
        model = zerograph.compile(Llama(cfg), stage=stage, device="cpu")
    torch.manual_seed(0)
    if through_zerograph:
        left = zerograph.init_weights(model, lambda module: module.init_weights() if module is model else None)
    else:
        model.init_weights()
        tracker = zerograph.runtime.state.state_of(model).uninitialised
        left = tracker.pending() if tracker is not None else []
    ordinary = ordinary_llama(cfg, 0)
    rows = local_rows(model)
    out: dict = {"left": left, "rows_differ": [name for name, p in model.named_parameters()
                                               for _, start, stop in [rows[id(p)]]
                                               if not torch.equal(p.to_local(), ordinary.get_parameter(name)[start:stop])]}
    out["buffer_equal"] = torch.equal(model.freqs_cis, ordinary.freqs_cis)
    if not zerograph.runtime.fake.is_fake_world():
        out["full_differ"] = [name for name, p in model.named_parameters()
                              if not torch.equal(p.full_tensor(), ordinary.get_parameter(name).detach())]
        out["halves_equal"] = [name for name, p in model.named_parameters() for full in [p.full_tensor()]
                               if p.shape[0] % 2 == 0 and full.unique().numel() > 1 and torch.equal(*full.chunk(2))]
    return out


def llama_whole_model_inits(rank: int, world_size: int, stages: list[int]) -> dict:
    """``llama_whole_model_init`` at each stage, called directly and through ``zerograph.init_weights``."""
    return {(stage, through): llama_whole_model_init(rank, world_size, stage, through)
            for stage in stages for through in (False, True)}


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def fix_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """Fix glibc malloc's mmap threshold (what ``MALLOC_MMAP_THRESHOLD_`` sets at process start).

    glibc raises its threshold to the size of the last block it unmapped, so freed blocks of that
    size stay in the heap: tens of MiB of retained, reusable memory in the peak RSS. A fixed
    threshold (which also turns the raising off) makes the RSS count what is live, which is what
    the memory test bounds. Set here, in the rank, because a rank forked from the test's
    forkserver does not read the environment variable. False where it could not be set."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes) == 1
    except OSError:
        return False


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def big_meta_memory(rank: int, world_size: int, measure_ordinary: bool = False) -> dict:
    """The 8-block GPT built on meta, compiled at stage 3 and initialised.
    Returns this rank's peak RSS growth (KiB) during compile + init (and after compile and each
    init pass), whether rank 0's gathered model equals the ordinary build bitwise, and with
    ``measure_ordinary`` the growth of an ordinary build + compile on every rank."""
    cfg = BIG_GPT
    warm = meta_gpt(UNEVEN_GPT, 3)  # a first use imports torch.compile's and DTensor's modules: not per model
    torch.manual_seed(0)
    zerograph.init_weights(warm, gpt_init_passes(warm, UNEVEN_GPT))
    with torch.device("meta"):
        meta = GPT(cfg)
    result = {"full_bytes": sum(p.numel() * p.element_size() for p in meta.parameters()),
              "block_bytes": sum(p.numel() * p.element_size() for p in meta.blocks[0].parameters()),
              "peak_reset": _reset_peak(), "stages": {}}
    before = _memory_kib("VmRSS")
    model = zerograph.compile(meta, stage=3)
    result["stages"]["compile"] = _memory_kib("VmHWM") - before
    torch.manual_seed(0)
    for i, fn in enumerate(gpt_init_passes(model, cfg)):
        zerograph.init_weights(model, fn)
        result["stages"][f"init pass {i}"] = _memory_kib("VmHWM") - before
    result["growth_kib"] = _memory_kib("VmHWM") - before
    full = zerograph.checkpoint.full_state_dict(model)  # rank 0 only, on the CPU
    del model, meta
    if rank == 0:
        torch.manual_seed(0)
        result["init_differs"] = _differing(full, GPT(cfg).state_dict())
    del full
    if measure_ordinary:
        _reset_peak()
        before = _memory_kib("VmRSS")
        torch.manual_seed(0)
        zerograph.compile(GPT(cfg), stage=3)
        result["ordinary_growth_kib"] = _memory_kib("VmHWM") - before
    return result


def meta_parity_and_memory(rank: int, world_size: int, stages: list[int], train_stages: list[int],
                           directory: str) -> dict:
    """``meta_parity``, then ``big_meta_memory`` in the same ranks (one spawn instead of two), under
    a fixed mmap threshold (``fix_mmap_threshold``, set first, as the environment variable was)."""
    threshold_fixed = fix_mmap_threshold()
    out = meta_parity(rank, world_size, stages, train_stages, directory)
    out["memory"] = {**big_meta_memory(rank, world_size), "threshold_fixed": threshold_fixed}
    return out


def meta_parity_and_llama(rank: int, world_size: int, stages: list[int], train_stages: list[int], directory: str,
                          llama_steps: int) -> dict:
    """``meta_parity``, then ``llama_meta_init`` with ``llama_steps`` of training in the same ranks
    (one spawn instead of two: a process start and the ranks' first compile cost more than the
    checks)."""
    out = meta_parity(rank, world_size, stages, train_stages, directory)
    torch._dynamo.reset()
    out["llama"] = llama_meta_init(rank, world_size, llama_steps)
    return out


def run_script(rank: int, world_size: int, script: str, argv: list[str]) -> tuple[object, str]:
    """Run ``script`` as ``__main__`` with ``argv``, as torchrun runs it on this rank (``spawn(...,
    init_group=False)`` gives the environment) -> (its exit code, what it printed)."""
    import contextlib
    import io
    import runpy
    import sys

    sys.argv = [script, *argv]
    printed = io.StringIO()
    code: object = 0
    with contextlib.redirect_stdout(printed):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
    return code, printed.getvalue()
