"""CosmosEngine on the tiny random Cosmos-Predict2.5 pipeline of rl_models.tiny (real from_pretrained)."""

from __future__ import annotations

import copy

import diffusers
import pytest
import torch

from rl_core.flow import sde_step
from rl_models import tiny
from rl_models.lora import add_lora
from rl_models.tiny_cosmos import TEXT_STATES
from rl_rollout import ImageEngine, build_image_engine
from rl_rollout.cosmos import CosmosEngine, NoGuardrail
from rl_rollout.diffusion import DiffusionEngine

PROMPTS = ["a red sign waving", "a cat runs"]
SIZE, FRAMES = 32, 5  # 5 frames: 2 latent frames (the first alone, then 4)
TOKENS = 64  # the pipeline's system turn takes ~46 tokens of the tiny tokenizer: 64 keep the prompt


@pytest.fixture(scope="module")
def engine() -> CosmosEngine:
    return CosmosEngine.from_pretrained(str(tiny.build("cosmos")), num_frames=FRAMES)


def _sample(engine: CosmosEngine, prompts: list[str] = PROMPTS, **kwargs):
    options = dict(num_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE, seeds=[1, 2], max_sequence_length=TOKENS)
    options.update(kwargs)
    return engine.sample(prompts, **options)


def test_a_world_trajectory_replays_with_ratio_exactly_one(engine: CosmosEngine) -> None:
    traj = _sample(engine)
    assert traj.latents.shape == (2, 4, 16, 2, SIZE // 8, SIZE // 8)  # [B, S + 1, C, F', h, w]: C = 17 - the mask
    assert traj.images.shape == (2, FRAMES, 3, SIZE, SIZE)  # [B, F, 3, H, W]
    assert float(traj.images.min()) >= 0.0 and float(traj.images.max()) <= 1.0
    assert traj.conditioning.embeds.shape == (2, TOKENS, TEXT_STATES)  # every Qwen2.5-VL layer, concatenated
    assert traj.log_probs.shape == (2, 3) and bool(torch.isfinite(traj.log_probs).all())
    for step in range(traj.num_steps):  # the same float32 step and CFG forward as the rollout's
        assert torch.equal(engine.replay(traj, step).log_prob, traj.log_probs[:, step]), step


class _StandInGuardrail:
    """For the pipeline's own call only: `cosmos_guardrail` (downloads its own models) cannot run here."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True


def test_ode_sampling_is_diffusers_own_cosmos_pipeline(engine: CosmosEngine) -> None:
    """The engine runs diffusers' Cosmos classes, and with an Euler scheduler on both sides its ODE
    video is the one `Cosmos2_5_PredictBasePipeline.__call__` makes from the same noise: the same
    prompt states, timestep (sigma itself), condition and padding masks, negative prompt, CFG
    (diffusers' 7 is the engine's 8; off is diffusers' 0 and the engine's 1), VAE un-normalising."""
    pipeline = engine.pipeline
    assert isinstance(pipeline, diffusers.Cosmos2_5_PredictBasePipeline)
    assert isinstance(pipeline.transformer, diffusers.CosmosTransformer3DModel)
    assert isinstance(pipeline.vae, diffusers.AutoencoderKLWan)
    assert isinstance(pipeline.safety_checker, NoGuardrail)
    euler = diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0)
    ours = CosmosEngine(type(pipeline)(**{**pipeline.components, "scheduler": copy.deepcopy(euler)}),
                        num_frames=FRAMES)
    theirs = type(pipeline)(**{**pipeline.components, "scheduler": euler, "safety_checker": _StandInGuardrail()})
    theirs.set_progress_bar_config(disable=True)
    for engine_scale, diffusers_scale in ((8.0, 7.0), (1.0, 0.0)):
        traj = _sample(ours, kind="ode", guidance_scale=engine_scale)
        call = dict(prompt=PROMPTS, num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=3,
                    guidance_scale=diffusers_scale, latents=traj.latents[:, 0].clone(), max_sequence_length=TOKENS)
        latents = theirs(**call, output_type="latent").frames  # [B, C, F', h, w]
        frames = theirs(**call, output_type="pt").frames  # [B, F, 3, H, W] in [0, 1]
        torch.testing.assert_close(traj.latents[:, -1], latents, rtol=0, atol=1e-6)
        torch.testing.assert_close(traj.images, frames, rtol=0, atol=1e-5)


def test_the_pipeline_itself_refuses_to_run_without_a_guardrail(engine: CosmosEngine) -> None:
    with pytest.raises(RuntimeError, match=r"without a guardrail.*cosmos_guardrail's CosmosSafetyChecker"):
        engine.pipeline(prompt="a cat", num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=1)


def test_seeds_prompts_and_windows(engine: CosmosEngine) -> None:
    """A seed gives the same video again and another seed another; the prompt steers the video
    (the Qwen2.5-VL states reach the transformer); outside an SDE window the steps are ODE steps."""
    first, again = _sample(engine), _sample(engine)
    assert torch.equal(first.latents, again.latents) and torch.equal(first.images, again.images)
    assert not torch.allclose(first.latents[0, -1], _sample(engine, seeds=[3, 2]).latents[0, -1])
    assert not torch.allclose(first.latents[0, -1], _sample(engine, PROMPTS[::-1]).latents[0, -1])
    windowed = _sample(engine, sde_window=(1, 2))
    assert windowed.sde_steps.tolist() == [False, True, False]
    assert windowed.log_probs[:, 0].eq(0).all() and windowed.log_probs[:, 2].eq(0).all()


def test_cfg_off_runs_the_conditional_branch_only_and_the_negative_prompt_steers_cfg(engine: CosmosEngine) -> None:
    """Guidance 1 runs every forward over the 2 prompts' rows (no negative prompt, so another one
    changes nothing); with CFG the rows are [negative; prompts] in one forward, and the negative
    prompt (Cosmos' own by default, the empty one on request) steers the video."""
    rows: list[int] = []
    hook = engine.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        plain = _sample(engine, guidance_scale=1.0)
        engine.replay(plain, 1)
        assert rows == [2] * 4
        rows.clear()
        guided = _sample(engine)
        engine.replay(guided, 1)
        assert rows == [4] * 4
    finally:
        hook.remove()
    assert not torch.allclose(plain.latents[:, -1], guided.latents[:, -1])
    empty = CosmosEngine(engine.pipeline, num_frames=FRAMES, negative_prompt="")
    assert torch.equal(_sample(empty, guidance_scale=1.0).latents, plain.latents)
    assert not torch.allclose(_sample(empty).latents[:, -1], guided.latents[:, -1])


def test_a_lora_replay_carries_gradient_and_a_copy_samples_alike() -> None:
    """A LoRA on the transformer's attention gets gradients from a replayed step's log-prob;
    `over` (an asynchronous rollout's engine over a copy of the transformer) samples the same video."""
    fresh = CosmosEngine.from_pretrained(str(tiny.build("cosmos")), num_frames=FRAMES)
    fresh.transformer.requires_grad_(False)
    peft = add_lora(fresh.transformer, target_modules=["to_q", "to_k", "to_v", "to_out.0"], r=2, alpha=4,
                    init_lora_weights=False)
    traj = _sample(fresh, guidance_scale=1.0)
    fresh.replay(traj, 1, model=peft).log_prob.sum().backward()
    grads = [p.grad for name, p in peft.named_parameters() if "lora_" in name]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    twin = fresh.over(copy.deepcopy(fresh.transformer))
    assert torch.equal(_sample(twin, guidance_scale=1.0).latents, traj.latents)


def test_registered_as_an_image_engine_that_sleeps_and_wakes() -> None:
    """`build_image_engine("cosmos", ...)`: the image engines' protocol; asleep, then awake, it
    samples the same video as before."""
    engine = build_image_engine("cosmos", path=str(tiny.build("cosmos")), num_frames=FRAMES, device="cpu")
    assert isinstance(engine, CosmosEngine) and isinstance(engine, ImageEngine)
    before = _sample(engine)
    engine.sleep()
    assert engine.is_asleep
    engine.wake()
    assert not engine.is_asleep and torch.equal(_sample(engine).images, before.images)


@pytest.mark.slow
# dynamo reads `.grad` of non-leaf tensors while tracing with grad (as in test_diffusion.py)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_blocks_sample_what_eager_does(engine: CosmosEngine) -> None:
    """Cosmos' `transformer_blocks` compile whole (fullgraph; a fallback would warn, an error
    here): the same videos as eager sampling, and the compiled replay scores them as sampled
    (~40 s on a CPU with a cold inductor cache)."""
    compiled = CosmosEngine.from_pretrained(str(tiny.build("cosmos")), num_frames=FRAMES, compile=True)
    traj = _sample(compiled)
    torch.testing.assert_close(traj.latents, _sample(engine).latents)
    torch.testing.assert_close(compiled.replay(traj, 1).log_prob, traj.log_probs[:, 1])
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="Detected recompile"):
        _sample(compiled, PROMPTS[:1], seeds=[1])  # the compiled blocks ran: a new batch size is a new graph


