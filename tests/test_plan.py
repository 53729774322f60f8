"""zerograph.plan: the ZeRO paper's memory and communication figures (arXiv 1910.02054), CPU only."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from zerograph.planning.plan import GB, Plan, plan


def sig3(x: float) -> str:
    return f"{x:.3g}"


# ----------------------------------------------------------------------------- the paper's figures


@pytest.mark.parametrize("stage, expected_gb", [(0, "120"), (1, "31.4"), (2, "16.6"), (3, "1.88")])
def test_paper_figure1_7_5b_on_64(stage, expected_gb):
    # Section 5 / Figure 1: Ψ = 7.5B, N_d = 64, K = 12 (mixed-precision Adam), GB = 1e9 bytes.
    p = plan(None, stage, 64, psi=7_500_000_000)
    assert p.psi == 7_500_000_000
    assert p.optimizer_bytes_per_param == 12
    assert p.param_bytes_per_element == 2
    assert sig3(p.bytes_per_rank["total"] / GB) == expected_gb


def test_paper_exact_byte_counts():
    psi, n = 7_500_000_000, 64
    by_stage = {s: plan(None, s, n, psi=psi).bytes_per_rank for s in range(4)}
    assert dict(by_stage[0]) == {"params": 2 * psi, "grads": 2 * psi, "optimizer_states": 12 * psi,
                                 "total": 16 * psi}
    assert by_stage[1]["total"] == 4 * psi + 12 * psi // n
    assert by_stage[2]["total"] == 2 * psi + 14 * psi // n
    assert by_stage[3]["total"] == 16 * psi // n
    assert by_stage[3]["params"] == by_stage[3]["grads"] == 2 * psi // n


def test_paper_1t_on_1024_stage3():
    p = plan(None, 3, 1024, psi=10**12)
    assert p.bytes_per_rank["total"] == 16 * 10**12 // 1024
    assert sig3(p.bytes_per_rank["total"] / GB) == "15.6"


def test_psi_mode_has_no_padding_and_one_root_unit():
    p = plan(None, 3, 7, psi=1_000_003)
    assert p.padding_bytes == 0
    assert p.units == (("<root>", 1_000_003),)
    # Without units the whole model is gathered at once: 2 bytes x Ψ, plus its gradient bucket.
    assert p.inflight_gather_bytes == 2 * 1_000_003
    assert p.bucket_bytes == 2 * 1_000_003


def test_psi_mode_unit_numels():
    psi, layers = 7_500_000_000, 30
    per = psi // layers
    p = plan(None, 3, 64, psi=psi, unit_numels=[per] * layers, prefetch_depth=1)
    assert p.units[0] == ("<root>", psi - per * layers)
    assert len(p.units) == layers + 1
    assert p.inflight_gather_bytes == 2 * 2 * per
    assert p.bucket_bytes == 2 * per
    assert p.total_with_overheads == p.bytes_per_rank["total"] + 4 * per + 2 * per


# ----------------------------------------------------------------------------- communication (section 7)


@pytest.mark.parametrize("stage, volumes", [
    (0, {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2, "total": 2}),
    (1, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0, "total": 2}),
    (2, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0, "total": 2}),
    (3, {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0, "total": 3}),
])
def test_comm_volume(stage, volumes):
    with torch.device("meta"):
        model = nn.ModuleList([nn.Linear(7, 5), nn.Linear(5, 3)])
    p = plan(model, stage, 4)
    psi = 7 * 5 + 5 + 5 * 3 + 3
    assert p.psi == psi
    assert dict(p.comm_elements_per_step) == {k: v * psi for k, v in volumes.items()}
    q = plan(None, stage, 64, psi=7_500_000_000)
    assert q.comm_elements_per_step["total"] == volumes["total"] * 7_500_000_000


# ----------------------------------------------------------------------------- real models


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(6, 4, bias=False)])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one nn.Parameter, counted once


def test_meta_model_psi_and_units():
    with torch.device("meta"):
        model = Tied()
    p = plan(model, 2, 8)
    blocks = [4 * 4 + 4, 4 * 6 + 6, 6 * 4]
    assert p.psi == 10 * 4 + sum(blocks) == sum({id(t): t.numel() for t in model.parameters()}.values())
    assert p.units == (("<root>", 40), ("blocks.0", blocks[0]), ("blocks.1", blocks[1]), ("blocks.2", blocks[2]))
    assert all(t.device.type == "meta" for t in model.parameters())


def test_tied_weights_counted_once():
    with torch.device("meta"):
        tied, untied = Tied(), Tied()
    untied.head.weight = nn.Parameter(torch.empty(10, 4, device="meta"))
    assert plan(untied, 0, 1).psi - plan(tied, 0, 1).psi == 40
    assert plan(tied, 3, 4).bytes_per_rank["total"] == 16 * plan(tied, 3, 4).psi // 4


def test_meta_and_real_model_agree():
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Tied()
    real = Tied()
    for stage in range(4):
        a, b = plan(meta, stage, 3), plan(real, stage, 3)
        assert a == b


@pytest.mark.parametrize("stage, bytes_per_element", [(0, 0), (1, 12), (2, 2 + 12), (3, 2 + 2 + 12)])
def test_padding_uneven_linear(stage, bytes_per_element):
    # Linear(7, 5) at N = 2: weight (5, 7) -> chunks of 3 rows, 2*3*7 - 35 = 7 padded elements;
    # bias (5,) -> 2*3 - 5 = 1. 8 elements over 2 ranks = 4 extra elements per rank per sharded state.
    with torch.device("meta"):
        model = nn.Linear(7, 5)
    p = plan(model, stage, 2)
    assert p.padding_bytes == 4 * bytes_per_element


def test_padding_zero_when_even_and_rounded_up():
    with torch.device("meta"):
        even = nn.Linear(4, 4)
        odd = nn.Linear(3, 1)  # weight (1, 3) at N = 4: 4*1*3 - 3 = 9; bias (1,): 3 -> 12 elements / 4 ranks
    assert plan(even, 3, 2).padding_bytes == 0
    assert plan(odd, 3, 4).padding_bytes == 3 * 16
    # N = 5, stage 1: weight 5*1*3 - 3 = 12, bias 5 - 1 = 4 -> 16 elements x 12 bytes / 5 ranks
    # = 38.4 bytes per rank, rounded up to a whole byte.
    assert plan(odd, 1, 5).padding_bytes == 39


def test_inflight_and_bucket_stage3():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(3, 5))
    n = 2
    # padded unit sizes at N = 2 (rows padded to even): 8x8+8 = 72; (3->4 rows) 4*8 + 4 = 36; 5->6 rows: 6*3 + 6 = 24
    p = plan(model, 3, n, prefetch_depth=1)
    assert [name for name, _ in p.units] == ["<root>", "0", "1", "2"]
    assert p.inflight_gather_bytes == (72 + 36) * 2
    assert p.bucket_bytes == 72 * 2
    assert plan(model, 3, n, prefetch_depth=0).inflight_gather_bytes == 72 * 2
    assert plan(model, 3, n, prefetch_depth=10).inflight_gather_bytes == (72 + 36 + 24) * 2
    assert p.total_with_overheads == (p.bytes_per_rank["total"] + p.padding_bytes
                                      + p.inflight_gather_bytes + p.bucket_bytes)
    custom = plan(model, 3, n, bucket_bytes=1000)
    assert custom.bucket_bytes == 1000


def test_overheads_stages_0_to_2():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    p0, p1, p2 = (plan(model, s, 2) for s in range(3))
    assert p0.inflight_gather_bytes == 0 and p0.bucket_bytes == 0 and p0.padding_bytes == 0
    assert p0.total_with_overheads == p0.bytes_per_rank["total"]
    for p in (p1, p2):  # the gathered copy is the formula's params term, not added again
        assert p.inflight_gather_bytes == p.bytes_per_rank["params"] == 2 * p.psi
    assert p1.bucket_bytes == 0
    assert p1.total_with_overheads == p1.bytes_per_rank["total"] + p1.padding_bytes
    assert p2.bucket_bytes == 72 * 2
    assert p2.total_with_overheads == p2.bytes_per_rank["total"] + p2.padding_bytes + p2.bucket_bytes


# ----------------------------------------------------------------------------- dtypes and optimizers


@pytest.mark.parametrize("optimizer, param_dtype, master_dtype, p_bytes, k", [
    ("adamw", torch.bfloat16, torch.float32, 2, 12),
    ("adam", torch.float16, torch.float32, 2, 12),
    ("adamw", torch.float32, torch.float32, 4, 8),   # no separate master copy
    ("sgd", torch.bfloat16, torch.float32, 2, 4),    # master copy only
    ("sgd_momentum", torch.bfloat16, torch.float32, 2, 8),
    ("sgd", torch.float32, torch.float32, 4, 0),
])
def test_bytes_from_dtypes(optimizer, param_dtype, master_dtype, p_bytes, k):
    psi = 1000
    p = plan(None, 0, 1, psi=psi, optimizer=optimizer, param_dtype=param_dtype, master_dtype=master_dtype)
    assert p.param_bytes_per_element == p_bytes and p.optimizer_bytes_per_param == k
    assert dict(p.bytes_per_rank) == {"params": p_bytes * psi, "grads": p_bytes * psi,
                                      "optimizer_states": k * psi, "total": (2 * p_bytes + k) * psi}


# ----------------------------------------------------------------------------- errors, immutability, str


@pytest.mark.parametrize("kwargs", [
    dict(stage=4), dict(stage=-1), dict(stage=True), dict(stage="1"),
    dict(world_size=0), dict(world_size=2.0),
    dict(optimizer="lamb"), dict(optimizer=None),
    dict(prefetch_depth=-1), dict(bucket_bytes=-1),
    dict(param_dtype=torch.int32), dict(master_dtype="float32"),
    dict(psi=0), dict(psi=None), dict(unit_numels=[600, 600]),
])
def test_bad_input_raises_value_error(kwargs):
    args = dict(model=None, stage=1, world_size=4, psi=1000)
    args.update(kwargs)
    model, stage, world_size = args.pop("model"), args.pop("stage"), args.pop("world_size")
    with pytest.raises(ValueError):
        plan(model, stage, world_size, **args)


def test_model_and_psi_together_raise():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not both"):
        plan(model, 1, 2, psi=10)
    with pytest.raises(ValueError):
        plan(model, 1, 2, unit_numels=[2])
    with pytest.raises(ValueError):
        plan("not a module", 1, 2)
    with pytest.raises(ValueError, match="optimizer"):
        plan(model, 1, 2, optimizer="lamb")
    with pytest.raises(ValueError, match="stage"):
        plan(model, 5, 2)


def test_plan_is_frozen():
    p = plan(None, 3, 8, psi=100)
    assert isinstance(p, Plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stage = 2
    with pytest.raises(TypeError):
        p.bytes_per_rank["total"] = 0


def test_str_table():
    text = str(plan(None, 1, 64, psi=7_500_000_000))
    assert "31.4" in text and "stage" in text and "64" in text and "2Ψ" in text
    text3 = str(plan(None, 3, 64, psi=7_500_000_000))
    assert "1.88" in text3 and "3Ψ" in text3
    assert "120" in str(plan(None, 0, 64, psi=7_500_000_000))
