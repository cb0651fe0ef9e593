"""DiffusionEngine on a tiny random SD3 pipeline built by rl_models.tiny (real from_pretrained)."""

from __future__ import annotations

import pytest
import torch

from rl_models import tiny
from rl_rollout.diffusion import DiffusionEngine

PROMPTS = ['a sign that says "hello"', 'a poster reading "rl"']
SIZE = 32  # pixels; latents are SIZE / vae_scale_factor


@pytest.fixture(scope="module")
def engine() -> DiffusionEngine:
    torch.manual_seed(0)
    return DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32)


def _sample(engine: DiffusionEngine, **kwargs) -> object:
    options = dict(num_steps=4, guidance_scale=4.5, height=SIZE, width=SIZE, seeds=[1, 2])
    options.update(kwargs)
    return engine.sample(PROMPTS, **options)


def test_trajectory_shapes(engine: DiffusionEngine) -> None:
    traj = _sample(engine)
    scale = engine.pipeline.vae_scale_factor
    channels = engine.transformer.config.in_channels
    assert traj.latents.shape == (2, 5, channels, SIZE // scale, SIZE // scale)
    assert traj.latents.dtype == torch.float32
    assert traj.sigmas.shape == (5,) and traj.sigmas[0] == 1.0 and traj.sigmas[-1] == 0.0
    assert traj.timesteps.shape == (4,)
    assert traj.log_probs.shape == (2, 4) and bool(torch.isfinite(traj.log_probs).all())
    assert traj.images.shape == (2, 3, SIZE, SIZE)
    assert float(traj.images.min()) >= 0.0 and float(traj.images.max()) <= 1.0
    assert traj.sde_steps.tolist() == [True, True, True, True]


@pytest.mark.parametrize("kind, noise", [("sde", 0.7), ("cps", 0.8)])
def test_replay_at_unchanged_weights_gives_ratio_exactly_one(
    engine: DiffusionEngine, kind: str, noise: float
) -> None:
    traj = _sample(engine, kind=kind, noise_level=noise)
    for step in range(traj.num_steps):
        if kind == "cps" and step == traj.num_steps - 1:
            continue  # the last cps step has sigma_next = 0: deterministic, log-prob 0
        replayed = engine.replay(traj, step)
        ratio = torch.exp(replayed.log_prob - traj.log_probs[:, step])  # [B]
        assert torch.equal(replayed.log_prob, traj.log_probs[:, step]), (kind, step)
        assert torch.equal(ratio, torch.ones_like(ratio))


def test_replay_carries_gradient_to_the_transformer(engine: DiffusionEngine) -> None:
    traj = _sample(engine)
    engine.transformer.zero_grad(set_to_none=True)
    engine.replay(traj, 1).log_prob.sum().backward()
    grads = [p.grad for p in engine.transformer.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    engine.transformer.zero_grad(set_to_none=True)


def test_sde_window_uses_the_ode_outside_it(engine: DiffusionEngine) -> None:
    traj = _sample(engine, sde_window=(1, 3))
    assert traj.sde_steps.tolist() == [False, True, True, False]
    assert traj.log_probs[:, 0].abs().sum() == 0 and traj.log_probs[:, 3].abs().sum() == 0
    assert bool((traj.log_probs[:, 1:3] != 0).all())
    with pytest.raises(ValueError, match="ODE"):
        engine.replay(traj, 0)


def test_seeds_make_samples_reproducible_and_distinct(engine: DiffusionEngine) -> None:
    first, again = _sample(engine), _sample(engine)
    assert torch.equal(first.latents, again.latents)
    other = _sample(engine, seeds=[3, 4])
    assert not torch.allclose(first.latents[:, -1], other.latents[:, -1])
    # a sample does not depend on its batch-mates: sample 1 alone equals sample 1 in the pair
    alone = engine.sample(PROMPTS[:1], num_steps=4, height=SIZE, width=SIZE, seeds=[1])
    assert torch.allclose(alone.latents[0], first.latents[0], atol=1e-5)


def test_ode_sampling_is_deterministic_and_has_no_log_probs(engine: DiffusionEngine) -> None:
    a = _sample(engine, kind="ode", seeds=[5, 5])
    b = _sample(engine, kind="ode", seeds=[5, 5])
    assert torch.equal(a.images, b.images)
    assert a.log_probs.abs().sum() == 0 and not a.sde_steps.any()


def test_bad_arguments_are_named(engine: DiffusionEngine) -> None:
    with pytest.raises(ValueError, match="multiples"):
        _sample(engine, height=SIZE + 2)
    with pytest.raises(ValueError, match="sde_window"):
        _sample(engine, sde_window=(2, 9))
    with pytest.raises(ValueError, match="seeds"):
        _sample(engine, seeds=[1])
    with pytest.raises(ValueError, match="kind"):
        _sample(engine, kind="ddim")
