"""zerograph.plan's predicted step peak: per phase of a step (forward, backward's start, a unit's
backward), model states + gathered units + full gradients + saved activations, the largest phase
checked against the allocator's measured peak of a steady-state step."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerograph
from zerograph.errors import ConfigError
from zerograph.models.gpt import GPT, GPTConfig
from zerograph.planning.plan import plan, saved_activation_bytes
from zerograph.planning.plan_activations import compiled_saved_activation_bytes
from zerograph.runtime.state import state_of

from .distributed import fake_rank


class Stack(nn.Module):
    """A root Linear(8, 8) and three blocks of unequal sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)                                  # root: 64
        self.blocks = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False),
                                     nn.Linear(8, 8, bias=False)])            # 64 each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.sum()


def meta_stack() -> nn.Module:
    with torch.device("meta"):
        return Stack()


def test_saved_activations_of_a_tiny_mlp_by_hand():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.empty(2, 8, device="meta")
    # autograd saves: Linear 1's input (2x8) and ReLU's output (2x16), which Linear 2 saves too
    # (one storage); the weights are not counted. fp32: (16 + 32) * 4 bytes.
    assert saved_activation_bytes(model, (x,)) == (2 * 8 + 2 * 16) * 4
    assert saved_activation_bytes(model, (x,), torch.bfloat16) == (2 * 8 + 2 * 16) * 2
    assert all(p.device.type == "meta" for p in model.parameters())  # the model is left as it was


def test_saved_activations_of_a_real_model_allocate_nothing():
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    assert saved_activation_bytes(model, (torch.ones(3, 4),)) == 3 * 4 * 4
    assert torch.equal(model.weight.detach(), before)


def test_compiled_saved_activations_of_a_tiny_mlp_by_hand():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.empty(2, 8, device="meta")
    # the min-cut partition saves one (2, 16) tensor, the ReLU's output or input (it recomputes
    # ReLU from its input); the input x is a primal, not an activation. fp32.
    assert compiled_saved_activation_bytes(model, (x,)) == 2 * 16 * 4 < saved_activation_bytes(model, (x,))


def test_planned_activations_are_a_templated_gpts_measured_ones_within_a_tenth():
    """Rank 0 of a fake world of 2, stage 3, the default (templated) build: the activations its
    forward graphs saved against the plan's, which cuts the whole model's joint graph with the
    templates' partition options; both below eager's (gelu recomputed in backward)."""
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.device("meta"):
        meta = GPT(cfg)
    planned = plan(meta, 3, 2, param_dtype=torch.float32, example_inputs=(idx, idx)).activation_bytes
    with fake_rank(2):
        torch.manual_seed(0)
        model = zerograph.compile(GPT(cfg), 3)
        model(idx, idx).backward()
        measured = sum(state_of(model).captured.saved_activation_bytes.values())
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)
    assert max(planned, measured) < saved_activation_bytes(meta, (idx, idx))


def test_step_peak_phases_at_stage_3():
    x = torch.empty(2, 8, device="meta")
    p = plan(meta_stack(), 3, 4, param_dtype=torch.float32, master_dtype=torch.float32, prefetch_depth=1,
             example_inputs=(x,))
    unit = 64 * 4  # bytes of one unit's parameters (8 x 8 fp32, 8 rows shard evenly over 4 ranks)
    states, acts = p.bytes_per_rank["total"] + p.padding_bytes, p.activation_bytes
    assert states == 16 * 256 // 4 and acts > 0
    # (gathered, full gradients) per phase: forward holds the root and prefetch_depth + 1 blocks;
    # the head's backward the root gathered and unpacked and its gradient; a block's backward
    # prefetch_depth + 1 blocks gathered, the root's gradient and the block's, one flat buffer
    # filled in place and reduce-scattered as it is (unit_flat_grad)
    expected = {"forward": (3 * unit, 0), "backward_start": (2 * unit, unit), "backward": (2 * unit, 2 * unit)}
    for phase, (gathered, grads) in expected.items():
        assert dict(p.step_peak_phases[phase]) == {"model_states": states, "gathered_params": gathered,
                                                   "full_gradients": grads, "activations": acts}, phase
    assert p.step_peak_phase == "backward" and p.step_peak_breakdown == p.step_peak_phases["backward"]
    assert p.step_peak_bytes == sum(p.step_peak_breakdown.values()) == states + 4 * unit + acts
    # a bucket size given: the gradients are copied into buckets of it, alive beside them
    bucketed = plan(meta_stack(), 3, 4, param_dtype=torch.float32, master_dtype=torch.float32, prefetch_depth=1,
                    bucket_bytes=1000)
    assert bucketed.step_peak_phases["backward"]["full_gradients"] == 2 * unit + 1000
    assert "step peak, at backward" in str(p)


