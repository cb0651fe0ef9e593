"""DiffusionEngine on a tiny random SD3 pipeline built by rl_models.tiny (real from_pretrained)."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import PeftModel

from rl_models import tiny
from rl_models.lora import add_lora
from rl_rollout.diffusion import (
    AUTO_ON_CUDA,
    DiffusionEngine,
    SampleBatch,
    join_rows,
    pack_rows,
    resolve_options,
    same_schedule,
)

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


def test_kept_means_are_the_steps_transition_means(engine: DiffusionEngine) -> None:
    """`keep_means` (GRPO-Guard's RatioNorm needs them): an SDE step's kept mean is the one its
    replay at unchanged weights computes, bit for bit; an ODE step's is its result. Not kept by
    default."""
    assert _sample(engine).means is None
    traj = _sample(engine, sde_window=(1, 3), keep_means=True)
    assert traj.means.shape == (2, 4, *traj.latents.shape[2:]) and traj.means.dtype == torch.float32
    for step in (1, 2):
        assert torch.equal(engine.replay(traj, step).mean, traj.means[:, step])
    assert torch.equal(traj.means[:, 0], traj.latents[:, 1]) and torch.equal(traj.means[:, 3], traj.latents[:, 4])


def test_guidance_one_runs_the_conditional_branch_only(engine: DiffusionEngine) -> None:
    """CFG-free training (Flow-GRPO's `train.cfg = False` with guidance 1): every transformer
    forward of the rollout and of the replay sees the 2 prompts' rows, not 4 ([uncond; cond])."""
    rows: list[int] = []
    hook = engine.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        traj = _sample(engine, guidance_scale=1.0)
        engine.replay(traj, 1)
        assert rows == [2] * 5 and traj.guidance_scale == 1.0
        rows.clear()
        engine.replay(_sample(engine), 1)
        assert rows == [4] * 5
    finally:
        hook.remove()


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


# -- compiled transformer blocks (inductor on CPU here; CUDA in the benchmark) -------------------


def _lora_engine(compile: bool) -> tuple[DiffusionEngine, PeftModel]:
    """A private engine with random-B peft LoRA (the trainer's setup), added before any forward."""
    torch.manual_seed(0)
    engine = DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32, compile=compile)
    engine.transformer.requires_grad_(False)
    return engine, add_lora(engine.transformer, family="sd3", r=4, alpha=8, init_lora_weights=False)


def _assert_same_sample(a: object, b: object, atol: float) -> None:
    for name in ("latents", "log_probs", "images"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=atol, msg=name)


def test_compiled_blocks_sample_what_eager_does_and_see_in_place_updates() -> None:
    """With LoRA, compiled sampling equals eager sampling within float32 rounding; a second call
    and an in-place LoRA update (an optimizer step, a weight push) compile nothing new and the
    update reaches the compiled graph; another batch size would compile a new graph."""
    engine, peft = _lora_engine(compile=True)
    compiled = _sample(engine)  # compiles the 2 tiny blocks (dual-attention, last): ~25 s
    engine.compile = False  # restores the blocks' eager forward
    _assert_same_sample(compiled, _sample(engine), atol=1e-5)
    engine.compile = True
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)  # in place, as optimizer.step() and load_state_dict do
    with torch.compiler.set_stance("fail_on_recompile"):
        updated = _sample(engine)
        with pytest.raises(RuntimeError, match="Detected recompile"):  # the compiled blocks ran
            engine.sample(PROMPTS[:1], num_steps=1, height=SIZE, width=SIZE, seeds=[1])
    assert not torch.allclose(updated.latents[:, -1], compiled.latents[:, -1], atol=1e-3)
    engine.compile = False
    _assert_same_sample(updated, _sample(engine), atol=1e-5)


