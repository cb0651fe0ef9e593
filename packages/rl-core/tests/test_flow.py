from __future__ import annotations

import math
import re

import pytest
import torch

from rl_core.flow import (
    compute_flow_dpo_loss,
    compute_nft_decay,
    compute_nft_loss,
    compute_nft_optimality,
    compute_ratio_guard,
    compute_sde_window,
    flow_kl,
    flow_noise,
    host_randn,
    sde_step,
    velocity_errors,
)
from rl_core.losses import compute_policy_loss

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # 0.918939


def one(x: float) -> torch.Tensor:
    return torch.tensor([[x]])  # [B=1, 1]


def test_sde_step_hand_worked_one_element() -> None:
    # x = 1, v = .5, sigma = .5 -> .25 (dt = -.25), a = .7
    # sigma_t = .7 * sqrt(.5 / (1 - .5)) = .7
    # mean = 1 * (1 + .49 / (2 * .5) * -.25) + .5 * (1 + .49 * .5 / (2 * .5)) * -.25
    #      = .8775 - .155625 = .721875;  step std = .7 * sqrt(.25) = .35
    # replaying x' = mean + .35 (z = 1): log p = -1/2 - ln .35 - ln sqrt(2 pi) = -.369117
    step = sde_step(
        velocity=one(0.5),
        latents=one(1.0),
        sigma=0.5,
        sigma_next=0.25,
        next_latents=one(0.721875 + 0.35),
    )
    torch.testing.assert_close(step.mean, one(0.721875))
    torch.testing.assert_close(step.std, torch.tensor([0.7]))
    torch.testing.assert_close(step.log_prob, torch.tensor([-0.5 - math.log(0.35) - LOG_SQRT_2PI]))


def test_sde_step_at_sigma_one_uses_one_minus_sigma_next() -> None:
    # sigma = 1 would divide by 1 - 1 = 0; Flow-GRPO uses 1 - sigmas[1] = 1 - .8 = .2 there:
    # sigma_t = .7 * sqrt(1 / .2) = 1.565248
    step = sde_step(
        velocity=one(0.0), latents=one(0.0), sigma=1.0, sigma_next=0.8, next_latents=one(0.0)
    )
    torch.testing.assert_close(step.std, torch.tensor([0.7 * math.sqrt(5.0)]))
    assert torch.isfinite(step.log_prob).all()


def test_cps_step_hand_worked_one_element() -> None:
    # x = 1, v = .5, sigma = .5 -> .25, a = .8: sigma_t = .25 * sin(.4 pi) = .237764
    # x0 = 1 - .5 * .5 = .75, x1 = 1 + .5 * .5 = 1.25
    # mean = .75 * (1 - .25) + 1.25 * sqrt(.0625 - .237764^2) = .5625 + 1.25 * .077255 = .659068
    # x' = mean (z = 0): log p = -ln .237764 - ln sqrt(2 pi) = .517566
    sigma_t = 0.25 * math.sin(0.4 * math.pi)
    mean = 0.75 * 0.75 + 1.25 * math.sqrt(0.25**2 - sigma_t**2)
    step = sde_step(
        velocity=one(0.5),
        latents=one(1.0),
        sigma=0.5,
        sigma_next=0.25,
        noise_level=0.8,
        kind="cps",
        next_latents=one(mean),
    )
    torch.testing.assert_close(step.mean, one(mean))
    torch.testing.assert_close(step.std, torch.tensor([sigma_t]))
    torch.testing.assert_close(step.log_prob, torch.tensor([-math.log(sigma_t) - LOG_SQRT_2PI]))
    assert mean == pytest.approx(0.659068, abs=1e-6)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_draw_then_replay_gives_identical_log_prob_and_ratio_one(kind: str) -> None:
    latents = torch.randn(4, 3, 8, 8)
    velocity = torch.randn(4, 3, 8, 8)
    sigma, sigma_next = torch.tensor([1.0, 0.9, 0.6, 0.3]), torch.tensor([0.9, 0.8, 0.5, 0.2])
    drawn = sde_step(
        velocity=velocity,
        latents=latents,
        sigma=sigma,
        sigma_next=sigma_next,
        kind=kind,
        generator=torch.Generator().manual_seed(5),
    )
    replay = sde_step(
        velocity=velocity.clone().requires_grad_(True),
        latents=latents,
        sigma=sigma,
        sigma_next=sigma_next,
        kind=kind,
        next_latents=drawn.next_latents,
    )
    assert torch.equal(replay.log_prob.detach(), drawn.log_prob)
    assert torch.equal(replay.next_latents, drawn.next_latents)
    _, metrics = compute_policy_loss(
        "ppo_clip",
        logp=replay.log_prob[:, None],
        old_logp=drawn.log_prob[:, None],
        advantages=torch.randn(4, 1),
        mask=torch.ones(4, 1),
        clip_low=1e-4,
        clip_high=1e-4,
    )
    assert float(metrics["ratio_min"]) == 1.0 and float(metrics["ratio_max"]) == 1.0


