from __future__ import annotations

import sys
import types

import pytest
import torch

from rl_core import names
from rl_core.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from rl_core.kl import KL_ESTIMATORS
from rl_core.losses import AGGREGATIONS, POLICY_LOSSES
from rl_core.names import RegistryRef
from rl_core.registry import Registry, UnknownNameError


def test_register_returns_the_function_and_lookup_finds_it() -> None:
    registry: Registry = Registry("widget")

    @registry.register("b", "alias_b")
    def fn() -> int:
        return 7

    assert fn() == 7
    assert registry["b"] is fn
    assert registry.get("alias_b") is fn
    assert "b" in registry and "c" not in registry
    assert registry.names() == ["alias_b", "b"]
    assert len(registry) == 2


def test_registering_a_name_twice_raises() -> None:
    registry: Registry = Registry("widget")
    registry.add("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.add("a", 2)
    assert registry["a"] == 1  # the first registration survives


def test_unknown_name_lists_valid_names_sorted() -> None:
    registry: Registry = Registry("widget")
    for name in ("zeta", "alpha", "mid"):
        registry.add(name, name)
    with pytest.raises(KeyError) as info:
        registry["alpah"]
    assert str(info.value) == "unknown widget 'alpah'; valid names: alpha, mid, zeta"
    assert isinstance(info.value, ValueError)  # either except clause catches it
    assert isinstance(info.value, UnknownNameError)


def test_empty_or_padded_names_are_rejected() -> None:
    registry: Registry = Registry("widget")
    with pytest.raises(ValueError, match="non-empty"):
        registry.add("", 1)
    with pytest.raises(ValueError, match="non-empty"):
        registry.add(" grpo", 1)


def test_the_shipped_registries_hold_the_paper_names() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == [
        "dr_grpo",
        "gae",
        "grpo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "rloo",
    ]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "low_var_kl"]
    assert POLICY_LOSSES.names() == ["cispo", "dual_clip", "gspo", "ppo_clip", "sapo"]
    assert AGGREGATIONS.names() == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]


def test_reregistering_a_shipped_estimator_raises() -> None:
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda **_: None)


def test_unknown_estimator_through_the_public_call() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(
        KeyError, match="unknown advantage estimator 'gpro'; valid names: dr_grpo, gae"
    ):
        compute_advantages(
            "gpro", rewards=torch.ones(2), mask=mask, group_ids=torch.zeros(2, dtype=torch.long)
        )


@pytest.mark.parametrize("ref", names.REGISTRIES, ids=lambda ref: ref.attribute)
def test_builtin_names_match_the_registries(ref: RegistryRef) -> None:
    """`rl_core.names` (what a config checks before torch is imported) holds each registry's kind
    and names exactly: the test that keeps the registry's promise that no second list drifts."""
    registry = ref.resolve()
    assert (registry.kind, registry.names()) == (ref.kind, list(ref.builtin))


def test_a_registry_ref_reads_the_registry_once_its_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its module is imported: the built-in names. After: the registry's own, so a name a
    user registered (here `mine`) is valid too."""
    ref = RegistryRef("user_losses", "LOSSES", "policy loss", ("ppo_clip",))
    assert ref.names() == ["ppo_clip"] and "mine" not in ref and ref.loaded() is None
    registry: Registry = Registry("policy loss")
    for name in ("ppo_clip", "mine"):
        registry.add(name, name)
    monkeypatch.setitem(sys.modules, "user_losses", types.SimpleNamespace(LOSSES=registry))
    assert ref.names() == ["mine", "ppo_clip"] and "mine" in ref and ref.loaded() is registry
