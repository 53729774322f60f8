"""The semantics matrix: every parameter-level PyTorch feature a training script relies
on, with unit templates on (flat shards, islands) and off, at stages 0-3, world size 2, exact
against single-process eager training on the same global batch (1e-5), or refused by name.

The cases and their models are in ``tests.workers_semantics``; one spawned run trains
every case both ways, at every stage. docs/semantics.md shows the matrix as a table.
"""
from __future__ import annotations

import pytest
import torch

import zerograph

from .distributed import fake_rank, run_as_rank, spawn
from .workers_semantics import CASES, DEFAULT_BUILDS, NOT_RUN, PER_PARAMETER_BUILDS, UnusedNet, run_case, semantics_runs

TOLERANCE = 1e-5

# what each (case, templates) may answer instead of eager's numbers: the error class and words of it
REFUSALS = {("rank-divergent routing", False): ("ScheduleMismatchError", "unit_templates=True")}

@pytest.fixture(scope="module")
def runs() -> dict:
    return spawn(semantics_runs, 2, DEFAULT_BUILDS, timeout_s=1800)[0]


@pytest.fixture(scope="module")
def per_parameter_runs() -> dict:
    return spawn(semantics_runs, 2, PER_PARAMETER_BUILDS, timeout_s=1800)[0]


def _ids(builds: tuple[tuple[int, bool], ...]) -> list[str]:
    return [f"{stage}-{'unit_templates' if templates else 'per_parameter'}" for stage, templates in builds]


def _compare(ours: object, theirs: object, path: str) -> list[str]:
    """Every place where ``ours`` differs from eager's ``theirs``: a value off by more than the
    tolerance, or ``None`` on one side only (a gradient eager leaves ``None``)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), f"{path}: keys {sorted(ours)} vs {sorted(theirs)}"
        return [d for key in theirs for d in _compare(ours[key], theirs[key], f"{path}/{key}")]
    if isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), path
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in _compare(a, b, f"{path}[{i}]")]
    if ours is None or theirs is None:
        return [] if ours is None and theirs is None else [f"{path}: {ours is None and 'None'} vs eager's "
                                                          f"{theirs is None and 'None'}"]
    if isinstance(theirs, torch.Tensor):
        off = (ours.double() - theirs.double()).abs().max().item() if theirs.numel() else 0.0
    else:
        off = abs(ours - theirs)
    return [f"{path}: off by {off:.2e}"] if off > TOLERANCE else []


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage, templates", DEFAULT_BUILDS, ids=_ids(DEFAULT_BUILDS))
def test_feature_matches_eager_or_is_refused_by_name(runs, stage, case, templates):
    _check(runs, stage, case, templates)


# its own spawn, in a scope of its own: the in-process lane runs it beside the spawn lane's end
@pytest.mark.distributed
@pytest.mark.own_scope
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage, templates", PER_PARAMETER_BUILDS, ids=_ids(PER_PARAMETER_BUILDS))
def test_per_parameter_build_matches_eager_or_is_refused_by_name(per_parameter_runs, stage, case, templates):
    _check(per_parameter_runs, stage, case, templates)


def _check(runs: dict, stage: int, case: str, templates: bool) -> None:
    """The cell ``(stage, case, templates)`` of ``runs``: eager's numbers to ``TOLERANCE``, or the
    refusal ``REFUSALS`` names for it."""
    if (case, templates, stage) in NOT_RUN:
        pytest.skip("per-parameter build, stage 0: data-dependent graph breaks in a unit are caught only by "
                    "the collective timeout (docs/semantics.md); the default build runs such a unit as an island")
    result = runs[stage, case, templates]
    if check_result(result, REFUSALS.get((case, templates)), case):
        assert result["read_frames"] == [], "parameter reads compiled as graphs of their own"


def check_result(result: dict | str, refusal: tuple[str, str] | None, case: str) -> bool:
    """A spawned case's ``result``: the refusal ``refusal`` names (error class, words of its
    message; returns False), or, where it names none, eager's numbers to ``TOLERANCE`` (True)."""
    assert not isinstance(result, str), result  # a traceback: neither eager's numbers nor a refusal
    if "refused" in result:
        assert refusal is not None, f"refused, where eager's numbers were expected: {result['refused']}"
        name, message = result["refused"]
        assert name == refusal[0] and refusal[1] in message, result["refused"]
        return False
    assert refusal is None, f"expected the refusal {refusal}, got numbers"
    ours, eager = result["ours"], result["reference"]
    assert ours["losses"] and ours["grads"], "the case recorded nothing"
    assert _compare(ours, eager, case) == []
    return True


@pytest.mark.parametrize("templates", [True, False], ids=["unit_templates", "per_parameter"])
def test_requires_grad_flip_after_compile_is_refused_naming_both_parameters(templates):
    """In process (a fake world of 2): the refusal needs no numbers."""
    result = run_as_rank(run_case, 2, "requires_grad flips", 3, templates)
    name, message = result["refused"]
    assert name == "ModelChangedError"
    assert "'blocks.0.fc1.weight' (frozen -> trainable)" in message
    assert "'blocks.1.fc2.weight' (trainable -> frozen)" in message


def test_every_module_met_as_a_frame_has_a_dynamo_cache_of_its_own():
    """Each sharded module's forward, and each templated unit's, has a code object of its own,
    named after the module: Dynamo caps compiled graphs at 8 per code object, and the modules it
    meets as frames (called from eager code after a graph break in the root's loop, as in the
    no_sync case's model) once shared one, whose overflow point differed by rank with uneven
    shards (gloo's size-mismatch abort in that case). In process (a fake world of 2), no trace."""
    with fake_rank(2):
        model = zerograph.compile(UnusedNet(), stage=3)
    codes = {name: module.forward.__code__ for name, module in model.named_modules()
             if name and not isinstance(module, torch.nn.ModuleList)}
    assert len({id(code) for code in codes.values()}) == len(codes)
    assert {name: code.co_name for name, code in codes.items()} == {name: f"forward of {name}" for name in codes}
