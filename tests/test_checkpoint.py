"""Sharded checkpoints (``zerograph.checkpoint``, on torch.distributed.checkpoint) resume at
another world size, refuse half-written directories, and export a full state dict.

A job at world size 4 trains ``CKPT_STEPS`` steps at stage 3 and saves after ``CKPT_SAVE_AFTER``;
fresh models at world size 3 (stage 2) and 2 (stage 3) load that checkpoint and train the
remaining steps (run on subgroups of the same spawned ranks: see ``checkpoint_jobs``). The model
has a frozen Linear(7, 10), a tied weight, a one-row head and a buffer, so shards are uneven
(10 rows: 3+3+3+1 at N=4, 4+4+2 at N=3, 5+5 at N=2) or empty.
"""
from __future__ import annotations

import functools

import pytest
import torch

from .distributed import spawn
from .workers_patterns2 import (
    CKPT_SAVE_AFTER,
    CKPT_STEPS,
    build_checkpoint_net,
    checkpoint_batch,
    checkpoint_jobs,
    checkpoint_reference,
)

pytestmark = pytest.mark.distributed  # every test reads the spawned jobs

SAVE_WORLD = 4
RESUMES = ((3, 2), (2, 3))  # (world size, stage) of the resumed jobs
RESUME_TOL = 1e-6  # the next step's loss, resumed vs uninterrupted
REF_TOL = 1e-5  # sharded training vs the single-process reference (fp32)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """``{"uninterrupted": per-rank results of the world-size-4 job, N: per-rank results of the
    job resumed at world size N}``."""
    root = tmp_path_factory.mktemp("checkpoints")
    per_rank = spawn(checkpoint_jobs, SAVE_WORLD, str(root), RESUMES, timeout_s=300)
    out = {"uninterrupted": [r["uninterrupted"] for r in per_rank]}
    for size, _ in RESUMES:
        out[size] = [r[size] for r in per_rank[:size]]
    return out


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    return checkpoint_reference()


def _trainable_names() -> set[str]:
    return {n for n, p in build_checkpoint_net().named_parameters() if p.requires_grad}


def test_uninterrupted_run_matches_reference(jobs) -> None:
    """Saving changes nothing: the job saved before its first step (an optimizer without state)
    and after ``CKPT_SAVE_AFTER`` steps, and still trains exactly like the reference."""
    for result in jobs["uninterrupted"]:
        assert result["losses"] == pytest.approx(reference()["losses"], rel=REF_TOL, abs=REF_TOL)


@pytest.mark.parametrize("world_size", [size for size, _ in RESUMES])
def test_resume_at_another_world_size_continues_the_run(jobs, world_size: int) -> None:
    """Every rank's next losses equal the uninterrupted run's (so parameters and AdamW moments
    were restored: the second resumed step depends on both); the final parameters match too."""
    uninterrupted = jobs["uninterrupted"][0]
    for result in jobs[world_size]:
        assert len(result["losses"]) == CKPT_STEPS - CKPT_SAVE_AFTER
        assert result["losses"] == pytest.approx(uninterrupted["losses"][CKPT_SAVE_AFTER:], abs=RESUME_TOL, rel=0)
        for name, value in uninterrupted["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=RESUME_TOL, msg=name)
            torch.testing.assert_close(result["params"][name], reference()["params"][name],
                                       rtol=REF_TOL, atol=REF_TOL, msg=name)


@pytest.mark.parametrize("world_size", [size for size, _ in RESUMES])
def test_resume_restores_frozen_weights_optimizer_state_and_buffers(jobs, world_size: int) -> None:
    initial = build_checkpoint_net()  # the saved run's initialisation (the resumed models use another seed)
    other_seed = build_checkpoint_net(seed=1)
    for rank, result in enumerate(jobs[world_size]):
        for name in ("proj.weight", "proj.bias"):  # frozen: restored bit for bit, not left at seed 1
            assert torch.equal(result["loaded"][name], getattr(initial.proj, name.split(".")[1]))
            assert not torch.equal(result["loaded"][name], getattr(other_seed.proj, name.split(".")[1]))
        # AdamW state for exactly the trainable parameters, at the saved step count
        assert set(result["opt_steps"]) == _trainable_names() - {"tail.weight"}  # tied: one parameter
        assert set(result["opt_steps"].values()) == {float(CKPT_SAVE_AFTER)}
        assert torch.equal(result["buffers"]["out_scale"], initial.out_scale)
        rows = -(-10 // world_size)  # Shard(0) of 10 rows: ceil(10 / N) per rank, the last ones fewer
        assert result["local_shapes"]["proj.bias"] == (max(0, min(rows, 10 - rank * rows)),)
        assert result["local_shapes"]["head.weight"] == ((1, 5) if rank == 0 else (0, 5))


def test_interrupted_or_foreign_checkpoint_is_refused(jobs) -> None:
    """A save interrupted before its commit leaves ``<path>.incomplete`` and no ``path``; a DCP
    directory without zerograph's completion marker is not taken as complete either, and one
    that lacks tensors the optimizer needs is named as not fitting. Every rank raises
    ``CheckpointError`` (none waits for a peer)."""
    for result in jobs[2]:
        refusals = result["refusals"]
        assert "save that was interrupted" in refusals["half_written"]
        assert "half_written.incomplete" in refusals["half_written"]
        assert "no completion marker" in refusals["no_marker"]
        assert "does not fit this model and optimizer" in refusals["mismatch"]
        assert "optimizer.state" in refusals["mismatch"]  # DCP's own words name the missing tensors
        assert refusals["missing"].startswith("no checkpoint at")


def test_saving_over_a_checkpoint_replaces_it(jobs) -> None:
    """A second save to the same path (after two more steps) replaces the first one whole: a fresh
    model loads the newer parameters and AdamW state bit for bit, and no staging or replaced
    directory is left beside it."""
    for result in jobs[2]:
        resave = result["resave"]
        assert resave["params_equal"] and resave["state_equal"]
        assert resave["states"][0] == resave["states"][1] > 0
        assert resave["leftovers"] == ["half_written.incomplete", "mismatch", "no_marker", "resaved"]


def test_full_state_dict_is_plain_and_loads_into_the_unsharded_model(jobs) -> None:
    """FSDP2's ``full_state_dict`` + ``cpu_offload``: rank 0 gets every tensor unsharded on the
    CPU, the other ranks nothing; without offload every rank gets the same full tensors."""
    rank0, rank1 = jobs[2]
    plain = build_checkpoint_net(seed=3)
    assert rank0["full_rank0"].keys() == plain.state_dict().keys()  # tied names and the buffer included
    assert rank1["full_rank0"] == {}
    for name, value in rank0["full_rank0"].items():
        assert type(value) is torch.Tensor and value.device.type == "cpu", name
        assert value.shape == plain.state_dict()[name].shape, name
        assert torch.equal(value, rank1["full_everywhere"][name]), name
    plain.load_state_dict(rank0["full_rank0"])
    with torch.no_grad():
        plain_loss = plain(*checkpoint_batch(CKPT_STEPS)).item()
    assert plain_loss == pytest.approx(rank0["final_loss"], abs=RESUME_TOL, rel=0)
    assert torch.equal(plain.proj.weight, build_checkpoint_net().proj.weight)  # frozen weights exported


def test_checkpoint_saved_before_the_first_step_resumes_as_a_fresh_start(jobs) -> None:
    """Saved before any step, the checkpoint holds no optimizer state; loading it drops the
    loading optimizer's state, so training from it repeats the uninterrupted run's first steps
    (AdamW's bias correction starts again at step 1)."""
    uninterrupted = jobs["uninterrupted"][0]
    for result in jobs[2]:
        assert result["from_initial"]["state_after_load"] == 0
        assert result["from_initial"]["losses"] == pytest.approx(uninterrupted["losses"][:CKPT_SAVE_AFTER],
                                                                 abs=RESUME_TOL, rel=0)


# -- in-process checks (world size 1): what save refuses, what load verifies -----------------------

class _Layers(torch.nn.Module):
    """``layers`` Linear(8, 8) in a row. Its own class: Dynamo caches at most 8 graphs per code object
    in a process, and every compiled model adds one for its class's ``forward``; the tests of other
    files compile ``nn.Sequential`` in this process too."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _linear_stack(layers: int, seed: int = 0, sequential: bool = False):
    """A compiled ``nn.Sequential`` (or ``_Layers``) of ``layers`` Linear(8, 8) at stage 3 and its
    AdamW after one step."""
    import zerograph

    torch.manual_seed(seed)
    linears = [torch.nn.Linear(8, 8) for _ in range(layers)]
    model = zerograph.compile(torch.nn.Sequential(*linears) if sequential else _Layers(layers), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _error(step) -> Exception:
    """The exception ``step()`` raised (a BaseException that is not an Exception fails the test)."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - the error a user sees
        return exc
    raise AssertionError("no error")


def test_save_refuses_a_folder_that_is_not_a_checkpoint(tmp_path) -> None:
    """A folder with a user's files is refused before any byte is written; so are
    foreign ``.incomplete`` / ``.replaced`` siblings; an empty folder and a checkpoint are replaced."""
    from zerograph import checkpoint

    model, opt = _linear_stack(2)
    target = tmp_path / "ckpt"
    (target / "step100").mkdir(parents=True)
    (target / "notes.txt").write_text("x")
    error = _error(lambda: checkpoint.save(model, opt, target))
    assert isinstance(error, checkpoint.CheckpointError)
    assert "exists and is not a zerograph checkpoint" in str(error) and "notes.txt, step100/" in str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing written beside it
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt", "step100"]
    assert (target / "notes.txt").read_text() == "x"
    (tmp_path / "file").write_text("y")
    assert "a file, not a directory" in str(_error(lambda: checkpoint.save(model, opt, tmp_path / "file")))
    for suffix, role in ((".incomplete", "staging directory"), (".replaced", "previous checkpoint set aside")):
        target = tmp_path / f"other{suffix[1:]}"
        sibling = tmp_path / f"{target.name}{suffix}"
        sibling.mkdir()
        (sibling / "mine.txt").write_text("z")
        error = _error(lambda target=target: checkpoint.save(model, opt, target))
        assert isinstance(error, checkpoint.CheckpointError) and role in str(error), error
        assert (sibling / "mine.txt").read_text() == "z" and not target.exists()
    (tmp_path / "empty").mkdir()
    checkpoint.save(model, opt, tmp_path / "empty")  # nothing to lose
    checkpoint.save(model, opt, tmp_path / "empty")  # a checkpoint: replaced
    checkpoint.load(model, opt, tmp_path / "empty")


def test_strict_load_names_the_unexpected_key(tmp_path) -> None:
    """Two layers saved, one loaded: refused by default with the first unexpected
    key on the first line; ``strict=False`` loads the shared layer; shapes are checked either way."""
    from zerograph import checkpoint

    two, two_opt = _linear_stack(2, sequential=True)
    checkpoint.save(two, two_opt, tmp_path / "two")
    one, one_opt = _linear_stack(1, seed=1, sequential=True)
    error = _error(lambda: checkpoint.load(one, one_opt, tmp_path / "two"))
    assert isinstance(error, checkpoint.CheckpointError)
    first_line = str(error).splitlines()[0]
    assert "unexpected key 'model.1.bias'" in first_line, first_line
    checkpoint.load(one, one_opt, tmp_path / "two", strict=False)
    assert torch.equal(one[0].weight.full_tensor(), two[0].weight.full_tensor())  # the shared layer loaded
    assert one_opt.state[one[0].weight]["step"] == two_opt.state[two[0].weight]["step"]
    three, three_opt = _linear_stack(3, sequential=True)
    assert "missing key 'model.2.bias'" in str(_error(lambda: checkpoint.load(three, three_opt, tmp_path / "two")))
    sgd = torch.optim.SGD(three.parameters(), lr=0.1, momentum=0.9)
    three(torch.randn(2, 8)).sum().backward()
    sgd.step()
    error = str(_error(lambda: checkpoint.load(three, sgd, tmp_path / "two")))
    assert "optimizer class torch.optim.adamw.AdamW was saved, this one is torch.optim.sgd.SGD" in error
    import zerograph

    torch.manual_seed(0)
    wide = zerograph.compile(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 8)), stage=3)
    error = str(_error(lambda: checkpoint.load(wide, torch.optim.AdamW(wide.parameters()), tmp_path / "two",
                                               strict=False)))
    assert "key 'model.0.bias' has shape (8,) in the checkpoint, (6,) here" in error.splitlines()[0]