def _allocation_peaks(step) -> dict[str, int]:
    """The most bytes ``step()`` allocated above what was held at its start, over the whole step
    and over its forward (a ``FORWARD`` ``record_function`` inside it), from the CPU allocator's
    events (``torch.profiler(profile_memory=True)``), in the order they happened."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    kineto = prof.profiler.kineto_results
    forward = next(e for e in kineto.events() if e.name() == "FORWARD")
    changes = sorted((e.start_ns(), e.nbytes()) for e in kineto.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    running, peaks = 0, {"step": 0, "forward": 0}
    for t, nbytes in changes:
        running += nbytes
        peaks["step"] = max(peaks["step"], running)
        if forward.start_ns() <= t <= forward.end_ns():
            peaks["forward"] = max(peaks["forward"], running)
    return peaks


def test_planned_step_peak_is_a_measured_steady_state_step_within_a_tenth():
    """Rank 0 of a fake world of 8, stage 3, a GPT whose root (the tied embedding) is as large as
    a block and whose activations are small beside them, as at 7.5B: the plan's phases against the
    allocator's peaks of the second step (the optimizer's state held), over the bytes held at its
    start (parameter shards and optimizer state: ``bench.held_bytes``): the whole step's peak, in a
    unit's backward, and the forward's."""
    from zerograph.bench.memory import held_bytes

    cfg = GPTConfig(vocab_size=3072, block_size=16, n_layer=3, n_head=2, n_embd=256)  # root 3.1 MiB, blocks 3 MiB
    idx = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        meta = GPT(cfg)
    p = plan(meta, 3, 8, param_dtype=torch.float32, master_dtype=torch.float32,
             example_inputs=(idx.to("meta"), idx.to("meta")))
    with fake_rank(8):
        torch.manual_seed(0)
        model = zerograph.compile(GPT(cfg), 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            with torch.profiler.record_function("FORWARD"):
                loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        held = sum(held_bytes(model, opt).values())
        peaks = _allocation_peaks(step)
    measured = {phase: held + peak for phase, peak in peaks.items()}
    planned = {phase: sum(parts.values()) for phase, parts in p.step_peak_phases.items()}
    assert p.step_peak_phase == "backward" and measured["step"] > measured["forward"]
    assert abs(p.step_peak_bytes - measured["step"]) <= 0.1 * measured["step"], (planned, measured)
    assert abs(planned["forward"] - measured["forward"]) <= 0.1 * measured["forward"], (planned, measured)


def test_step_peak_without_inputs_leaves_activations_out_and_says_so():
    p = plan(meta_stack(), 3, 4)
    assert p.activation_bytes is None and p.step_peak_breakdown["activations"] == 0
    assert any("example_inputs" in note for note in p.peak_notes)
    assert p.step_peak_bytes == sum(p.step_peak_breakdown.values())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_step_peak_below_stage_3_gathers_nothing_extra(stage):
    p = plan(meta_stack(), stage, 4)
    assert all(parts["gathered_params"] == 0 for parts in p.step_peak_phases.values())
    # stage 2: the root's gradient and a block's (bf16); below, full gradients are model states
    assert p.step_peak_breakdown["full_gradients"] == (2 * 64 * 2 if stage == 2 else 0)


def test_step_peak_grows_with_prefetch_depth():
    shallow, deep = plan(meta_stack(), 3, 4, prefetch_depth=0), plan(meta_stack(), 3, 4, prefetch_depth=2)
    assert deep.step_peak_bytes - shallow.step_peak_bytes == 2 * 64 * 2  # two more blocks gathered, bf16


def test_example_inputs_errors():
    with pytest.raises(ConfigError, match="needs a model"):
        plan(None, 3, 4, psi=100, example_inputs=(torch.empty(1),))
    with pytest.raises(ConfigError, match="sequence"):
        plan(meta_stack(), 3, 4, example_inputs=torch.empty(2, 8))
    with pytest.raises(ConfigError, match="failed on fake tensors"):
        plan(meta_stack(), 3, 4, example_inputs=(torch.empty(2, 5, device="meta"),))  # wrong width


def test_budget_refuses_a_peak_above_it_with_the_numbers():
    from zerograph.planning.budget import check_memory_budget

    p = plan(meta_stack(), 3, 4, example_inputs=(torch.empty(2, 8, device="meta"),))
    check_memory_budget(p, None)
    check_memory_budget(p, p.step_peak_bytes)  # exactly at the budget fits
    with pytest.raises(ConfigError, match="exceeds memory.budget_bytes") as err:
        check_memory_budget(p, p.step_peak_bytes - 1)
    assert "gathered params" in str(err.value) and "prefetch_depth=0" in str(err.value)
    with pytest.raises(ConfigError, match="memory.budget_bytes must be an int"):
        check_memory_budget(p, 0)


def test_plan_for_config_reads_the_schedule_and_dtypes():
    import zerograph
    from zerograph.planning.budget import plan_for_config

    p = plan_for_config(meta_stack(), 3, 4, zerograph.Config(schedule=zerograph.SchedulePolicy(prefetch_depth=2)))
    assert p.prefetch_depth == 2 and p.param_dtype == p.master_dtype == torch.float32
    q = plan_for_config(meta_stack(), 3, 4, zerograph.Config(
        mixed_precision=zerograph.MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
    assert q.param_dtype == torch.bfloat16 and q.master_dtype == torch.float32