def test_replay_log_prob_carries_the_gradient_of_the_velocity() -> None:
    latents, velocity = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    drawn = sde_step(velocity=velocity.detach(), latents=latents, sigma=0.7, sigma_next=0.5)
    replay = sde_step(
        velocity=velocity,
        latents=latents,
        sigma=0.7,
        sigma_next=0.5,
        next_latents=drawn.next_latents,
    )
    replay.log_prob.sum().backward()
    assert velocity.grad is not None and velocity.grad.abs().sum() > 0
    assert not replay.next_latents.requires_grad


def test_bf16_inputs_give_float32_outputs_with_float32_math() -> None:
    latents = torch.randn(2, 4, 4).to(torch.bfloat16)
    velocity = torch.randn(2, 4, 4).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    step = sde_step(velocity=velocity, latents=latents, sigma=0.8, sigma_next=0.7, generator=gen)
    for t in (step.next_latents, step.log_prob, step.mean, step.std):
        assert t.dtype == torch.float32
    same = sde_step(
        velocity=velocity.float(),
        latents=latents.float(),
        sigma=0.8,
        sigma_next=0.7,
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.equal(step.next_latents, same.next_latents) and torch.equal(
        step.log_prob, same.log_prob
    )


def test_per_sample_sigmas_equal_separate_scalar_calls() -> None:
    latents, velocity = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    nxt = torch.randn(2, 3, 5)
    both = sde_step(
        velocity=velocity,
        latents=latents,
        sigma=torch.tensor([0.9, 0.4]),
        sigma_next=torch.tensor([0.8, 0.2]),
        next_latents=nxt,
    )
    for i, (s, sn) in enumerate([(0.9, 0.8), (0.4, 0.2)]):
        single = sde_step(
            velocity=velocity[i : i + 1],
            latents=latents[i : i + 1],
            sigma=s,
            sigma_next=sn,
            next_latents=nxt[i : i + 1],
        )
        torch.testing.assert_close(both.log_prob[i : i + 1], single.log_prob)
        torch.testing.assert_close(both.mean[i : i + 1], single.mean)


def test_drawn_samples_have_the_stated_gaussian_log_density_on_average() -> None:
    # E[log p] of a sample from N(mean, s^2) is -1/2 - ln s - ln sqrt(2 pi)
    step = sde_step(
        velocity=torch.randn(1, 4, 64, 64),
        latents=torch.randn(1, 4, 64, 64),
        sigma=0.5,
        sigma_next=0.25,
        generator=torch.Generator().manual_seed(0),
    )
    expected = -0.5 - math.log(0.35) - LOG_SQRT_2PI  # step std .7 * sqrt(.25) = .35 as above
    assert float(step.log_prob) == pytest.approx(expected, abs=0.02)


def test_generators_reproduce_samples_and_one_per_sample_works() -> None:
    kw = {
        "velocity": torch.zeros(2, 6),
        "latents": torch.zeros(2, 6),
        "sigma": 0.5,
        "sigma_next": 0.4,
    }
    a = sde_step(**kw, generator=torch.Generator().manual_seed(3)).next_latents
    b = sde_step(**kw, generator=torch.Generator().manual_seed(3)).next_latents
    assert torch.equal(a, b)
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    per_sample = sde_step(**kw, generator=gens).next_latents
    first_alone = sde_step(
        **{**kw, "velocity": torch.zeros(1, 6), "latents": torch.zeros(1, 6)},
        generator=torch.Generator().manual_seed(3),
    ).next_latents
    assert torch.equal(per_sample[:1], first_alone) and not torch.equal(
        per_sample[0], per_sample[1]
    )


def test_host_randn_draws_what_randn_draws_from_each_generator() -> None:
    # the engine's noise: one CPU generator per sample, drawn in place (pinned memory on CUDA)
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    rows = host_randn((2, 3, 5), gens, torch.device("cpu"))
    assert torch.equal(rows[0], torch.randn(3, 5, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(rows[1], torch.randn(3, 5, generator=torch.Generator().manual_seed(4)))
    # each generator advanced as by randn: the next draw equals randn's second draw
    reference = torch.Generator().manual_seed(3)
    torch.randn(3, 5, generator=reference)
    assert torch.equal(torch.randn(4, generator=gens[0]), torch.randn(4, generator=reference))
    whole = host_randn((2, 3), torch.Generator().manual_seed(7), torch.device("cpu"))
    assert torch.equal(whole, torch.randn(2, 3, generator=torch.Generator().manual_seed(7)))


def test_python_and_tensor_sigmas_give_the_same_bits() -> None:
    # python numbers are filled on the device and checked on the host (no synchronisation);
    # the maths is the float32 of tensors either way
    kw = {"velocity": torch.randn(2, 6), "latents": torch.randn(2, 6), "next_latents": torch.randn(2, 6)}
    floats = sde_step(**kw, sigma=0.7, sigma_next=0.6)
    tensors = sde_step(**kw, sigma=torch.tensor(0.7), sigma_next=torch.tensor([0.6, 0.6]))
    pairs = zip((floats.log_prob, floats.mean, floats.std), (tensors.log_prob, tensors.mean, tensors.std), strict=True)
    for a, b in pairs:
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=re.escape("got sigma=[0.5, 0.5] sigma_next=[0.4000000059604645, 0.5]")):
        sde_step(**kw, sigma=0.5, sigma_next=torch.tensor([0.4, 0.5]))
    with pytest.raises(ValueError, match=re.escape("got sigma=[0.5] sigma_next=[0.5]")):
        sde_step(**kw, sigma=0.5, sigma_next=0.5)


def test_zero_noise_is_the_deterministic_euler_step_with_zero_log_prob() -> None:
    # noise_level 0: mean = x + v dt (the ODE step); the last cps step (sigma_next = 0) likewise
    step = sde_step(
        velocity=one(2.0), latents=one(1.0), sigma=0.5, sigma_next=0.25, noise_level=0.0
    )
    torch.testing.assert_close(step.next_latents, one(1.0 + 2.0 * -0.25))
    assert float(step.log_prob) == 0.0
    last = sde_step(
        velocity=one(2.0), latents=one(1.0), sigma=0.25, sigma_next=0.0, kind="cps", noise_level=0.8
    )
    torch.testing.assert_close(last.next_latents, one(1.0 - 0.25 * 2.0))  # x0 = x - sigma v
    assert float(last.log_prob) == 0.0


def test_sde_step_input_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="0 <= sigma_next < sigma <= 1"):
        sde_step(velocity=x, latents=x, sigma=0.5, sigma_next=0.6)
    with pytest.raises(ValueError, match="kind must be 'sde' or 'cps'"):
        sde_step(velocity=x, latents=x, sigma=0.5, sigma_next=0.4, kind="ode")
    with pytest.raises(ValueError, match="differ in shape"):
        sde_step(velocity=torch.zeros(2, 4), latents=x, sigma=0.5, sigma_next=0.4)
    with pytest.raises(ValueError, match="sigma must be a scalar or a \\[B\\]=2 tensor"):
        sde_step(velocity=x, latents=x, sigma=torch.tensor([0.5, 0.5, 0.5]), sigma_next=0.4)


def test_flow_kl_hand_worked_and_exact_with_dt() -> None:
    # means differ by .1 everywhere, std .5: .01 / (2 * .25) = .02
    # with dt = -.25 the step std is .5 * sqrt(.25) = .25: .01 / (2 * .0625) = .08
    mean, ref = torch.full((2, 3, 4), 0.1), torch.zeros(2, 3, 4)
    torch.testing.assert_close(
        flow_kl(mean, ref, torch.tensor([0.5, 0.5])), torch.tensor([0.02, 0.02])
    )
    torch.testing.assert_close(flow_kl(mean, ref, 0.5, dt=-0.25), torch.tensor([0.08, 0.08]))


def test_flow_kl_with_dt_is_the_exact_gaussian_kl_of_two_sde_steps() -> None:
    latents, v, v_ref = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.5, 0.1])
    pol = sde_step(velocity=v, latents=latents, sigma=sigma, sigma_next=sigma_next)
    ref = sde_step(velocity=v_ref, latents=latents, sigma=sigma, sigma_next=sigma_next)
    step_std = (pol.std * (sigma - sigma_next).sqrt()).view(3, 1, 1, 1).expand_as(pol.mean)
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(pol.mean, step_std),
        torch.distributions.Normal(ref.mean, step_std),
    ).mean(dim=(1, 2, 3))
    torch.testing.assert_close(flow_kl(pol.mean, ref.mean, pol.std, dt=sigma_next - sigma), exact)


