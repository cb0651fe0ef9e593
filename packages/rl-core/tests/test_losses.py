from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rl_core.losses import ROLLOUT_CORRECTIONS, aggregate, compute_policy_loss, rollout_correction

E = math.e
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# ----------------------------------------------------------------------------------- aggregation

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third row is empty


def test_aggregate_hand_worked_every_mode() -> None:
    # valid tokens: 1, 2 | 4 | (none). Token sums 3, 4; token means 1.5, 4; two non-empty rows.
    assert float(aggregate(VALUES, MASK, "token-mean")) == pytest.approx(7 / 3)  # (1+2+4)/3
    assert float(aggregate(VALUES, MASK, "seq-mean-token-sum")) == pytest.approx(3.5)  # (3+4)/2
    assert float(aggregate(VALUES, MASK, "seq-mean-token-mean")) == pytest.approx(2.75)  # (1.5+4)/2
    # sums divided by T = 3, then averaged: (1 + 4/3) / 2 = 7/6; with norm_length 4: (.75 + 1) / 2
    assert float(aggregate(VALUES, MASK, "seq-mean-token-sum-norm")) == pytest.approx(7 / 6)
    assert float(
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_length=4)
    ) == pytest.approx(0.875)


def test_aggregate_num_valid_replaces_the_local_count() -> None:
    # token sum 7 over a global count of 14 tokens; sequence sums 3 + 4 over 7 global sequences
    assert float(aggregate(VALUES, MASK, "token-mean", num_valid=14)) == pytest.approx(0.5)
    assert float(aggregate(VALUES, MASK, "seq-mean-token-sum", num_valid=7)) == pytest.approx(1.0)
    assert float(
        aggregate(VALUES, MASK, "token-mean", num_valid=torch.tensor(14.0))
    ) == pytest.approx(0.5)


def test_aggregate_all_masked_is_zero_not_nan() -> None:
    for mode in MODES:
        assert float(aggregate(VALUES, torch.zeros(3, 3), mode)) == 0.0


def test_aggregate_errors() -> None:
    with pytest.raises(KeyError, match="valid names: seq-mean-token-mean"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="norm_length is only used by 'seq-mean-token-sum-norm'"):
        aggregate(VALUES, MASK, "token-mean", norm_length=3)
    with pytest.raises(ValueError, match="must both be \\[B, T\\]"):
        aggregate(VALUES, MASK[:2], "token-mean")
    with pytest.raises(ValueError, match="num_valid must be positive"):
        aggregate(VALUES, MASK, "token-mean", num_valid=0)


def global_count(mask: torch.Tensor, mode: str) -> float:
    return float(mask.sum()) if mode == "token-mean" else float((mask.sum(-1) > 0).sum())


@given(
    st.integers(2, 8),  # B
    st.integers(1, 6),  # T
    st.integers(1, 7),  # split point
    st.integers(0, 2**31 - 1),
    st.sampled_from(MODES),
)
def test_micro_batches_with_global_num_valid_sum_to_the_one_batch_loss(
    b, t, split, seed, mode
) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.3).long()
    mask[0, 0] = 1  # at least one valid token
    split = min(split, b - 1)
    norm = 8 if mode == "seq-mean-token-sum-norm" else None
    whole = aggregate(values, mask, mode, norm_length=norm)
    n = global_count(mask, mode)
    parts = sum(
        aggregate(values[s], mask[s], mode, num_valid=n, norm_length=norm)
        for s in (slice(0, split), slice(split, b))
    )
    assert float(parts) == pytest.approx(float(whole), rel=1e-12, abs=1e-12)


# --------------------------------------------------------------------------------- policy losses


def loss_inputs(delta: list[float], adv: list[float]) -> dict[str, torch.Tensor]:
    logp = torch.tensor([delta], requires_grad=True)  # old_logp = 0, so ratio = exp(delta)
    return {
        "logp": logp,
        "old_logp": torch.zeros(1, len(delta)),
        "advantages": torch.tensor([adv]),
        "mask": torch.ones(1, len(delta)),
    }


