from __future__ import annotations

import math
import re

import pytest
import torch

from rl_core.flow import compute_ratio_guard, compute_sde_window, flow_kl, host_randn, sde_step
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