def test_sliding_window_moves_every_shift_interval_and_rolls_back() -> None:
    # MixGRPO's progressive window: limit 8, 4 steps, stride 1, moved every 25 epochs; the first
    # step runs 0..7 (8 positions), the last windows are cut at 8, epoch 200 starts over
    window = {e: compute_sde_window("sliding", epoch=e, limit=8, size=4, shift_interval=25) for e in (0, 24, 25, 50, 100, 175, 199, 200)}
    assert window == {0: (0, 4), 24: (0, 4), 25: (1, 5), 50: (2, 6), 100: (4, 8), 175: (7, 8), 199: (7, 8), 200: (0, 4)}
    # stride 2 from step 1 below 9: first steps 1, 3, 5, 7 -> 4 positions
    got = [compute_sde_window("sliding", epoch=e, limit=9, size=2, start=1, stride=2) for e in range(5)]
    assert got == [(1, 3), (3, 5), (5, 7), (7, 9), (1, 3)]


def test_fixed_and_random_windows() -> None:
    assert compute_sde_window("fixed", epoch=7, limit=9, size=2) == (0, 2)
    assert compute_sde_window("fixed", epoch=7, limit=9, size=4, start=7) == (7, 9)  # cut at the limit
    # Flow-GRPO-Fast: 2 steps whose first is uniform over 0..3 inside [0, 5)
    g = torch.Generator().manual_seed(0)
    firsts = [compute_sde_window("random", epoch=0, limit=5, size=2, generator=g)[0] for _ in range(400)]
    assert set(firsts) == {0, 1, 2, 3} and all(80 <= firsts.count(k) <= 120 for k in range(4))
    again = torch.Generator().manual_seed(0)
    assert compute_sde_window("random", epoch=0, limit=5, size=2, generator=again)[0] == firsts[0]
    with pytest.raises(ValueError, match="does not fit"):
        compute_sde_window("random", epoch=0, limit=5, size=3, start=3)
    with pytest.raises(ValueError, match="'fixed', 'random' or 'sliding'"):
        compute_sde_window("mix", epoch=0, limit=5, size=2)


