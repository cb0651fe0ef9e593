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
