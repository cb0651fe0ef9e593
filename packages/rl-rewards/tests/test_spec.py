"""RewardSpec: TOML loading and validation messages."""

import pytest

from rl_rewards.spec import Component, Gate, RewardSpec, load_spec, spec_from_dict

pytestmark = pytest.mark.no_torch


def test_load_toml_keeps_declaration_order(tmp_path):
    path = tmp_path / "reward.toml"
    path.write_text(
        """
combine = "fold"

[components.rule]
scorer = "timestamp_format"

[components.judge]
scorer = "judge"
op = "mul"
weight = 0.5
fallback = 0.0
gate = { component = "rule", threshold = 0.9 }
options = { module = "rl_rewards.judges.yes_no", model = "/m" }
"""
    )
    spec = load_spec(path)
    assert list(spec.components) == ["rule", "judge"]
    assert spec.combine == "fold"
    assert spec.components["judge"] == Component(
        scorer="judge", op="mul", weight=0.5, fallback=0.0, gate=Gate(component="rule", threshold=0.9),
        options={"module": "rl_rewards.judges.yes_no", "model": "/m"},
    )


def test_gate_must_name_an_earlier_component():
    with pytest.raises(ValueError, match=r"gate.component = 'later' is declared after it"):
        RewardSpec(components={"a": Component(scorer="x", gate=Gate(component="later")), "later": Component(scorer="x")})
    with pytest.raises(ValueError, match=r"'nope' is not declared"):
        spec_from_dict({"components": {"a": {"scorer": "x", "gate": {"component": "nope"}}}})


def test_unknown_fields_and_bad_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"unknown field `wieght`.*components"):
        spec_from_dict({"components": {"a": {"scorer": "x", "wieght": 1.0}}})
    with pytest.raises(ValueError, match=r"combine"):
        spec_from_dict({"components": {"a": {"scorer": "x"}}, "combine": "max"})
    with pytest.raises(ValueError, match="empty"):
        spec_from_dict({"components": {}})
    bad = tmp_path / "bad.toml"
    bad.write_text("components = [")
    with pytest.raises(ValueError, match=r"bad.toml: invalid TOML"):
        load_spec(bad)


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize(("field", "component"), [
    ("weight", lambda v: {"scorer": "x", "weight": v}),
    ("fallback", lambda v: {"scorer": "x", "fallback": v}),
    ("gate.threshold", lambda v: {"scorer": "x", "gate": {"component": "a", "threshold": v}}),
])
def test_non_finite_numbers_are_refused_naming_the_component_and_field(field, component, value):
    """A total of inf/nan is never a reward (every sample would fail), and a NaN gate threshold
    lets every sample through; refused at load, with the source named."""
    data = {"components": {"a": {"scorer": "x"}, "b": component(value)}}
    with pytest.raises(ValueError, match=rf"^reward.toml: components.b.{field} = {value} is not a finite number"):
        spec_from_dict(data, source="reward.toml")


def test_a_toml_file_with_weight_inf_names_the_file(tmp_path):
    path = tmp_path / "reward.toml"
    path.write_text('[components.fmt]\nscorer = "timestamp_format"\nweight = inf\n')
    with pytest.raises(ValueError, match=rf"^{path}: components.fmt.weight = inf is not a finite number"):
        load_spec(path)