def test_corrupt_files_and_markers_are_named(tmp_path) -> None:
    """A flipped bit, a truncated file and a malformed marker each raise a
    ``CheckpointError`` that says "corrupt" and names the file; the intact checkpoint loads."""
    import json

    from zerograph import checkpoint

    model, opt = _linear_stack(2)
    checkpoint.save(model, opt, tmp_path / "ck")
    marker = json.loads((tmp_path / "ck" / checkpoint.MARKER).read_text())
    assert marker["checksum"] == "xxh3_128" and "__0_0.distcp" in marker["files"] and ".metadata" in marker["files"]
    shard = tmp_path / "ck" / "__0_0.distcp"
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10  # inside the tensor bytes
    for damaged, words in ((bytes(flipped), "checksum differs"), (original[:-7], "truncated")):
        shard.write_bytes(damaged)
        error = _error(lambda: checkpoint.load(model, opt, tmp_path / "ck"))
        assert isinstance(error, checkpoint.CheckpointError), error
        assert "corrupt" in str(error) and "__0_0.distcp" in str(error) and words in str(error), error
    shard.write_bytes(original)
    checkpoint.load(model, opt, tmp_path / "ck")
    (tmp_path / "ck" / checkpoint.MARKER).write_text('{"format": 2, "files": ')
    error = _error(lambda: checkpoint.load(model, opt, tmp_path / "ck"))
    assert isinstance(error, checkpoint.CheckpointError) and "is corrupt (not JSON" in str(error)


