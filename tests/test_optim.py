"""zerograph.optim.AdamW against torch.optim.AdamW: updates, state_dict exchange, DTensor shards.

Two checks run in fresh subprocesses (``python -m tests.test_optim <check>``): the Triton kernel
path under the Triton interpreter (``TRITON_INTERPRET`` must be set before the kernels are first
imported), and DTensor parameters, which need a process group this test must not leave behind for
other tests (a fake, communication-free group of world size 2; rank 1 holds a short shard).
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests import subprocess_checks
from tests.subprocess_checks import assert_check_passed, start_checks, stop_checks
from zerograph.optim import AdamW

SHAPES = [(1,), (7,), (33, 17), (4, 5, 6), (1023,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def make_params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(groups_of_params, seed):
    """Give the same fresh random gradient to corresponding parameters of every list."""
    gen = torch.Generator().manual_seed(seed)
    for ps in zip(*groups_of_params):
        g = torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            p.grad = g.clone()


def assert_same(a_params, a_opt, b_params, b_opt, what):
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} param {i}: {m}")
        sa, sb = a_opt.state[a], b_opt.state[b]
        assert sa["step"].dtype == sb["step"].dtype == torch.float32 and sa["step"].item() == sb["step"].item()
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {key} {i}: {m}")


def run_against_torch(steps: int, **our_kwargs):
    ours = make_params(SHAPES)
    theirs = clone_params(ours)
    opt = AdamW(ours, **HYPER, **our_kwargs)
    ref = torch.optim.AdamW(theirs, **HYPER)
    for step in range(steps):
        before = [p.detach().clone() for p in ours]
        set_grads([ours, theirs], seed=100 + step)
        opt.step()
        ref.step()
        assert_same(ours, opt, theirs, ref, f"step {step + 1}")
        assert all(not torch.equal(b, p) for b, p in zip(before, ours)), "a parameter did not move"


# --------------------------------------------------------------------------------- in-process tests

def test_matches_torch_adamw_for_10_steps():
    run_against_torch(10)


def test_param_groups_and_params_without_grad():
    ours = make_params(SHAPES, 1)
    theirs = clone_params(ours)

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.0}, {"params": ps[2:], "lr": 3e-3}]

    opt, ref = AdamW(groups(ours), **HYPER), torch.optim.AdamW(groups(theirs), **HYPER)
    for step in range(3):
        set_grads([ours[1:], theirs[1:]], seed=step)  # ours[0] never gets a gradient
        opt.step()
        ref.step()
    assert len(opt.state[ours[0]]) == 0 and torch.equal(ours[0].detach(), theirs[0].detach())
    assert_same(ours[1:], opt, theirs[1:], ref, "groups")


def _continue_both(a_params, a_opt, b_params, b_opt, steps, seed):
    for step in range(steps):
        set_grads([a_params, b_params], seed=seed + step)
        a_opt.step()
        b_opt.step()
        assert_same(a_params, a_opt, b_params, b_opt, f"after load, step {step + 1}")


def test_state_dict_loads_into_torch_and_back():
    # Ours -> torch: train ours 4 steps, copy params + state into a torch.optim.AdamW, continue both.
    ours = make_params(SHAPES, 2)
    opt = AdamW(ours, **HYPER)
    for step in range(4):
        set_grads([ours], seed=step)
        opt.step()
    # Deep copies stand in for a save/load: state_dict() shares the state tensors themselves.
    sd = copy.deepcopy(opt.state_dict())
    theirs = clone_params(ours)
    ref = torch.optim.AdamW(theirs, lr=0.5)  # hyperparameters must come from the state_dict
    ref.load_state_dict(sd)
    assert ref.param_groups[0]["lr"] == HYPER["lr"] and ref.state[theirs[0]]["step"].item() == 4
    _continue_both(ours, opt, theirs, ref, 3, seed=10)

    # Torch -> ours.
    theirs = make_params(SHAPES, 3)
    ref = torch.optim.AdamW(theirs, **HYPER)
    for step in range(4):
        set_grads([theirs], seed=20 + step)
        ref.step()
    ours = clone_params(theirs)
    opt = AdamW(ours, lr=0.5)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["betas"] == HYPER["betas"]
    _continue_both(ours, opt, theirs, ref, 3, seed=30)

    # Same format: identical keys, and the state tensors of a saved pair agree.
    a, b = opt.state_dict(), ref.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_closure_and_validation():
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0 and p.detach().lt(1.0).all()
    for bad in (dict(amsgrad=True), dict(maximize=True), dict(capturable=True), dict(differentiable=True)):
        with pytest.raises(NotImplementedError, match=next(iter(bad))):
            AdamW([p], **bad)
    for bad in (dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1.0), dict(weight_decay=-0.1)):
        with pytest.raises(ValueError):
            AdamW([p], **bad)
    # A group loaded from a torch.optim.AdamW(amsgrad=True) state is refused at step time.
    src = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], amsgrad=True)
    opt.load_state_dict(src.state_dict())
    p.grad = torch.ones(3)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        opt.step()


# ------------------------------------------------------------------------------ subprocess checks

def check_triton() -> None:
    """Kernel path (Triton interpreter) vs torch.optim.AdamW, 10 steps."""
    from triton.runtime.interpreter import InterpretedFunction

    import zerograph.kernels.adamw as adamw_mod
    from zerograph.kernels import _triton_kernels

    assert isinstance(_triton_kernels._adamw_kernel, InterpretedFunction)

    def refuse(*args, **kwargs):
        raise AssertionError("reference path used: zerograph.optim.AdamW did not dispatch to Triton")

    adamw_mod.adamw_step_reference = refuse
    run_against_torch(10)
    print("ok triton")


def check_dtensor() -> None:
    """DTensor Shard(0) parameters: updates on the local shard match torch.optim.AdamW on plain
    copies of the shards, state stays DTensor, and the state_dict moves to torch.optim.AdamW."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, rank = 2, 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def shard(full):
        local = torch.chunk(full, world, dim=0)[rank].clone()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())

    fulls = [torch.randn(s) for s in [(7,), (33, 17), (4097,), (5, 3)]]  # rank 1 holds 3, 16, 2048, 2 rows
    dparams = [torch.nn.Parameter(shard(f)) for f in fulls]
    plain = [torch.nn.Parameter(p.to_local().clone()) for p in dparams]
    opt, ref = AdamW(dparams, **HYPER), torch.optim.AdamW(plain, **HYPER)
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        for dp, pp, f in zip(dparams, plain, fulls):
            g = shard(torch.randn(f.shape, generator=gen))
            dp.grad, pp.grad = g, g.to_local().clone()
        opt.step()
        ref.step()
        for i, (dp, pp) in enumerate(zip(dparams, plain)):
            assert isinstance(opt.state[dp]["exp_avg"], DTensor), "state must mirror the parameter type"
            torch.testing.assert_close(dp.to_local(), pp.detach(), rtol=1e-6, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[dp][key].to_local(), ref.state[pp][key], rtol=1e-6, atol=1e-6)

    # torch.optim.AdamW on the same DTensors, loaded from our state_dict, continues identically.
    twins = [torch.nn.Parameter(DTensor.from_local(p.to_local().clone(), mesh, [Shard(0)], run_check=False,
                                                   shape=p.shape, stride=p.stride())) for p in dparams]
    torch_d = torch.optim.AdamW(twins, lr=0.5)
    torch_d.load_state_dict(copy.deepcopy(opt.state_dict()))
    for dp, tw, f in zip(dparams, twins, fulls):
        g = shard(torch.randn(f.shape))
        dp.grad, tw.grad = g, g
    opt.step()
    torch_d.step()
    for dp, tw in zip(dparams, twins):
        torch.testing.assert_close(dp.to_local(), tw.to_local(), rtol=1e-6, atol=1e-6)
    # And back: our optimizer accepts torch's DTensor state.
    again = AdamW(dparams, lr=0.5)
    again.load_state_dict(copy.deepcopy(torch_d.state_dict()))
    assert again.state[dparams[0]]["step"].item() == 6 and isinstance(again.state[dparams[0]]["exp_avg"], DTensor)
    dist.destroy_process_group()
    print("ok dtensor")


CHECKS = {"triton": check_triton, "dtensor": check_dtensor}


@pytest.fixture(scope="module")
def check_runs():
    """Start every subprocess check at once; each test then waits for its own."""
    procs = start_checks("tests.test_optim", CHECKS, ("triton",))
    yield procs
    stop_checks(procs)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_subprocess_check(check_runs, name):
    assert_check_passed(check_runs[name], name)


if __name__ == "__main__":
    subprocess_checks.main(CHECKS)
