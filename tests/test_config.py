"""Config's policies, its deprecated flat keywords, its documented fields, and the pass
contracts it checks (all in-process)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import warnings

import pytest
import torch
from torch import nn

import zerograph
from zerograph import ActivationPolicy, Config, ConfigError, MemoryPolicy, MixedPrecisionPolicy, SchedulePolicy
from zerograph.passes.contract import contract_of, pipeline_problem
from zerograph.passes.manager import GRAPH_KINDS, pass_names, pipeline

from .test_layers import imports_of, module_files

# each flat keyword of earlier releases and the spelling that replaces it (policy field, policy class)
RENAMED = {
    "param_dtype": ("mixed_precision", "param_dtype", "MixedPrecisionPolicy"),
    "reduce_dtype": ("mixed_precision", "reduce_dtype", "MixedPrecisionPolicy"),
    "full_precision_classes": ("mixed_precision", "full_precision_classes", "MixedPrecisionPolicy"),
    "cast_forward_inputs": ("mixed_precision", "cast_forward_inputs", "MixedPrecisionPolicy"),
    "bucket_bytes": ("schedule", "bucket_bytes", "SchedulePolicy"),
    "prefetch_depth": ("schedule", "prefetch_depth", "SchedulePolicy"),
    "max_inflight_bytes": ("schedule", "max_inflight_bytes", "SchedulePolicy"),
    "unshard_budget_bytes": ("memory", "unshard_budget_bytes", "MemoryPolicy"),
    "reshard_root_after_forward": ("memory", "reshard_root_after_forward", "MemoryPolicy"),
    "memory_budget_bytes": ("memory", "budget_bytes", "MemoryPolicy"),
    "pool_comm_buffers": ("memory", "pool_comm_buffers", "MemoryPolicy"),
    "activation_budget_bytes": ("activations", "budget_bytes", "ActivationPolicy"),
    "activation_offload": ("activations", "offload", "ActivationPolicy"),
    "activation_group": ("activations", "group", "ActivationPolicy"),
    "activation_cost_model": ("activations", "cost_model", "ActivationPolicy"),
}
# a value other than the default for each (the activation options need a budget beside them)
NON_DEFAULT = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "full_precision_classes": (),
               "cast_forward_inputs": False, "bucket_bytes": 64, "prefetch_depth": 2, "max_inflight_bytes": 8,
               "unshard_budget_bytes": 8, "reshard_root_after_forward": False, "memory_budget_bytes": 1 << 30,
               "pool_comm_buffers": True, "activation_budget_bytes": 0, "activation_offload": True,
               "activation_group": None, "activation_cost_model": None}


@pytest.mark.filterwarnings("ignore:Config's flat keyword 'activation_budget_bytes'")  # the budget beside the others
@pytest.mark.parametrize("name", sorted(RENAMED))
def test_a_flat_keyword_is_deprecated_naming_the_policy_field(name: str) -> None:
    policy, field, cls = RENAMED[name]
    value = NON_DEFAULT[name]
    budget = {"activation_budget_bytes": 0} if name.startswith("activation_") and name != "activation_budget_bytes" else {}
    new_spelling = rf"Config\({policy}=zerograph.{cls}\({field}=\.\.\.\)\), read as config.{policy}.{field}"
    with pytest.warns(DeprecationWarning, match=f"flat keyword '{name}' is deprecated .*: write {new_spelling}") as record:
        config = Config(**{name: value}, **budget)
    assert record[0].filename == __file__  # the warning points at the caller's line
    policy_fields = {field: value} | ({"budget_bytes": 0} if budget else {})
    assert config == Config(**{policy: getattr(zerograph, cls)(**policy_fields)})
    with pytest.warns(DeprecationWarning, match=f"write {new_spelling}") as record:
        assert getattr(config, name) == getattr(getattr(config, policy), field)
    assert record[0].filename == __file__
    assert dataclasses.replace(config, lowering="eager") == dataclasses.replace(
        Config(**{policy: getattr(config, policy)}), lowering="eager")


def test_the_policy_spelling_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = Config(schedule=SchedulePolicy(prefetch_depth=2), memory=MemoryPolicy(budget_bytes=1 << 30),
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        activations=ActivationPolicy(budget_bytes=0, offload=True))
        assert (config.schedule.prefetch_depth, config.memory.budget_bytes) == (2, 1 << 30)


def test_config_has_no_getattr() -> None:
    for cls in (Config, MixedPrecisionPolicy, SchedulePolicy, MemoryPolicy, ActivationPolicy):
        assert not any("__getattr__" in vars(base) for base in cls.__mro__ if base is not object), cls
    with pytest.raises(AttributeError):
        Config().prefetch  # neither a field nor a deprecated keyword


def test_an_unknown_keyword_is_a_type_error_listing_the_fields() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'prefetch'; its fields: unit_classes, .*schedule"):
        Config(prefetch=2)


def test_a_policy_and_its_flat_keyword_together_are_refused() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="both schedule= and the deprecated "
                                                                              "prefetch_depth="):
        Config(schedule=SchedulePolicy(), prefetch_depth=2)
    with pytest.raises(ConfigError, match="Config.schedule must be a zerograph.SchedulePolicy"):
        Config(schedule={"prefetch_depth": 2})


def test_policy_errors_name_the_field_as_written() -> None:
    with pytest.raises(ConfigError, match="SchedulePolicy.prefetch_depth must be an int"):
        SchedulePolicy(prefetch_depth="2")
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="SchedulePolicy.prefetch_depth must be an int"):
        Config(prefetch_depth="2")  # the deprecated spelling's error names the field that replaces it
    with pytest.raises(ConfigError, match=r"write unit_classes=\(Linear,\)"):
        Config(unit_classes=nn.Linear)  # a class, not a tuple: said how to fix it, not a TypeError
    with pytest.raises(ConfigError, match=r"write full_precision_classes=\(LayerNorm,\)"):
        MixedPrecisionPolicy(full_precision_classes=nn.LayerNorm)


def field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right below its declaration in ``cls``'s source (the
    attribute docstring that torchtitan's configs.py and mkdocstrings read)."""
    path = pathlib.Path(inspect.getsourcefile(cls))
    body = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    return {stmt.target.id: after.value.value for stmt, after in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


@pytest.mark.parametrize("cls", [Config, MixedPrecisionPolicy, SchedulePolicy, MemoryPolicy, ActivationPolicy],
                         ids=lambda cls: cls.__name__)
def test_every_field_is_documented_where_it_is_declared(cls: type) -> None:
    documented = field_docstrings(cls)
    missing = [f.name for f in dataclasses.fields(cls) if len(documented.get(f.name, "").split()) < 8]
    assert not missing, f"{cls.__name__} fields without a docstring below their declaration: {missing}"
    # the story is told once, by the fields and docs/: no Attributes section to drift from them
    assert "Attributes:" not in cls.__doc__ and len(cls.__doc__.splitlines()) <= 16


def test_config_does_not_import_the_pass_manager_at_module_level() -> None:
    files = module_files()
    top_level = [i.target for i in imports_of("zerograph.config", files["zerograph.config"], set(files)) if i.top]
    assert top_level and not [t for t in top_level if t.startswith("zerograph.passes")], top_level


def test_no_caller_uses_a_deprecated_keyword() -> None:
    """zerograph, its passes, the examples and the tests (but this file) build ``Config`` with
    the policy spelling only."""
    root = pathlib.Path(__file__).resolve().parent.parent
    found = []
    for path in sorted(p for folder in ("zerograph", "passes", "examples", "tests") for p in (root / folder).rglob("*.py")):
        if path == pathlib.Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "Config":
                found += [f"{path.relative_to(root)}:{node.lineno} {k.arg}=" for k in node.keywords if k.arg in RENAMED]
    assert not found, "deprecated Config keywords: " + ", ".join(found)


# the passes without which a pipeline cannot hand capture what it needs (their contracts)
REQUIRED_PASSES = ("insert_allgather", "insert_reduce_scatter", "expand_unit_calls", "expand_inference_unit_calls",
                   "saved_opaque_objects_last")


@pytest.mark.parametrize("name", REQUIRED_PASSES)
def test_disabling_a_required_pass_is_refused_at_config_time(name: str) -> None:
    with pytest.raises(ConfigError, match=f"'{name}' would provide"):
        Config(disabled_passes=(name,))


@pytest.mark.parametrize("name", sorted(pass_names() - set(REQUIRED_PASSES)))
def test_every_other_pass_may_be_disabled(name: str) -> None:
    assert Config(disabled_passes=(name,)).disabled_passes == (name,)


def test_every_pass_declares_a_contract_and_every_pipeline_satisfies_it() -> None:
    for kind in GRAPH_KINDS:
        for pass_fn in pipeline(kind):
            assert hasattr(pass_fn, "contract"), f"{pass_fn.__name__} declares no contract"
        assert pipeline_problem(kind, pipeline(kind)) is None
    assert "gathers" in contract_of(next(p for p in pipeline("joint") if p.__name__ == "insert_allgather")).provides


def test_pipeline_problem_names_the_pass_and_the_capability() -> None:
    problem = pipeline_problem("backward", pipeline("backward"), disabled=("insert_reduce_scatter",))
    assert "backward pipeline must end with ['reductions']" in problem


def test_the_package_exports_the_policies() -> None:
    assert zerograph.SchedulePolicy is SchedulePolicy and zerograph.Config is Config


def test_auto_lowering_is_inductor_on_cuda_and_eager_elsewhere() -> None:
    assert Config().lowering == "auto"
    assert Config().resolved_lowering(torch.device("cuda", 0)) == "inductor"
    assert Config().resolved_lowering(torch.device("cpu")) == "eager"
    assert Config(lowering="eager").resolved_lowering(torch.device("cuda")) == "eager"
    assert Config(lowering="inductor").resolved_lowering(torch.device("cpu")) == "inductor"


def test_inductor_islands_are_off_by_default_and_must_be_a_bool() -> None:
    assert Config().inductor_islands is False
    assert Config(lowering="inductor", inductor_islands=True).inductor_islands is True
    with pytest.raises(ConfigError, match="Config.inductor_islands must be True or False"):
        Config(inductor_islands=1)
    with pytest.raises(ConfigError, match="lowering='eager' runs no Inductor"):
        Config(lowering="eager", inductor_islands=True)