def test_ppo_clip_hand_worked() -> None:
    # token 1: ratio e, A = +1 -> max(-e, -1.2) = -1.2 (clipped to 1.2, no gradient)
    # token 2: ratio e, A = -1 -> max(e, 1.2) = e (unclipped); token-mean = (e - 1.2) / 2
    inputs = loss_inputs([1.0, 1.0], [1.0, -1.0])
    loss, metrics = compute_policy_loss("ppo_clip", **inputs)
    assert float(loss.detach()) == pytest.approx((E - 1.2) / 2)
    loss.backward()
    # d/dlogp of e^{logp} * 1 / 2 tokens = e / 2 on the unclipped token, 0 on the clipped one
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor([[0.0, E / 2]]))
    assert float(metrics["clip_fraction"]) == pytest.approx(0.5)
    # approx_kl is the k3 estimate e^d - 1 - d = e - 2
    assert float(metrics["approx_kl"]) == pytest.approx(E - 2)
    assert float(metrics["ratio_mean"]) == pytest.approx(E)
    assert float(metrics["ratio_min"]) == pytest.approx(E) and float(
        metrics["ratio_max"]
    ) == pytest.approx(E)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_ppo_clip_asymmetric_is_dapo_clip_higher() -> None:
    # ratio e^{-1} = .368, A = -1: max(.368, clip to 1 - .2 = .8) = .8 (clipped)
    # ratio e^{.5} = 1.649, A = +1: max(-1.649, -clip to 1 + .28) = -1.28 (clipped)
    inputs = loss_inputs([-1.0, 0.5], [-1.0, 1.0])
    loss, metrics = compute_policy_loss(
        "ppo_clip", clip_low=0.2, clip_high=0.28, agg="seq-mean-token-sum", **inputs
    )
    assert float(loss.detach()) == pytest.approx(0.8 - 1.28)  # token sum of one sequence
    assert float(metrics["clip_fraction"]) == 1.0
    # the same ratio 1.25 is inside clip-higher (1.28) but outside symmetric 0.2
    inside = loss_inputs([math.log(1.25)], [1.0])
    assert (
        float(compute_policy_loss("ppo_clip", clip_high=0.28, **inside)[1]["clip_fraction"]) == 0.0
    )
    assert (
        float(compute_policy_loss("ppo_clip", clip_high=0.2, **inside)[1]["clip_fraction"]) == 1.0
    )


def test_dual_clip_bounds_the_loss_for_negative_advantages() -> None:
    # token 1: ratio e^2 = 7.389, A = -1 -> PPO loss 7.389, bounded by c * |A| = 3 (lower clip)
    # token 2: ratio e = 2.718, A = -1 -> 2.718 < 3 stays; token 3: ratio e^2, A = +1 -> -1.2
    inputs = loss_inputs([2.0, 1.0, 2.0], [-1.0, -1.0, 1.0])
    loss, metrics = compute_policy_loss("dual_clip", **inputs)
    assert float(loss.detach()) == pytest.approx((3.0 + E - 1.2) / 3)
    assert float(metrics["clip_fraction_lower"]) == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor([[0.0, E / 3, 0.0]]))
    # ppo_clip on the same input is unbounded: the first token costs e^2
    ppo_loss, _ = compute_policy_loss("ppo_clip", **loss_inputs([2.0, 1.0, 2.0], [-1.0, -1.0, 1.0]))
    assert float(ppo_loss.detach()) == pytest.approx((E**2 + E - 1.2) / 3)
    with pytest.raises(ValueError, match="c must be > 1"):
        compute_policy_loss("dual_clip", c=1.0, **loss_inputs([0.0], [1.0]))