def test_failed_compilation_warns_and_samples_eagerly() -> None:
    """A block that cannot compile as one graph (a data-dependent branch) falls back to eager."""

    class Branching(torch.nn.Module):  # the same values, behind a branch dynamo cannot trace
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> object:
            return self.inner(x, *args, **kwargs) if bool(x.isfinite().all()) else None

    engine = DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32, compile=False)
    expected = _sample(engine)
    block = engine.pipeline.transformer.transformer_blocks[0]
    block.norm1 = Branching(block.norm1)
    engine.compile = True
    with pytest.warns(RuntimeWarning, match="running eagerly from now on"):
        got = _sample(engine)
    assert engine.compile is False
    _assert_same_sample(got, expected, atol=0)


@pytest.mark.slow
# dynamo reads `.grad` of non-leaf tensors while tracing with grad and hides the warning through
# `warnings.showwarning`, which filterwarnings=error pre-empts
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_replay_matches_the_compiled_rollout_and_eager_gradients() -> None:
    """Replay with gradients through the compiled blocks, via the peft model as the trainer does:
    ratio 1 on the first replay (float32, inductor on CPU), the LoRA-off reference compiles too,
    and the LoRA gradients equal eager ones within float32 rounding. ~90 s on 2 cores."""
    engine, peft = _lora_engine(compile=True)
    traj = _sample(engine)
    out = engine.replay(traj, 1, model=peft)
    torch.testing.assert_close(out.log_prob, traj.log_probs[:, 1], rtol=0, atol=1e-6)
    with torch.no_grad(), peft.disable_adapter():
        ref = engine.replay(traj, 1, model=peft)
    out.log_prob.sum().backward()
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="Detected recompile"):
        engine.replay(traj, 1, rows=torch.tensor([0]), model=peft)  # the compiled blocks ran
    compiled = {n: p.grad.clone() for n, p in peft.named_parameters() if p.grad is not None}
    assert compiled and all("lora_" in n for n in compiled)
    engine.compile = False
    peft.zero_grad(set_to_none=True)
    engine.replay(traj, 1, model=peft).log_prob.sum().backward()
    for name, p in peft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(compiled[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad(), peft.disable_adapter():
        torch.testing.assert_close(ref.mean, engine.replay(traj, 1, model=peft).mean, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")  # inductor's hint, raised as an error otherwise
@pytest.mark.parametrize("compile", [False, True])
def test_sampling_never_waits_for_the_gpu(compile: bool) -> None:
    """After a warm-up call (compiling, caching the unconditional embeddings), a whole `sample`
    (denoise loop, SDE steps with log-probs, VAE decode) makes no synchronising CUDA call."""
    engine = DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32, device="cuda",
                                             compile=compile)
    conditioning = engine.encode(PROMPTS)
    _sample(engine, conditioning=conditioning)
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # "a prototype feature" warning, an error under our filterwarnings
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        traj = _sample(engine, conditioning=conditioning)
    finally:  # also when setting the mode raised: later tests must not run under it
        torch.cuda.set_sync_debug_mode("default")
    assert traj.latents.is_cuda and bool(torch.isfinite(traj.log_probs).all())


# -- rollout options (benchmarks/diffusion_grpo.py measures each on CUDA) --------------------------


@pytest.mark.parametrize("backend, atol", [("flash", 0.0), ("math", 1e-5)])
def test_attention_backends_sample_what_the_default_does(engine: DiffusionEngine, backend: str, atol: float) -> None:
    """On CPU PyTorch's default pick for these inputs is the flash kernel: `flash` is bit-equal,
    `math` (softmax(QK^T)V in plain ops) equal within float32 rounding; replay runs the same
    backend, so the first replay's ratio is still exactly 1."""
    default = _sample(engine)
    engine.attention_backend = backend
    try:
        chosen = _sample(engine)
        replayed = engine.replay(chosen, 1)
    finally:
        engine.attention_backend = "default"
    _assert_same_sample(chosen, default, atol=atol)
    torch.testing.assert_close(replayed.log_prob.detach(), chosen.log_probs[:, 1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="attention_backend='fast' is not one of"):
        engine.attention_backend = "fast"
        _sample(engine)
    engine.attention_backend = "default"


def test_sample_many_returns_what_each_sample_call_does(engine: DiffusionEngine) -> None:
    """One trajectory per batch, bit-equal to that batch's own `sample` call (same code path as
    `overlap_decode`, which moves only the decode to a side stream on CUDA)."""
    first, second = SampleBatch(PROMPTS, seeds=[1, 2]), SampleBatch(PROMPTS[::-1], seeds=[3, 4], sde_window=(1, 3))
    many = engine.sample_many([first, second], num_steps=4, height=SIZE, width=SIZE)
    for batch, traj in zip([first, second], many, strict=True):
        alone = engine.sample(batch.prompts, seeds=batch.seeds, sde_window=batch.sde_window, num_steps=4,
                              height=SIZE, width=SIZE)
        _assert_same_sample(traj, alone, atol=0.0)
        assert traj.prompts == tuple(batch.prompts)
    assert many[1].sde_steps.tolist() == [False, True, True, False]


def test_cuda_only_options_are_refused_on_cpu_and_auto_turns_them_off() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_options(cpu, cuda_graphs=None, attention_backend="auto", overlap_decode=None) == (
        False, "default", False)
    assert resolve_options(cuda, cuda_graphs=None, attention_backend="auto", overlap_decode=None) == (
        AUTO_ON_CUDA["cuda_graphs"], AUTO_ON_CUDA["attention_backend"], AUTO_ON_CUDA["overlap_decode"])
    assert resolve_options(cuda, cuda_graphs=True, attention_backend="cudnn", overlap_decode=True) == (
        True, "cudnn", True)
    assert resolve_options(cpu, cuda_graphs=False, attention_backend="math", overlap_decode=False) == (
        False, "math", False)
    for options, match in [
        ({"cuda_graphs": True}, r"cuda_graphs=True needs a CUDA device \(got cpu\)"),
        ({"overlap_decode": True}, r"overlap_decode=True needs a CUDA device"),
        ({"attention_backend": "cudnn"}, r"attention_backend='cudnn' needs a CUDA device"),
        ({"attention_backend": "efficient"}, r"attention_backend='efficient' needs a CUDA device"),
        ({"attention_backend": "sage"}, r"attention_backend='sage' is not one of: auto, default, flash"),
    ]:
        kwargs = {"cuda_graphs": None, "attention_backend": "auto", "overlap_decode": None, **options}
        with pytest.raises(ValueError, match=match):
            resolve_options(cpu, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graphs_and_overlapped_decode_sample_what_the_plain_loop_does(compile: bool) -> None:
    """Graphed forwards replay the same kernels on the same inputs: bit-equal latents, log-probs
    and images; a LoRA added after the capture is seen (the graph is captured again); the
    overlapped decode returns the images of the sequential one; a graphed `sample` never syncs."""
    engine = DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32, device="cuda",
                                             compile=compile, cuda_graphs=False, overlap_decode=False)
    conditioning = engine.encode(PROMPTS)
    plain = _sample(engine, conditioning=conditioning)
    engine.cuda_graphs = True
    graphed = _sample(engine, conditioning=conditioning)  # captures
    _assert_same_sample(graphed, plain, atol=0.0)
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        again = _sample(engine, conditioning=conditioning)  # replays
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_same_sample(again, plain, atol=0.0)
    batches = [SampleBatch(PROMPTS, conditioning=conditioning, seeds=[1, 2]),
               SampleBatch(PROMPTS, conditioning=conditioning, seeds=[3, 4])]
    sequential = engine.sample_many(batches, num_steps=4, height=SIZE, width=SIZE)
    engine.overlap_decode = True
    overlapped = engine.sample_many(batches, num_steps=4, height=SIZE, width=SIZE)
    for a, b in zip(overlapped, sequential, strict=True):
        _assert_same_sample(a, b, atol=0.0)
    engine.transformer.requires_grad_(False)
    lora = add_lora(engine.transformer, family="sd3", r=4, alpha=8)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    graphed_lora = _sample(engine, conditioning=conditioning)
    engine.cuda_graphs = False
    _assert_same_sample(graphed_lora, _sample(engine, conditioning=conditioning), atol=0.0)
    assert not torch.allclose(graphed_lora.images, plain.images, atol=1e-3)


def test_pack_rows_joins_the_rows_of_one_schedule_and_replays_what_each_batch_does(engine: DiffusionEngine) -> None:
    """Sampled batches a, b (one schedule) and c (other guidance), 2 images each; one optimizer
    step trains a's rows 0, 1, b's row 1 and c's row 0, plus a weight-0 filler. In forwards of 3
    rows, a's and b's rows become one joined trajectory (source 3), c's stay apart (another
    schedule), the filler is kept as it is; the joined replay gives each batch's own log-probs."""
    a, b, c = _sample(engine), _sample(engine, seeds=[3, 4]), _sample(engine, guidance_scale=1.0)
    steps = [[0, 1, 2]] * 3
    assert same_schedule(a, b, steps[0], steps[1]) and not same_schedule(a, c, steps[0], steps[2])
    assert not same_schedule(a, b, [0, 1], [0, 2])
    adv = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    plan = [[(0, torch.tensor([0, 1]), 1.0), (1, torch.tensor([1]), 1.0), (2, torch.tensor([0]), 1.0),
             (0, torch.tensor([0]), 0.0)]]
    sources, advs, packed = pack_rows([a, b, c], adv, steps, plan, 3)
    assert [(k, rows.tolist(), w) for k, rows, w in packed[0]] == [(0, [0], 0.0), (3, [0, 1, 2], 1.0), (2, [0], 1.0)]
    joined, joined_steps = sources[3]
    assert len(sources) == 4 and joined_steps == [0, 1, 2] and advs[3].tolist() == [1.0, 2.0, 4.0]
    assert joined.prompts == (PROMPTS[0], PROMPTS[1], PROMPTS[1])
    torch.testing.assert_close(joined.latents, torch.cat([a.latents, b.latents[1:]]), atol=0, rtol=0)
    assert torch.equal(joined.conditioning.embeds, torch.cat([a.conditioning.embeds, b.conditioning.embeds[1:]]))
    assert torch.equal(join_rows([(a, torch.tensor([1]))]).log_probs, a.log_probs[1:])
    with torch.no_grad():
        replayed = engine.replay(joined, 1, rows=torch.arange(3)).log_prob  # [3]
        apart = torch.cat([engine.replay(a, 1, rows=torch.tensor([0, 1])).log_prob,
                           engine.replay(b, 1, rows=torch.tensor([1])).log_prob])  # [3]
    torch.testing.assert_close(replayed, apart, atol=1e-5, rtol=1e-5)


def test_encoded_pixels_are_the_latents_decode_reads(engine: DiffusionEngine) -> None:
    """`encode_pixels` is `decode`'s inverse scaling: decoding its latents gives the VAE's own
    round trip (encode's mode, decode, in raw units), and its latents have the sampler's shape."""
    images = engine.sample(PROMPTS, num_steps=2, guidance_scale=1.0, height=SIZE, width=SIZE, kind="ode",
                           seeds=[1, 2]).images  # [2, 3, H, W]
    latents = engine.encode_pixels(images)
    assert latents.shape == engine.initial_noise(2, SIZE, SIZE, [torch.Generator()] * 2).shape
    vae = engine.pipeline.vae
    with torch.no_grad():
        raw = vae.decode(vae.encode(images * 2 - 1).latent_dist.mode()).sample / 2 + 0.5  # [2, 3, H, W]
    torch.testing.assert_close(engine.decode(latents), raw.clamp(0, 1), atol=1e-5, rtol=0)
    assert torch.equal(engine.encode_pixels(images), latents)
