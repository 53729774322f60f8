"""Preloaded by the warm forkserver (tests.forkserver): import zerograph and compile, run and free
one tiny GPT at stage 3, as the rank of a fake world of one, so every rank forked from the server
finds Dynamo's, AOTAutograd's and zerograph's lazily built state (imports, trace rules, source
caches, op registrations) already built. It leaves no process group, no compiled frame and the
default RNG state as it found them.

A world of one, not of 2: DTensor's caches compare device meshes by value, not by rank, so a
warm-up as rank 0 of a world of 2 handed rank 1 of a test's world of 2 its rank-0 mesh
(``get_coordinate()`` was ``(0,)`` on rank 1, and a checkpoint save wrote the wrong rows; found by
trying to break the suite, guarded by ``tests.training.check_meshes``). A mesh of one rank matches
only a world of one, where rank 0 is right."""
from __future__ import annotations

import torch
import tqdm

import zerograph
from zerograph.models.gpt import GPT, GPTConfig

# torch.fx's Interpreter makes a tqdm bar (disabled) on every run, and tqdm's first bar starts
# its monitor thread: the server would fork ranks while holding a thread that takes tqdm's lock
# every 10 s (a child forked while it held it would wait on that lock forever). No monitor.
tqdm.tqdm.monitor_interval = 0


def _warm_up() -> None:
    rng, threads = torch.random.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with zerograph.fake_world(1, 0):
            torch.manual_seed(0)
            model = zerograph.compile(GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)),
                                      stage=3)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            idx = torch.randint(0, 64, (2, 16))
            model(idx, idx).backward()
            opt.step()
            del model, opt
    finally:
        torch._dynamo.reset()
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)


_warm_up()
