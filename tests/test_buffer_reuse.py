"""buffer_reuse: comm buffers come from a fixed pool, allocated in the first step only."""
from __future__ import annotations

import functools

import pytest
import torch

import zerograph
from zerograph.passes.buffer_reuse import PooledBuffer, assign_slots, slot_bytes

from .distributed import spawn
from .models import reference_training
from .test_parity import LR, check_parity
from .workers import pooled_trainings

STEPS = 3
# 4 blocks: more gathered units than the depth + 1 slots of depth 2, so the in-flight bound is one
# (8 blocks bound nothing more, at twice the compile, most of it the per-parameter build's)
MODEL = "gpt_mid"
# the default build (a flat shard per unit) at depths 1 and 2 with the pool asked for, the default
# Config (no pool: the allocator serves comm buffers), and the per-parameter build with the pool
# (which pools each bucket's send buffers too)
POOL = zerograph.MemoryPolicy(pool_comm_buffers=True)
CONFIGS = (zerograph.Config(schedule=zerograph.SchedulePolicy(prefetch_depth=1), memory=POOL),
           zerograph.Config(schedule=zerograph.SchedulePolicy(prefetch_depth=2), memory=POOL),
           zerograph.Config(), zerograph.Config(schedule=zerograph.SchedulePolicy(prefetch_depth=1), unit_templates=False,
                                                memory=POOL))
POOLED = (0, 1, 3)  # the runs with the pass on


def test_slots_number_the_most_buffers_alive_at_once() -> None:
    plan = assign_slots([PooledBuffer("a", "gather", 10, 0, 5), PooledBuffer("b", "gather", 20, 3, 8),
                         PooledBuffer("c", "gather", 5, 6, 9), PooledBuffer("d", "reduce", 7, 0, 9),
                         PooledBuffer("e", "gather", 1, 9, 9)])
    slot = {b.node: b.slot for b in plan}
    assert slot["a"] != slot["b"] and slot["b"] != slot["c"] and slot["c"] != slot["e"]
    assert slot["a"] == slot["c"]  # a dies at 5, c starts at 6
    assert len({b.slot for b in plan if b.role == "gather"}) == 2  # at most two alive at once
    # constant-size slots: each as large as the largest buffer it serves; roles never share
    assert slot_bytes(plan) == {("gather", slot["a"]): 10, ("gather", slot["b"]): 20, ("reduce", slot["d"]): 7}


def test_touching_lifetimes_do_not_share_a_slot() -> None:
    """Inclusive ends: a buffer read by the node that writes the next one must not be that one."""
    plan = assign_slots([PooledBuffer("a", "gather", 4, 0, 3), PooledBuffer("b", "gather", 4, 3, 6)])
    assert plan[0].slot != plan[1].slot


@functools.lru_cache(maxsize=None)
def runs() -> tuple:
    # the first run with the pool's debug mode: every slot poisoned when its graph returns, and
    # checked untouched when taken again (a late writer raises PoolCorruptionError)
    return tuple(spawn(pooled_trainings, 2, MODEL, 3, STEPS, 4, LR, CONFIGS, (True,), timeout_s=600))


@pytest.mark.distributed
def test_no_comm_buffer_is_allocated_after_the_first_step() -> None:
    for rank_runs in runs():
        for run in (rank_runs[i] for i in POOLED):
            assert run["allocations"][0] > 0
            assert run["allocations"] == [run["allocations"][0]] * STEPS
            assert run["pool_bytes"] == [run["pool_bytes"][0]] * STEPS
        assert rank_runs[2]["allocations"] == [0] * STEPS  # the default: nothing pooled


@pytest.mark.distributed
@pytest.mark.parametrize("config_index, depth", [(0, 1), (1, 2), (3, 1)])
def test_gathered_outputs_take_depth_plus_one_slots(config_index: int, depth: int) -> None:
    run = runs()[0][config_index]
    unit_bytes = run["unit_bytes"]
    flat = config_index != 3  # the blocks on flat shards; the root unit, not a template's, per parameter
    assert run["flat_units"] == (len(unit_bytes) - 1 if flat else 0)
    for (graph, kind), pooled in run["pooled"].items():
        gathered = [b for b in pooled if b["role"] == "gathered"]
        # stage 3: every unit gathered in both graphs; all but the root's pooled (buffer_reuse's doc)
        assert len(gathered) == len(unit_bytes) - 1, (graph, kind)
        assert all(b["tag"] == "gather" for b in gathered)
        # flat: the gathered buffer is the unit in use, plus d in flight; per parameter it dies at its
        # copy-out (unpack_gathered), which precedes the next gather's start (schedule_overlap), so
        # only the d in flight hold a slot at once
        slots = depth + 1 if flat else max(1, depth)
        assert len({b["slot"] for b in gathered}) == slots, (graph, kind)
        # a flat shard is its all-gather's send buffer and its gradient the reduce-scatter's: nothing
        # to pool; per parameter, each block bucket's copy-in is pooled
        sends = {b["tag"] for b in pooled if b["role"] == "send"}
        assert sends == (set() if flat else {"gather", "reduce"} if kind == "backward" else {"gather"})
    # measured: the bytes the pool allocated for all-gather outputs, d + 1 buffers of at most a unit each
    assert run["pool_bytes"][-1]["gathered"] <= (depth + 1) * max(unit_bytes[1:])


@pytest.mark.distributed
def test_pooled_training_is_bitwise_the_unpooled_one_and_matches_eager() -> None:
    """Run 0 ran in the pool's debug mode: it raised nothing (no slot written after release) and,
    bitwise equal to the unpooled run, no tensor read poison (none outlived its graph in a slot)."""
    reference = reference_training(MODEL, STEPS, 4, LR)
    for pooled_d1, pooled_d2, unpooled, per_parameter in runs():
        assert pooled_d1["pool_debug"] and not pooled_d2["pool_debug"]
        check_parity(per_parameter, reference)
        for pooled in (pooled_d1, pooled_d2):
            assert pooled["losses"] == unpooled["losses"]
            for name, value in unpooled["params"].items():
                assert torch.equal(pooled["params"][name], value), name
            check_parity(pooled, reference)


def test_debug_pool_poisons_released_slots_and_catches_a_late_writer() -> None:
    """The debug mode's two halves on a pool alone: a slot reads ``POISON`` after its graph
    released it, and a write after release (what a collective still running, or a tensor that
    outlived its graph in the slot, would do) raises when the slot is taken again."""
    from zerograph.runtime.buffer_pool import BufferPool

    pool = BufferPool(debug=True)
    first = pool.take("gathered", 0, 8, torch.float32, torch.device("cpu"))
    first.fill_(1.0)  # the graph uses its buffer
    pool.release_all()  # the graph returned
    assert bool((first.view(torch.uint8) == BufferPool.POISON).all())
    again = pool.take("gathered", 0, 8, torch.float32, torch.device("cpu"))  # untouched: fine
    pool.release_all()
    again[3] = 2.0  # a late write into the released slot
    with pytest.raises(zerograph.PoolCorruptionError, match="slot 0 .'gathered'.* written after its graph released it"):
        pool.take("gathered", 0, 8, torch.float32, torch.device("cpu"))
    off = BufferPool(debug=False)
    buf = off.take("send", 0, 4, torch.float32, torch.device("cpu"))
    off.release_all()
    buf[0] = 1.0
    off.take("send", 0, 4, torch.float32, torch.device("cpu"))  # no checks when off