def test_ratio_guard_hand_worked_one_element() -> None:
    # step std s = .5 x sqrt(.25) = .25; x' = .2, old mean .1, new mean .3: both log densities
    # are -(.1)^2 / (2 x .0625) = -.08, so the raw log ratio is 0; the bias .2^2 / .125 = .32,
    # times s: .08 = eps x (mean - old_mean) with eps = (.2 - .1) / .25 = .4; weight 1 / .25 = 4
    x_next, old, new = 0.2, 0.1, 0.3
    logp, old_logp = torch.tensor([-((x_next - new) ** 2) / 0.125]), torch.tensor([-((x_next - old) ** 2) / 0.125])
    log_ratio, weight = compute_ratio_guard(logp=logp, old_logp=old_logp, mean=one(new), old_mean=one(old),
                                            step_std=0.25, dt=-0.25)
    torch.testing.assert_close(log_ratio, torch.tensor([0.08]))
    torch.testing.assert_close(weight, torch.tensor([4.0]))


def test_ratio_guard_is_eps_times_the_mean_shift_for_sde_steps() -> None:
    """Through `sde_step`: the sample drawn under the old velocity, scored under a new one; the
    guarded log ratio equals the loop reference mean_i eps_i (mean_i - old_mean_i)."""
    g = torch.Generator().manual_seed(0)
    latents, v_old = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    v_new = v_old + 0.1 * torch.randn(3, 2, 4, 4, generator=g)
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.5, 0.1])
    old = sde_step(velocity=v_old, latents=latents, sigma=sigma, sigma_next=sigma_next, generator=g)
    new = sde_step(velocity=v_new, latents=latents, sigma=sigma, sigma_next=sigma_next, next_latents=old.next_latents)
    dt = sigma_next - sigma
    step_std = old.std * dt.abs().sqrt()  # [B]
    log_ratio, weight = compute_ratio_guard(logp=new.log_prob, old_logp=old.log_prob, mean=new.mean, old_mean=old.mean,
                                            step_std=step_std, dt=dt)
    for b in range(3):
        eps = (old.next_latents[b] - old.mean[b]) / step_std[b]
        torch.testing.assert_close(log_ratio[b], (eps * (new.mean[b] - old.mean[b])).mean(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weight, 1 / dt.abs())
    with pytest.raises(ValueError, match="stochastic step"):
        compute_ratio_guard(logp=new.log_prob, old_logp=old.log_prob, mean=new.mean, old_mean=old.mean, step_std=0.0, dt=dt)


def test_flow_noise_is_the_forward_interpolation() -> None:
    # x0 = (1, 0), eps = (0, 2): sigma .5 -> (.5, 1); per-sample sigmas 0 and 1 give x0 and eps
    x0, eps = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    torch.testing.assert_close(flow_noise(x0, eps, 0.5), torch.tensor([[0.5, 1.0]]))
    both = flow_noise(torch.cat([x0, x0]), torch.cat([eps, eps]), torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(both, torch.tensor([[1.0, 0.0], [0.0, 2.0]]))


def test_nft_optimality_clips_then_maps_to_the_unit_interval() -> None:
    # clip 5: r = clamp(adv, -5, 5) / 10 + .5
    adv = torch.tensor([-7.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])
    assert compute_nft_optimality(adv, 5.0).tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert compute_nft_optimality(torch.tensor([1.0]), 2.0).tolist() == [0.75]
    with pytest.raises(ValueError, match="clip must be > 0"):
        compute_nft_optimality(adv, 0.0)


def test_nft_decay_follows_upstreams_two_schedules() -> None:
    type1 = {"start": 0, "rate": 0.001, "limit": 0.5}  # upstream decay_type 1 (its default)
    assert [compute_nft_decay(s, **type1) for s in (0, 100, 499, 500, 10_000)] == pytest.approx([0, 0.1, 0.499, 0.5, 0.5])
    type2 = {"start": 75, "rate": 0.0075, "limit": 0.999}  # decay_type 2 (its OCR config)
    assert [compute_nft_decay(s, **type2) for s in (0, 74, 75, 100, 208, 10_000)] == pytest.approx(
        [0, 0, 0, 0.1875, 0.9975, 0.999])
    with pytest.raises(ValueError, match="limit < 1"):
        compute_nft_decay(0, start=0, rate=0.1, limit=1.0)


def _nft(beta: float, **kw):
    # x0 = (1, 0), eps = (0, 2), t = .5 -> x_t = (.5, 1); v_old = (-1, 1), v = (-1, 2), v_ref = (-1, 0)
    v = torch.tensor([[-1.0, 2.0]], requires_grad=True)
    loss, metrics = compute_nft_loss(velocity=v, old_velocity=torch.tensor([[-1.0, 1.0]]),
                                     clean=torch.tensor([[1.0, 0.0]]), noisy=torch.tensor([[0.5, 1.0]]), sigma=0.5,
                                     advantages=torch.tensor([2.5]), beta=beta, adv_clip=5.0, **kw)
    return v, loss, metrics


def test_nft_loss_hand_worked_beta_one() -> None:
    # beta 1: v+ = v = (-1, 2) predicts x0 = x_t - .5 v+ = (1, 0) exactly: error 0, weight floored
    # at 1e-5, L+ = 0. v- = 2 v_old - v = (-1, 0): x0- = (1, 1), error (0, 1), weight .5,
    # L- = mean(0, 1 / .5) = 1. r = 2.5 / 10 + .5 = .75: loss = 5 x (.75 x 0 + .25 x 1) / 1 = 1.25
    _, loss, metrics = _nft(1.0)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, torch.tensor([1.25], dtype=torch.float64))
    assert (metrics["positive"], metrics["negative"], metrics["kl"]) == (0.0, 1.0, 0.0)
    assert metrics["old_deviation"] == 0.5  # mean((v - v_old)^2) = (0 + 1) / 2


def test_nft_loss_hand_worked_value_and_gradient() -> None:
    # beta .5: v+ = .5 v + .5 v_old = (-1, 1.5): x0+ = (1, .25), error (0, .25), w+ = .125,
    #   L+ = mean(0, .0625 / .125) = .25
    # v- = 1.5 v_old - .5 v = (-1, .5): x0- = (1, .75), error (0, .75), w- = .375, L- = mean(0, 1.5) = .75
    # policy = 5 x (.75 x .25 + .25 x .75) / .5 = 3.75; KL = mean((0, 2)^2) = 2, x .1 = .2: loss 3.95
    # gradient in v[1] (the weights carry none): d x0+/dv = -t beta = -.25, d x0-/dv = +.25
    #   dL+/dv[1] = .25 x -.25 / .125 = -.5,  dL-/dv[1] = .75 x .25 / .375 = .5
    #   policy: 5 / .5 x (.75 x -.5 + .25 x .5) = -2.5;  KL: .1 x (2 - 0) = .2  ->  -2.3; v[0]: 0
    v, loss, metrics = _nft(0.5, ref_velocity=torch.tensor([[-1.0, 0.0]]), kl_beta=0.1)
    torch.testing.assert_close(loss, torch.tensor([3.95], dtype=torch.float64))
    assert metrics["positive"] == pytest.approx(0.25) and metrics["negative"] == pytest.approx(0.75)
    assert (metrics["policy"], metrics["kl"]) == (pytest.approx(3.75), 2.0)
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -2.3]]))


