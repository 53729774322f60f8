"""Every pass has an expected-graph test: its output on a small hand-built graph compared with
expected text (``graph_text`` against an inline string, or ``torch.testing.FileCheck`` of the
order of ops), as ``passes/README.md`` asks ("Adding a pass", step 3).

``EXPECTED_GRAPH_TESTS`` names that test for each pass; a pass the manager runs, or a pass file
under ``passes/``, without an entry fails here, and so does an entry whose test is gone or
compares no text."""
import importlib
import pkgutil

import pytest

import zerograph.passes
from zerograph.passes.manager import pass_names

# pass -> (test module under tests/passes, test function): the test of its output as text
EXPECTED_GRAPH_TESTS = {
    "activation_partition": ("test_activation_partition", "test_expected_joint_of_one_recomputed_unit"),
    "bucketing": ("test_bucketing", "test_expected_buckets_under_a_two_unit_cap"),
    "buffer_reuse": ("test_buffer_reuse", "test_expected_graph_of_two_units_sharing_their_slots"),
    "expand_inference_unit_calls": ("test_expand_inference_unit_calls", "test_expected_graph_of_one_unit_call"),
    "expand_unit_calls": ("test_expand_unit_calls", "test_expected_pair_with_the_units_activation_handed_over"),
    "hand_over_secondary_pieces": ("test_hand_over_secondary_pieces", "test_expected_pair_after_the_hand_over"),
    "insert_allgather": ("test_insert_allgather", "test_expected_graph_of_one_units_gather"),
    "insert_reduce_scatter": ("test_insert_reduce_scatter", "test_expected_graph_of_one_units_reduction"),
    "mark_recomputed_unit_calls": ("test_mark_recomputed_unit_calls", "test_expected_joint_of_a_checkpointed_unit"),
    "prefetch": ("test_prefetch", "test_expected_order_at_depth_one"),
    "saved_opaque_objects_last": ("test_partitioned_pipeline", "test_expected_pair_after_the_move"),
    "schedule_overlap": ("test_schedule_overlap", "test_expected_order_of_prefetched_forward"),
    "secondary_partition": ("test_secondary_partition", "test_expected_joint_of_one_unit"),
    "selective_unshard": ("test_selective_unshard", "test_expected_graph_with_one_unit_kept"),
}


def pass_files() -> set[str]:
    """The modules of ``passes/`` that hold a pass: a function named as its file with a
    ``@contract`` (``passes/README.md``: one pass per file)."""
    found = set()
    for info in pkgutil.iter_modules(zerograph.passes.__path__):
        module = importlib.import_module(f"zerograph.passes.{info.name}")
        if hasattr(getattr(module, info.name, None), "contract"):
            found.add(info.name)
    return found


def test_every_pass_has_an_expected_graph_test():
    passes = pass_names() | pass_files()
    missing = sorted(passes - EXPECTED_GRAPH_TESTS.keys())
    assert not missing, (f"passes without an expected-graph test: {missing}; add one (passes/README.md, "
                         "'Adding a pass') and name it in EXPECTED_GRAPH_TESTS")
    assert not EXPECTED_GRAPH_TESTS.keys() - passes, "EXPECTED_GRAPH_TESTS names passes that no longer exist"


def test_the_pass_files_are_the_passes_the_manager_runs():
    assert pass_files() == pass_names()


@pytest.mark.parametrize("name", sorted(EXPECTED_GRAPH_TESTS))
def test_each_named_test_runs_its_pass_then_reads_the_graph_as_text(name, monkeypatch):
    """Run the named test with its module's pass and ``graph_text`` wrapped: it must call the pass
    (from its own module), then ``graph_text`` (compared inline, or run through ``FileCheck``)."""
    module_name, test_name = EXPECTED_GRAPH_TESTS[name]
    module = importlib.import_module(f"tests.passes.{module_name}")
    test = getattr(module, test_name, None)
    assert callable(test), f"{module_name}.{test_name} (the expected-graph test of {name}) does not exist"
    assert hasattr(module, name) and hasattr(module, "graph_text"), f"{module_name} imports no {name} or no graph_text"
    calls = []

    def recorded(label, fn):
        def call(*args, **kwargs):
            calls.append(label)
            return fn(*args, **kwargs)
        call.__name__ = fn.__name__
        call.contract = getattr(fn, "contract", None)
        return call

    monkeypatch.setattr(module, name, recorded("pass", getattr(module, name)))
    monkeypatch.setattr(module, "graph_text", recorded("text", module.graph_text))
    test()
    assert "pass" in calls, f"{module_name}.{test_name} does not run {name}"
    assert "text" in calls[calls.index("pass"):], f"{module_name}.{test_name} reads no graph text after {name}"
