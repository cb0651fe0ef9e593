from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rl_core.kl import compute_kl

LN2 = math.log(2)


def test_hand_worked_values() -> None:
    # delta = logp - ref = 0 - (-ln 2) = ln 2 = 0.6931
    logp, ref = torch.tensor([0.0]), torch.tensor([-LN2])
    torch.testing.assert_close(compute_kl("k1", logp, ref), torch.tensor([LN2]))
    # k2 = ln(2)^2 / 2 = 0.2402
    torch.testing.assert_close(compute_kl("k2", logp, ref), torch.tensor([LN2**2 / 2]))
    # k3 = e^{-ln 2} + ln 2 - 1 = .5 + .6931 - 1 = .1931
    torch.testing.assert_close(compute_kl("k3", logp, ref), torch.tensor([0.5 + LN2 - 1]))
    torch.testing.assert_close(compute_kl("low_var_kl", logp, ref), compute_kl("k3", logp, ref))


def test_k3_is_clamped_and_its_gradient_stays_finite() -> None:
    # delta = -30: e^{30} would overflow the loss scale; clamp delta to -20, then the result to 10
    logp = torch.tensor([-30.0, 30.0], requires_grad=True)
    kl = compute_kl("k3", logp, torch.zeros(2))
    # delta = +30 -> e^{-20} + 20 - 1 = 19.000000002 -> clamped to 10 as well
    torch.testing.assert_close(kl, torch.tensor([10.0, 10.0]))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_estimators_are_unbiased_for_kl_when_averaged_under_the_policy() -> None:
    # exact expectation over a categorical policy p against reference q: E_p[k1] = E_p[k3] = KL(p||q)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    kl = float((p * (p / q).log()).sum())
    for name in ("k1", "k3"):
        estimate = float((p * compute_kl(name, p.log(), q.log())).sum())
        assert estimate == pytest.approx(kl, rel=1e-12)


@given(st.floats(-15, 15), st.floats(-15, 15))
def test_k2_and_k3_are_non_negative_and_zero_only_at_equality(a: float, b: float) -> None:
    logp, ref = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)
    for name in ("k2", "k3"):
        value = float(compute_kl(name, logp, ref))
        assert value >= 0
        if a == b:
            assert value == 0


def test_shape_mismatch_and_unknown_name() -> None:
    with pytest.raises(ValueError, match="same shape"):
        compute_kl("k1", torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(KeyError, match="valid names: k1, k2, k3, low_var_kl"):
        compute_kl("k4", torch.zeros(1), torch.zeros(1))