def test_gspo_sequence_ratio_hand_worked() -> None:
    # token deltas .2, .4 -> sequence ratio s = e^{mean} = e^{.3} = 1.3499 on both tokens
    # A = -1: max(1.3499, 1.2) = 1.3499 (unclipped); seq-mean-token-mean loss = 1.3499
    inputs = loss_inputs([0.2, 0.4], [-1.0, -1.0])
    loss, metrics = compute_policy_loss("gspo", agg="seq-mean-token-mean", **inputs)
    s = math.exp(0.3)
    assert float(loss.detach()) == pytest.approx(s)
    assert float(metrics["ratio_min"]) == pytest.approx(s) and float(
        metrics["ratio_max"]
    ) == pytest.approx(s)
    loss.backward()
    # GSPO's gradient: d/dlogp_t of -A * exp(mean delta) = s / 2 for each of the 2 tokens
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor([[s / 2, s / 2]]))
    # A = +1: -min(s, 1.2) = -1.2, clipped for the whole sequence
    loss, metrics = compute_policy_loss(
        "gspo", agg="seq-mean-token-mean", **loss_inputs([0.2, 0.4], [1.0, 1.0])
    )
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert float(metrics["clip_fraction"]) == 1.0


def test_gspo_gradient_equals_the_sequence_level_objective() -> None:
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.01
    old = logp.detach() + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.01
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 6)
    mask = (torch.rand(4, 6, generator=gen) > 0.2).double()
    mask[:, 0] = 1
    a = logp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(
        "gspo", logp=a, old_logp=old, advantages=adv, mask=mask, agg="seq-mean-token-mean"
    )
    loss.backward()
    b = logp.clone().requires_grad_(
        True
    )  # the paper's form: -A_i * exp(mean_t delta) averaged over i
    seq_ratio = torch.exp(((b - old) * mask).sum(-1) / mask.sum(-1))
    (-(adv[:, 0] * seq_ratio)).mean().backward()
    torch.testing.assert_close(a.grad, b.grad * mask)


def test_first_on_policy_replay_has_ratio_one_and_no_clipping() -> None:
    logp = torch.randn(3, 4)
    _, metrics = compute_policy_loss(
        "ppo_clip",
        logp=logp,
        old_logp=logp.clone(),
        advantages=torch.randn(3, 4),
        mask=torch.ones(3, 4),
    )
    assert float(metrics["ratio_min"]) == 1.0 and float(metrics["ratio_max"]) == 1.0
    assert float(metrics["clip_fraction"]) == 0.0 and float(metrics["approx_kl"]) == 0.0