def test_unwritable_path_and_destroyed_group_raise_zerograph_errors(tmp_path) -> None:
    """The class "every failure names its cause": an unwritable path (under a file here; DCP's own
    failure, a ``BaseException``, through a storage writer that fails) gives ``CheckpointError``;
    a model whose process group was destroyed gives ``ProcessGroupError`` at forward and save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    import zerograph
    from zerograph import checkpoint
    from zerograph.errors import ProcessGroupError

    model, opt = _linear_stack(2)
    (tmp_path / "file").write_text("y")
    error = _error(lambda: checkpoint.save(model, opt, tmp_path / "file" / "ck"))
    assert isinstance(error, checkpoint.CheckpointError) and "NotADirectoryError" in str(error)
    write_data = fs.FileSystemWriter.write_data

    def failing(self, plan, planner):
        raise OSError(28, "No space left on device")

    fs.FileSystemWriter.write_data = failing
    try:
        error = _error(lambda: checkpoint.save(model, opt, tmp_path / "full"))
    finally:
        fs.FileSystemWriter.write_data = write_data
    assert isinstance(error, checkpoint.CheckpointError) and "No space left on device" in str(error)
    assert type(error.__cause__).__name__ == "CheckpointException"  # DCP's, chained
    group = dist.new_group([0])
    torch.manual_seed(0)
    lone = zerograph.compile(torch.nn.Linear(8, 8), stage=3, process_group=group)
    lone(torch.randn(2, 8)).sum().backward()
    dist.destroy_process_group(group)
    for step in (lambda: lone(torch.randn(2, 8)), lambda: checkpoint.save(lone, opt, tmp_path / "gone")):
        error = _error(step)
        assert isinstance(error, ProcessGroupError) and "was destroyed" in str(error), error


class _Planted:
    """Planted in a checkpoint: unpickling it writes the file ``path`` (its ``__setstate__`` runs)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __setstate__(self, state: dict) -> None:
        with open(state["path"], "w") as f:
            f.write("ran")