def test_bad_frame_counts_sizes_and_options_are_named() -> None:
    path = str(tiny.build("cosmos"))
    with pytest.raises(ValueError, match=r"num_frames=6: Cosmos' VAE \(Wan's\) takes 4k \+ 1 frames"):
        CosmosEngine.from_pretrained(path, num_frames=6)
    with pytest.raises(ValueError, match="cuda_graphs: not offered for Cosmos"):
        CosmosEngine.from_pretrained(path, num_frames=FRAMES, cuda_graphs=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        CosmosEngine.from_pretrained(path, num_frames=1).sample(["x"], height=24, width=32, num_steps=1)


def test_video_to_world_is_diffusers_own_with_the_given_frame(engine: CosmosEngine) -> None:
    """Given a first frame (`encode_world`), the ODE video is the one `Cosmos2_5_PredictBasePipeline`
    makes from the same frame (`video=`, one latent conditional frame) and noise, Euler on both
    sides: the frame's latents held clean in the input, the condition mask, its timestep 0.0001."""
    pipeline = engine.pipeline
    euler = diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0)
    ours = CosmosEngine(type(pipeline)(**{**pipeline.components, "scheduler": copy.deepcopy(euler)}),
                        num_frames=FRAMES)
    theirs = type(pipeline)(**{**pipeline.components, "scheduler": euler, "safety_checker": _StandInGuardrail()})
    theirs.set_progress_bar_config(disable=True)
    first = _sample(ours, PROMPTS[:1], kind="ode", seeds=[3]).images[:, :1]  # [1, 1, 3, H, W]: a frame to go on from
    given = ours.encode_world(PROMPTS[:1], first, max_sequence_length=TOKENS)
    for engine_scale, diffusers_scale in ((8.0, 7.0), (1.0, 0.0)):
        traj = _sample(ours, PROMPTS[:1], kind="ode", guidance_scale=engine_scale, seeds=[1], conditioning=given)
        noise = ours.initial_noise(1, SIZE, SIZE, [torch.Generator().manual_seed(1)])  # [1, C, F', h, w]
        latents = theirs(prompt=PROMPTS[:1], video=(first * 2 - 1).transpose(1, 2), num_latent_conditional_frames=1,
                         num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=diffusers_scale,
                         latents=noise, max_sequence_length=TOKENS, output_type="latent").frames  # [1, C, F', h, w]
        # diffusers sums the given frames' velocity into its CFG too: last-bit differences (2.4e-6 seen)
        torch.testing.assert_close(traj.latents[:, -1], latents, rtol=0, atol=1e-5)
        assert not torch.allclose(traj.latents[:, -1, :, 1:], _sample(ours, PROMPTS[:1], kind="ode", seeds=[1],
                                                                      guidance_scale=engine_scale).latents[:, -1, :, 1:])