def _upstream_nft_loss(forward_prediction, old_prediction, ref_forward_prediction, x0, xt, t, advantages, *,
                       beta: float, adv_clip_max: float, train_beta: float):
    """DiffusionNFT's loss as its training loop computes it, re-expressed from NVlabs/DiffusionNFT
    (commit 24af555) `scripts/train_nft_sd3.py`, `main()`, the inner loop over timesteps
    (`adv_mode = "all"`): `policy_loss + config.train.beta * kl_div_loss`, means over the batch."""
    dims = tuple(range(1, x0.ndim))
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    r = torch.clamp((advantages_clip / adv_clip_max) / 2.0 + 0.5, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = torch.abs(x0_prediction.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=dims)
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = torch.abs(negative_x0_prediction.double() - x0.double()).mean(
            dim=dims, keepdim=True).clip(min=0.00001)
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=dims)
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=dims)
    return policy_loss + train_beta * torch.mean(kl_div_loss)


@pytest.mark.parametrize(("beta", "train_beta"), [(1.0, 0.0001), (0.1, 0.0001), (0.1, 0.0)])
def test_nft_loss_equals_upstreams_on_the_same_tensors(beta: float, train_beta: float) -> None:
    """Upstream's sd3 configs: beta 1 (default), 0.1 (OCR, multi-reward); train.beta 1e-4. Our
    per-sample loss summed and divided by the batch is upstream's loss, and so is its gradient."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 3, 8, 8)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.rand(4, generator=g) * 0.9 + 0.05
    xt = flow_noise(x0, eps, t)
    old, ref = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    v_ours = (old + 0.3 * torch.randn(shape, generator=g)).requires_grad_()
    v_theirs = v_ours.detach().clone().requires_grad_()
    advantages = torch.tensor([-7.0, -1.3, 0.4, 6.0])  # two beyond the clip of 5
    loss, _ = compute_nft_loss(velocity=v_ours, old_velocity=old, clean=x0, noisy=xt, sigma=t, advantages=advantages,
                               beta=beta, adv_clip=5.0, ref_velocity=ref, kl_beta=train_beta)
    theirs = _upstream_nft_loss(v_theirs, old, ref, x0, xt, t, advantages, beta=beta, adv_clip_max=5.0,
                                train_beta=train_beta)
    ours = loss.sum() / len(loss)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)  # float64: only the order of the sums differs
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(v_ours.grad, v_theirs.grad, rtol=1e-6, atol=1e-9)


def test_nft_loss_input_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"old_velocity \(2, 4\) must match clean \(2, 3\)"):
        compute_nft_loss(velocity=x, old_velocity=torch.zeros(2, 4), clean=x, noisy=x, sigma=0.5,
                         advantages=torch.zeros(2), beta=1.0, adv_clip=5.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        compute_nft_loss(velocity=x, old_velocity=x, clean=x, noisy=x, sigma=0.5, advantages=torch.zeros(2),
                         beta=0.0, adv_clip=5.0)


def test_velocity_errors_hand_worked() -> None:
    """Two samples of two elements: target velocity = noise - clean."""
    clean = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    noise = torch.tensor([[0.0, 1.0], [0.5, -0.5]])
    velocity = torch.tensor([[-1.0, 1.0], [0.0, 0.0]])  # sample 0 exact; sample 1 off by (0, 1)
    assert velocity_errors(velocity, clean, noise).tolist() == [0.0, 0.5]
    with pytest.raises(ValueError, match="one shape"):
        velocity_errors(velocity[:, :1], clean, noise)


def test_flow_dpo_loss_hand_worked_and_its_gradient_prefers_the_chosen_sample() -> None:
    """margin = (0.2 - 0.3) - (0.5 - 0.4) = -0.2 for pair 0 and (0.3 - 0.3) - (0.3 - 0.3) = 0
    for pair 1; beta = 5: losses -log sigmoid(1) = 0.31326 and log 2 = 0.69315."""
    chosen = torch.tensor([0.2, 0.3], requires_grad=True)
    rejected = torch.tensor([0.5, 0.3], requires_grad=True)
    loss, metrics = compute_flow_dpo_loss(chosen=chosen, rejected=rejected, ref_chosen=torch.tensor([0.3, 0.3]),
                                          ref_rejected=torch.tensor([0.4, 0.3]), beta=5.0)
    assert loss.tolist() == pytest.approx([-math.log(1 / (1 + math.exp(-1.0))), math.log(2)], abs=1e-6)
    assert metrics["margin"] == pytest.approx(-0.1) and metrics["accuracy"] == 0.5
    loss.sum().backward()
    # d loss / d chosen = beta x sigmoid(beta x margin) > 0: lowering the chosen error lowers the loss;
    # the rejected error's gradient is its negative
    expected = [5 / (1 + math.exp(1.0)), 5 / 2]
    assert chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([-g for g in expected], abs=1e-6)
    with pytest.raises(ValueError, match="beta must be > 0"):
        compute_flow_dpo_loss(chosen=chosen, rejected=rejected, ref_chosen=chosen, ref_rejected=rejected, beta=0)


def test_sde_step_mask_leaves_elements_out_of_the_log_prob() -> None:
    """The masked log-prob is the mean over the kept elements: the same as the step on them alone,
    whatever the left-out elements hold; the sample and the mean are not masked."""
    g = torch.Generator().manual_seed(0)
    x, v, nxt = (torch.randn(2, 3, 4, generator=g) for _ in range(3))  # [B, F, D]
    mask = torch.tensor([0.0, 1.0, 1.0]).view(1, 3, 1)  # frame 0 left out
    masked = sde_step(velocity=v, latents=x, sigma=0.8, sigma_next=0.6, next_latents=nxt, mask=mask)
    alone = sde_step(velocity=v[:, 1:], latents=x[:, 1:], sigma=0.8, sigma_next=0.6, next_latents=nxt[:, 1:])
    torch.testing.assert_close(masked.log_prob, alone.log_prob)
    moved = sde_step(velocity=v, latents=x, sigma=0.8, sigma_next=0.6, next_latents=nxt.index_fill(1, torch.tensor([0]), 9.0),
                     mask=mask)
    torch.testing.assert_close(moved.log_prob, masked.log_prob)
    full = sde_step(velocity=v, latents=x, sigma=0.8, sigma_next=0.6, next_latents=nxt)
    assert not torch.allclose(full.log_prob, masked.log_prob)