def test_masked_tokens_do_not_count() -> None:
    inputs = loss_inputs([1.0, 5.0], [-1.0, -1.0])
    inputs["mask"] = torch.tensor([[1.0, 0.0]])
    loss, metrics = compute_policy_loss("ppo_clip", **inputs)
    assert float(loss.detach()) == pytest.approx(E)  # only the first token, ratio e, A = -1
    assert float(metrics["ratio_max"]) == pytest.approx(E)
    loss.backward()
    assert float(inputs["logp"].grad[0, 1]) == 0.0


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_gradient_accumulation_equals_one_batch(name: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    b, t = 6, 5
    logp = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    old = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    mask[:, 0] = 1
    norm = t if mode == "seq-mean-token-sum-norm" else None
    whole = logp.clone().requires_grad_(True)
    compute_policy_loss(
        name, logp=whole, old_logp=old, advantages=adv, mask=mask, agg=mode, norm_length=norm
    )[0].backward()
    micro = logp.clone().requires_grad_(True)
    n = global_count(mask, mode)
    for s in (slice(0, 2), slice(2, 6)):
        compute_policy_loss(
            name,
            logp=micro[s],
            old_logp=old[s],
            advantages=adv[s],
            mask=mask[s],
            agg=mode,
            num_valid=n,
            norm_length=norm,
        )[0].backward()
    torch.testing.assert_close(micro.grad, whole.grad)


def test_policy_loss_gradcheck_away_from_the_clip_kinks() -> None:
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    logp = (old + 0.05 * torch.randn(2, 3, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    for name in ("ppo_clip", "dual_clip"):
        assert torch.autograd.gradcheck(
            lambda x, n=name: compute_policy_loss(
                n, logp=x, old_logp=old, advantages=adv, mask=torch.ones(2, 3)
            )[0],
            (logp,),
        )
    # GSPO's token form is a true gradient only with one advantage per sequence and the
    # paper's seq-mean-token-mean aggregation (its value depends on the sequence mean only)
    seq_adv = adv[:, :1].expand(2, 3)
    assert torch.autograd.gradcheck(
        lambda x: compute_policy_loss(
            "gspo",
            logp=x,
            old_logp=old,
            advantages=seq_adv,
            mask=torch.ones(2, 3),
            agg="seq-mean-token-mean",
            clip_low=0.9,
            clip_high=9.0,
        )[0],
        (logp,),
    )


def test_policy_loss_input_errors() -> None:
    inputs = loss_inputs([0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="must all be \\[B, T\\]"):
        compute_policy_loss("ppo_clip", **{**inputs, "advantages": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="clip_low"):
        compute_policy_loss("ppo_clip", clip_low=1.5, **inputs)
    with pytest.raises(KeyError, match="valid names: cispo, dual_clip, gspo, ppo_clip, sapo"):
        compute_policy_loss("ppo", **inputs)
    with pytest.raises(TypeError, match="'c'"):
        compute_policy_loss("ppo_clip", c=3.0, **inputs)


# ------------------------------------------------------------------------------------- cispo


def test_cispo_hand_worked_values_and_gradient() -> None:
    # old_logp = 0, so r = e^logp. clip_high = 4 (upper bound 5), clip_low = 1 (no lower bound):
    # token 1: r = 6 -> w = 5 (clipped), loss -5 * 1 * ln 6, gradient -w A = -5
    # token 2: r = .5 -> w = .5, A = -1: loss -.5 * -1 * ln .5 = -.5 ln 2, gradient +.5
    # token 3: r = 1 -> w = 1, A = 2: loss -2 * 0 = 0, gradient -2. token-mean divides by 3.
    inputs = loss_inputs([math.log(6.0), math.log(0.5), 0.0], [1.0, -1.0, 2.0])
    loss, metrics = compute_policy_loss("cispo", clip_low=1.0, clip_high=4.0, **inputs)
    assert float(loss.detach()) == pytest.approx((-5 * math.log(6.0) - 0.5 * math.log(2.0)) / 3)
    loss.backward()
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor([[-5 / 3, 0.5 / 3, -2 / 3]]))
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 3)  # only r = 6 > 5
    assert float(metrics["ratio_max"]) == pytest.approx(6.0)
    # a lower bound of 1 - .2 = .8 lifts token 2's weight to .8 (clipped, still a gradient: +.8 / 3)
    inputs = loss_inputs([math.log(6.0), math.log(0.5), 0.0], [1.0, -1.0, 2.0])
    loss, metrics = compute_policy_loss("cispo", clip_low=0.2, clip_high=4.0, **inputs)
    loss.backward()
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor([[-5 / 3, 0.8 / 3, -2 / 3]]))
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / 3)


def test_cispo_clipped_tokens_keep_their_gradient_where_ppo_drops_it() -> None:
    # r = e, A = +1: PPO clips at 1.2 and the token's gradient is 0; CISPO's is -1.2 (weight 1.2)
    ppo = loss_inputs([1.0], [1.0])
    compute_policy_loss("ppo_clip", **ppo)[0].backward()
    cispo = loss_inputs([1.0], [1.0])
    compute_policy_loss("cispo", **cispo)[0].backward()
    assert float(ppo["logp"].grad) == 0.0
    assert float(cispo["logp"].grad) == pytest.approx(-1.2)


# -------------------------------------------------------------------------------------- sapo


def test_sapo_hand_worked_at_ratio_one() -> None:
    # r = 1: sigmoid(0) = 1/2, loss -(4 / tau)(1/2) A = -2A / tau: A = +1 (tau 1) -> -2,
    # A = -1 (tau 1.05) -> 2 / 1.05; token-mean over 2. Gradient (4/tau) sigma'(0) tau r (-A) = -A,
    # so -1/2 and +1/2 after the mean.
    inputs = loss_inputs([0.0, 0.0], [1.0, -1.0])
    loss, metrics = compute_policy_loss("sapo", **inputs)
    assert float(loss.detach()) == pytest.approx((-2.0 + 2.0 / 1.05) / 2, abs=1e-6)  # float32
    loss.backward()
    torch.testing.assert_close(inputs["logp"].grad, torch.tensor([[-0.5, 0.5]]))
    assert float(metrics["clip_fraction"]) == 0.0


def test_sapo_damps_off_policy_tokens_smoothly() -> None:
    # r = e, A = +1, tau = 2 (tau_pos): loss -(4/2) sigmoid(2 (e - 1)) = -2 sigmoid(3.4366) = -1.9377;
    # gradient -(4/2) * 2 sigma(1 - sigma) * r = -4 * .96883 * .03117 * e = -.3284, far below PPO's
    # unclipped e and not cut to 0 as PPO's clip would; clip_low / clip_high change nothing
    inputs = loss_inputs([1.0], [1.0])
    loss, metrics = compute_policy_loss("sapo", tau_pos=2.0, clip_high=0.01, **inputs)
    sig = 1 / (1 + math.exp(-2 * (E - 1)))
    assert float(loss.detach()) == pytest.approx(-2 * sig) == pytest.approx(-1.9377, abs=1e-4)
    loss.backward()
    assert float(inputs["logp"].grad) == pytest.approx(-4 * sig * (1 - sig) * E)
    assert float(inputs["logp"].grad) == pytest.approx(-0.3284, abs=1e-4)
    assert float(metrics["clip_fraction"]) == 0.0


def test_sapo_rejects_a_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        compute_policy_loss("sapo", tau_neg=0.0, **loss_inputs([0.0], [1.0]))
    with pytest.raises(ValueError, match="tau_pos must be > 0"):
        compute_policy_loss("sapo", tau_pos=-1.0, **loss_inputs([0.0], [1.0]))


def test_clip_low_one_is_no_lower_bound() -> None:
    # ppo_clip with clip_low = 1: r = e^-3 = .0498 with A = -1 stays unclipped (bound 0)
    _, metrics = compute_policy_loss("ppo_clip", clip_low=1.0, **loss_inputs([-3.0], [-1.0]))
    assert float(metrics["clip_fraction"]) == 0.0
    with pytest.raises(ValueError, match=r"clip_low=1\.01"):
        compute_policy_loss("ppo_clip", clip_low=1.01, **loss_inputs([0.0], [1.0]))


# ------------------------------------------------------------------------ off-policy sequence mask


def off_policy_inputs() -> dict[str, torch.Tensor]:
    # 3 sequences x 3 tokens; logp = old_logp = 0, so ppo_clip's token loss is -A (ratio 1)
    return {
        "logp": torch.zeros(3, 3, requires_grad=True),
        "old_logp": torch.zeros(3, 3),
        "advantages": torch.tensor([[-1.0] * 3, [1.0] * 3, [-0.5] * 3]),
        "mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
    }


SAMPLING = torch.tensor([[1.0, 0.5, 9.0], [1.0, 1.0, 1.0], [0.2, 0.4, float("nan")]])


def test_off_policy_mask_hand_worked() -> None:
    # mean over valid tokens of sampling_logp - logp, delta = .5:
    # row 1: (1 + .5) / 2 = .75 > .5 and A < 0 -> dropped (the padded 9.0 does not count)
    # row 2: 1 > .5 but A > 0 -> kept; row 3: NaN counts 0, (.2 + .4 + 0) / 3 = .2 <= .5 -> kept
    # token-mean over all 8 valid tokens (the divisor is unchanged): (-1 * 3 + .5 * 3) / 8
    inputs = off_policy_inputs()
    loss, metrics = compute_policy_loss("ppo_clip", off_policy_mask=0.5, sampling_logp=SAMPLING, **inputs)
    assert float(loss.detach()) == pytest.approx(-1.5 / 8)
    assert float(metrics["off_policy_masked"]) == pytest.approx(2 / 8)  # row 1's two valid tokens
    loss.backward()
    # the dropped sequence gets zero gradient; the others -A / 8
    expected = torch.tensor([[0.0, 0.0, 0.0], [-1 / 8] * 3, [0.5 / 8] * 3])
    torch.testing.assert_close(inputs["logp"].grad, expected)
    # a larger delta keeps everything
    _, metrics = compute_policy_loss("ppo_clip", off_policy_mask=0.8, sampling_logp=SAMPLING, **off_policy_inputs())
    assert float(metrics["off_policy_masked"]) == 0.0


def test_off_policy_mask_without_sampling_logp_uses_old_logp() -> None:
    # old_logp row 1 = (1, .5): the same gap of .75 as above from the old policy alone
    inputs = {**off_policy_inputs(), "old_logp": torch.tensor([[1.0, 0.5, 0.0], [0.0] * 3, [0.0] * 3])}
    _, metrics = compute_policy_loss("cispo", off_policy_mask=0.5, **inputs)
    assert float(metrics["off_policy_masked"]) == pytest.approx(2 / 8)
    assert "is_masked" not in metrics and "off_policy_masked" not in compute_policy_loss("sapo", **inputs)[1]


def test_off_policy_mask_errors() -> None:
    with pytest.raises(ValueError, match="off_policy_mask must be > 0"):
        compute_policy_loss("ppo_clip", off_policy_mask=0.0, **off_policy_inputs())
    with pytest.raises(ValueError, match="sampling_logp is only used by off_policy_mask"):
        compute_policy_loss("ppo_clip", sampling_logp=SAMPLING, **off_policy_inputs())
    with pytest.raises(ValueError, match="sampling_logp"):
        compute_policy_loss("ppo_clip", off_policy_mask=0.5, sampling_logp=SAMPLING[:, :2], **off_policy_inputs())


# ------------------------------------------------------------------------- rollout correction

# old_logp - sampling_logp: row 1 = (ln 2, ln 4, -ln 4) -> token ratios 2, 4, .25, sequence ratio 2;
# row 2 = (ln .5, ln 3, masked) -> token ratios .5, 3, 1 (the masked NaN counts 0), sequence 1.5
OLD = torch.zeros(2, 3)
SAMPLED = -torch.tensor([[math.log(2.0), math.log(4.0), -math.log(4.0)], [math.log(0.5), math.log(3.0), float("nan")]])
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max", "expected"),
    [
        ("none", None, 3.0, [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
        ("token_truncate", None, 3.0, [[2.0, 3.0, 0.25], [0.5, 3.0, 1.0]]),
        ("token_truncate", 0.5, 3.0, [[2.0, 3.0, 0.5], [0.5, 3.0, 1.0]]),
        ("token_truncate", None, None, [[2.0, 4.0, 0.25], [0.5, 3.0, 1.0]]),
        ("token_mask", None, 3.0, [[2.0, 0.0, 0.25], [0.5, 3.0, 1.0]]),  # 3 is inside [., 3]
        ("token_mask", 0.5, 2.0, [[2.0, 0.0, 0.0], [0.5, 0.0, 1.0]]),  # IcePop's two-sided mask
        ("sequence_truncate", None, 3.0, [[2.0] * 3, [1.5] * 3]),
        ("sequence_truncate", 1.6, 1.8, [[1.8] * 3, [1.6] * 3]),
        ("sequence_mask", None, 3.0, [[2.0] * 3, [1.5] * 3]),
        ("sequence_mask", None, 1.8, [[0.0] * 3, [1.5] * 3]),
        ("sequence_mask", 1.6, None, [[2.0] * 3, [0.0] * 3]),
    ],
)
def test_rollout_correction_hand_worked(mode, clip_min, clip_max, expected) -> None:
    weights = rollout_correction(mode, old_logp=OLD, sampling_logp=SAMPLED, mask=IS_MASK, clip_min=clip_min,
                                 clip_max=clip_max)
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert weights.shape == (2, 3) and not weights.requires_grad


def test_rollout_correction_a_nan_on_a_valid_token_is_ratio_one() -> None:
    sampled = torch.tensor([[float("nan"), -math.log(2.0)]])
    old = torch.zeros(1, 2, requires_grad=True)
    for mode, expected in [("token_truncate", [[1.0, 2.0]]), ("sequence_mask", [[2.0, 2.0]])]:
        weights = rollout_correction(mode, old_logp=old, sampling_logp=sampled, mask=torch.ones(1, 2))
        torch.testing.assert_close(weights, torch.tensor(expected))
        assert not weights.requires_grad


def test_rollout_correction_errors() -> None:
    assert ROLLOUT_CORRECTIONS.names() == ["none", "sequence_mask", "sequence_truncate", "token_mask",
                                           "token_truncate"]
    with pytest.raises(KeyError, match="unknown rollout correction 'tis'; valid names: none, sequence_mask"):
        rollout_correction("tis", old_logp=OLD, sampling_logp=SAMPLED, mask=IS_MASK)
    with pytest.raises(ValueError, match=r"clip_min <= clip_max, got clip_min=4\.0"):
        rollout_correction("token_mask", old_logp=OLD, sampling_logp=SAMPLED, mask=IS_MASK, clip_min=4.0)
    with pytest.raises(ValueError, match="must all be \\[B, T\\]"):
        rollout_correction("token_mask", old_logp=OLD, sampling_logp=SAMPLED[:1], mask=IS_MASK)


def test_is_weights_scale_the_token_loss_and_masked_tokens_get_no_gradient() -> None:
    # ppo_clip at ratio 1 with A = 1: token loss -1, times the token_mask weights of the 2x3 example,
    # [[2, 0, .25], [.5, 3, -]]; 5 valid tokens: loss -(2 + 0 + .25 + .5 + 3) / 5 = -1.15
    weights = rollout_correction("token_mask", old_logp=OLD, sampling_logp=SAMPLED, mask=IS_MASK)
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = compute_policy_loss("ppo_clip", logp=logp, old_logp=OLD, advantages=torch.ones(2, 3),
                                        mask=IS_MASK, is_weights=weights)
    assert float(loss.detach()) == pytest.approx(-1.15)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.4, 0.0, -0.05], [-0.1, -0.6, 0.0]]))
    assert float(metrics["is_ratio_mean"]) == pytest.approx(5.75 / 5)
    assert float(metrics["is_ratio_min"]) == 0.0 and float(metrics["is_ratio_max"]) == 3.0
    assert float(metrics["is_masked"]) == pytest.approx(1 / 5)
    # with the off-policy mask too: row 1 (A = -1 now) drops; the weights apply to what is left
    adv = torch.tensor([[-1.0] * 3, [1.0] * 3])
    loss, metrics = compute_policy_loss("ppo_clip", logp=torch.zeros(2, 3), old_logp=OLD, advantages=adv,
                                        mask=IS_MASK, is_weights=weights, off_policy_mask=0.1,
                                        sampling_logp=torch.full((2, 3), 0.5))
    assert float(loss.detach()) == pytest.approx(-3.5 / 5)
    assert float(metrics["off_policy_masked"]) == pytest.approx(0.6)