def test_given_frames_are_held_and_left_out_of_the_log_probs(engine: CosmosEngine) -> None:
    """SDE sampling given a first frame per sample: latent frame 0 is the frame's latents at every
    step, the replay gives ratio exactly 1 (the trajectory carries what was given), and a step's
    log-prob is the mean over the generated frame's elements alone."""
    frames = torch.rand(2, 1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))  # [B, 1, 3, H, W]
    given = engine.encode_world(PROMPTS, frames, max_sequence_length=TOKENS)
    assert given.held_mask.flatten().tolist() == [1.0, 0.0, 1.0, 0.0]  # [B, 1, F' = 2, 1, 1]: frame 0 of each
    traj = _sample(engine, conditioning=given)
    held = given.held[:, None, :, :1].expand(-1, traj.latents.shape[1], -1, -1, -1, -1)  # [B, S + 1, C, 1, h, w]
    assert torch.equal(traj.latents[:, :, :, :1], held)
    for step in range(traj.num_steps):
        assert torch.equal(engine.replay(traj, step).log_prob, traj.log_probs[:, step]), step
    step = engine.replay(traj, 1)
    alone = sde_step(velocity=engine.velocity(traj.latents[:, 1], torch.full((2,), float(traj.sigmas[1])), given,
                                              guidance_scale=5.0)[:, :, 1:],
                     latents=traj.latents[:, 1, :, 1:], sigma=float(traj.sigmas[1]), sigma_next=float(traj.sigmas[2]),
                     next_latents=traj.latents[:, 2, :, 1:])
    torch.testing.assert_close(step.log_prob, alone.log_prob, rtol=1e-5, atol=1e-6)
    for count in (2, FRAMES):  # not 4k + 1; no frame left to generate
        with pytest.raises(ValueError, match=r"F_in = 4k \+ 1 < num_frames=5"):
            engine.encode_world(PROMPTS, torch.rand(2, count, 3, SIZE, SIZE))
    # an image beside a clip (9 frames: 3 latent frames): each row as encoded alone
    nine = CosmosEngine(engine.pipeline, num_frames=9)
    clip = torch.rand(5, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))  # [F_in, 3, H, W]
    mixed = nine.encode_world(PROMPTS, [frames[0], clip], max_sequence_length=TOKENS)
    alone = [nine.encode_world(PROMPTS[:1], frames[:1], max_sequence_length=TOKENS),
             nine.encode_world(PROMPTS[1:], clip[None], max_sequence_length=TOKENS)]
    for name in ("embeds", "held", "held_mask"):
        torch.testing.assert_close(getattr(mixed, name), torch.cat([getattr(a, name) for a in alone]))
    assert mixed.held_mask.flatten().tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"DiffusionEngine samples from text alone"):
        DiffusionEngine.from_pretrained(str(tiny.build("sd3"))).velocity(
            torch.zeros(1, 16, 4, 4), torch.ones(1), given.index([0]), guidance_scale=1.0)