class _Shell:
    """Planted in a checkpoint: unpickling it runs ``touch path`` through ``os.system``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os
        import shlex

        return os.system, (f"touch {shlex.quote(self.path)}",)


def _raised(step) -> Exception | None:
    """The exception ``step()`` raised, or ``None``."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - the error a user sees
        return exc
    return None


def _values(model, opt) -> dict[str, torch.Tensor]:
    """Copies of the model's full parameters and the optimizer's full state tensors, by name."""
    values = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            values[f"{name}.{key}"] = value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
    return values


def _plant(checkpoint_dir, name: str, data: bytes) -> None:
    """Replace the file ``name`` with ``data`` and record its size and digest in the marker, as anyone
    who can write the folder can."""
    import json

    import xxhash

    from zerograph import checkpoint

    (checkpoint_dir / name).write_bytes(data)
    marker_file = checkpoint_dir / checkpoint.MARKER
    marker = json.loads(marker_file.read_text())
    marker["files"][name] = {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    marker_file.write_text(json.dumps(marker))


def test_a_planted_pickle_in_the_metadata_runs_nothing(tmp_path) -> None:
    """A ``.metadata`` replaced by DCP metadata that carries a payload (the digest rewritten to match):
    ``load`` raises ``CheckpointError`` naming the refused type, and the payload never ran."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from zerograph import checkpoint

    model, opt = _linear_stack(2)
    checkpoint.save(model, opt, tmp_path / "ck")
    saved = _values(model, opt)
    honest = (tmp_path / "ck" / ".metadata").read_bytes()
    metadata = dcp.FileSystemReader(tmp_path / "ck").read_metadata()  # the honest file, before planting
    ran = tmp_path / "payload_ran"
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # the model moves on from the checkpoint: a refused load must leave it here
    before = _values(model, opt)
    for payload, name in ((_Shell(str(ran)), ".system"), (_Planted(str(ran)), "test_checkpoint._Planted")):
        metadata.planner_data = payload
        _plant(tmp_path / "ck", ".metadata", pickle.dumps(metadata))
        error = _raised(lambda: checkpoint.load(model, opt, tmp_path / "ck"))
        assert not ran.exists(), f"loading ran the planted {type(payload).__name__}"
        assert isinstance(error, checkpoint.CheckpointError) and name in str(error), error
    after = _values(model, opt)
    assert all(torch.equal(before[key], after[key]) for key in before), "the refused load changed the model"
    _plant(tmp_path / "ck", ".metadata", honest)
    checkpoint.load(model, opt, tmp_path / "ck")
    assert all(torch.equal(saved[key], value) for key, value in _values(model, opt).items())


def test_a_planted_pickle_in_a_saved_value_runs_nothing(tmp_path) -> None:
    """A non-tensor value (an optimizer hyperparameter, saved by ``torch.save`` into a ``.distcp``
    file) that carries a payload: refused by name at load, and the payload never ran."""
    from zerograph import checkpoint

    ran = tmp_path / "payload_ran"
    for payload, name in ((_Shell(str(ran)), ".system"), (_Planted(str(ran)), "test_checkpoint._Planted")):
        model, opt = _linear_stack(2)
        opt.param_groups[0]["planted"] = payload
        checkpoint.save(model, opt, tmp_path / "ck")
        fresh, fresh_opt = _linear_stack(2, seed=1)
        fresh_opt.param_groups[0]["planted"] = None
        before = _values(fresh, fresh_opt)
        error = _raised(lambda: checkpoint.load(fresh, fresh_opt, tmp_path / "ck"))
        assert not ran.exists(), f"loading ran the planted {type(payload).__name__}"
        assert isinstance(error, checkpoint.CheckpointError) and name in str(error), error
        after = _values(fresh, fresh_opt)
        assert all(torch.equal(before[key], after[key]) for key in before), "the refused load changed the model"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist: a single process, as meant
@pytest.mark.parametrize("single_file_per_rank", [True, False])
def test_checkpoints_plain_dcp_writes_load_through_the_restricted_reader(tmp_path, single_file_per_rank) -> None:
    """What ``torch.distributed.checkpoint.save`` writes with a ``FileSystemWriter`` (dtypes, a
    channels-last tensor, nested non-tensor values) loads exactly through ``RestrictedFileSystemReader``
    and ``WeightsOnlyLoadPlanner``."""
    import torch.distributed.checkpoint as dcp

    from zerograph.io.checkpoint_unpickle import RestrictedFileSystemReader, WeightsOnlyLoadPlanner

    torch.manual_seed(0)
    saved = {
        "w": torch.randn(3, 4), "half": torch.randn(5).to(torch.bfloat16), "ids": torch.arange(6),
        "mask": torch.rand(4) > 0.5, "image": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "hyper": {"lr": 0.1, "betas": (0.9, 0.99), "names": ["a", "b"], "none": None, "steps": 7, "tag": "x",
                  "device": torch.device("cpu")},
    }
    writer = dcp.FileSystemWriter(tmp_path / "plain", single_file_per_rank=single_file_per_rank)
    dcp.save(saved, storage_writer=writer, no_dist=True)
    loaded = {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for key, value in saved.items()}
    loaded["hyper"] = {key: None for key in saved["hyper"]}
    dcp.load(loaded, storage_reader=RestrictedFileSystemReader(tmp_path / "plain"), planner=WeightsOnlyLoadPlanner(),
             no_dist=True)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert loaded["hyper"] == saved["hyper"]
