"""FP8 rollouts (`rl_rollout.fp8`, `DiffusionEngine(precision="fp8")`): the quantization by hand,
the CPU emulation against a float32 product, the layer switch and its refresh, and the tiny SD3
engine sampling in FP8 while its replay stays in the weights' dtype."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rl_models import tiny
from rl_models.lora import add_lora
from rl_rollout.diffusion import DiffusionEngine
from rl_rollout.fp8 import (
    FP8,
    Fp8Linears,
    check_precision,
    fp8_linear,
    quantize_rows,
    selected_linears,
)

PROMPTS = ['a sign that says "hello"', 'a poster reading "rl"']
OPTIONS = {"num_steps": 4, "guidance_scale": 4.5, "height": 32, "width": 32, "seeds": [1, 2]}


def test_quantize_rows_by_hand() -> None:
    """Row 0's max is 448, e4m3's largest value: scale 1, and 1, -2 and 0 are exact. Row 1's
    max 1 gives scale 1/448; 0.3 x 448 = 134.4 lies where e4m3 steps by 16, so it becomes 128
    (0.2857 once scaled back). A row of zeros stays 0."""
    x = torch.tensor([[448.0, 1.0, -2.0, 0.0], [1.0, 0.3, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and q.shape == (3, 4) and scale.shape == (3, 1) and scale.dtype == torch.float32
    assert scale[0, 0] == 1.0 and scale[1, 0] == pytest.approx(1 / 448)
    assert q[0].float().tolist() == [448.0, 1.0, -2.0, 0.0]
    assert q[1].float().tolist() == [448.0, 128.0, 0.0, 0.0]
    assert (q[1].float() * scale[1]).tolist() == pytest.approx([1.0, 128 / 448, 0.0, 0.0])
    assert q[2].float().abs().sum() == 0


def test_emulated_linear_is_the_dequantized_product_and_close_to_float32() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 5, 32), torch.randn(48, 32), torch.randn(48)  # [2, 5, K], [N, K], [N]
    qw, sw = quantize_rows(weight)  # [N, K], [N, 1]
    out = fp8_linear(x, qw, sw.t().contiguous(), bias)  # [2, 5, N]
    qx, sx = quantize_rows(x.reshape(10, 32))
    by_hand = (qx.float() * sx) @ (qw.float() * sw).t() + bias  # [10, N]
    assert out.shape == (2, 5, 48)
    assert torch.allclose(out.reshape(10, 48), by_hand, atol=1e-5)
    exact = F.linear(x, weight, bias)
    relative = (out - exact).norm() / exact.norm()
    assert 1e-4 < relative < 0.1  # quantized (not the float32 product), within e4m3's 3 mantissa bits


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.odd = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 32] -> [B, 10]
        return self.odd(self.down(torch.relu(self.up(x))))


def test_switch_refresh_and_selection() -> None:
    """Inside `active()` the aligned layers run the FP8 product and outside they are the plain
    layers again; `refresh()` re-quantizes only the layers whose weight changed; a layer with a
    dimension that does not divide by 16 is left alone."""
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 32)
    fp8 = Fp8Linears(block)
    assert fp8.modules == [block.up, block.down]  # `odd` (32 -> 10) is not aligned
    with pytest.raises(RuntimeError, match="before refresh"), fp8.active():
        pass
    assert fp8.refresh() == 2 and fp8.refresh() == 0
    assert fp8.nbytes() == 32 * 64 + 64 * 32 + 4 * (64 + 32)
    plain = block(x)
    with torch.no_grad(), fp8.active():
        quantized = block(x)
    assert not torch.equal(plain, quantized) and torch.allclose(plain, quantized, atol=0.05)
    assert torch.equal(block(x), plain) and "forward" not in block.up.__dict__
    with torch.no_grad():
        block.down.weight.mul_(2.0)  # an optimizer step, in place: the version counter moves
    assert fp8.refresh() == 1
    with torch.no_grad(), fp8.active():
        assert not torch.equal(block(x), quantized)


def test_lora_adapters_stay_out_and_a_copy_is_seen() -> None:
    """peft keeps each linear as its LoRA layer's base layer: the same modules stay quantized,
    the adapters (lora_A, lora_B) are not added. A copy of the blocks has other modules."""
    engine = DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32)
    blocks = engine.transformer.transformer_blocks
    fp8 = Fp8Linears(blocks)
    assert len(fp8.modules) > 0 and fp8.covers(blocks)
    add_lora(engine.transformer, family="sd3", r=4, alpha=8)
    assert fp8.covers(blocks)
    assert not fp8.covers(copy.deepcopy(blocks))


def test_precision_is_checked() -> None:
    with pytest.raises(ValueError, match="choose 'bf16'"):
        check_precision("int4", torch.device("cpu"), torch.float32)
    check_precision("fp8", torch.device("cpu"), torch.float32)  # emulated on the CPU


@pytest.fixture(scope="module")
def engine() -> DiffusionEngine:
    torch.manual_seed(0)
    return DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.float32)


def test_fp8_sampling_is_off_policy_by_a_small_gap_and_replay_stays_exact(engine: DiffusionEngine) -> None:
    """The FP8 rollout draws other latents from the same seeds, close to the weights' own; its
    replay (the weights' dtype) differs from its log-probs by the quantization's gap, which
    `precision="bf16"` does not have."""
    engine.precision = "bf16"
    exact = engine.sample(PROMPTS, **OPTIONS)
    assert torch.equal(engine.replay(exact, 1).log_prob, exact.log_probs[:, 1])
    engine.precision = "fp8"
    try:
        fp8 = engine.sample(PROMPTS, **OPTIONS)
        over = engine.over(engine.transformer)
        assert over.precision == "fp8"
    finally:
        engine.precision = "bf16"
    assert not torch.equal(fp8.latents, exact.latents)
    assert torch.allclose(fp8.latents, exact.latents, atol=0.2)
    gaps = torch.stack([engine.replay(fp8, k).log_prob - fp8.log_probs[:, k] for k in range(4)])  # [S, B]
    assert 0 < gaps.abs().max() < 0.01
    assert torch.equal(engine.replay(exact, 1).log_prob, exact.log_probs[:, 1])  # the layers are plain again


def test_fp8_weights_follow_the_weights(engine: DiffusionEngine) -> None:
    """An in-place change of the weights (what an optimizer step or a push does) is sampled at
    the next call: the FP8 copy is re-quantized, and sampling again without a change repeats."""
    engine.precision = "fp8"
    linear = selected_linears(engine.transformer.transformer_blocks)[0]
    saved = linear.weight.detach().clone()
    try:
        first = engine.sample(PROMPTS, **OPTIONS)
        assert torch.equal(engine.sample(PROMPTS, **OPTIONS).latents, first.latents)
        with torch.no_grad():
            linear.weight.mul_(3.0)
        assert not torch.equal(engine.sample(PROMPTS, **OPTIONS).latents, first.latents)
    finally:
        with torch.no_grad():
            linear.weight.copy_(saved)
        engine.precision = "bf16"


needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                   reason="needs a CUDA GPU of compute capability 9.0 (FP8 GEMMs)")


@needs_fp8_gpu
def test_the_cuda_kernel_computes_what_the_emulation_does() -> None:
    """`torch._scaled_mm` on the same FP8 values as the CPU emulation: equal up to bf16 output
    rounding and the GEMM's accumulation order."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(64, 256), torch.randn(512, 256), torch.randn(512)
    qw, sw = quantize_rows(weight.bfloat16())
    scale = sw.t().contiguous()
    emulated = fp8_linear(x.bfloat16(), qw, scale, bias.bfloat16()).float()  # [64, 512] on the CPU
    kernel = fp8_linear(x.bfloat16().cuda(), qw.cuda(), scale.cuda(), bias.bfloat16().cuda()).float().cpu()
    assert kernel.dtype == torch.float32 and kernel.shape == (64, 512)
    assert ((kernel - emulated).norm() / emulated.norm()) < 1e-2


# dynamo reads `.grad` of non-leaf fake tensors while tracing (a UserWarning of its own, an error here)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@needs_fp8_gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_sampling_on_the_gpu(compiled: bool) -> None:
    """The tiny SD3 in bf16 on CUDA, blocks eager or compiled: FP8 sampling runs the kernel, its
    images stay close to bf16's, and a bf16 replay sees a gap below 1e-2 per step."""
    engine = DiffusionEngine.from_pretrained(str(tiny.build("sd3")), dtype=torch.bfloat16, device="cuda",
                                             compile=compiled, precision="fp8")
    fp8 = engine.sample(PROMPTS, **OPTIONS)
    engine.precision = "bf16"
    exact = engine.sample(PROMPTS, **OPTIONS)
    assert not torch.equal(fp8.images, exact.images) and torch.allclose(fp8.images, exact.images, atol=0.25)
    gaps = torch.stack([engine.replay(fp8, k).log_prob - fp8.log_probs[:, k] for k in range(4)])  # [S, B]
    assert bool(torch.isfinite(gaps).all()) and gaps.abs().max() < 1e-2


def test_fp8_on_an_older_gpu_or_fp32_weights_is_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the refusal is of a GPU's capability or a CUDA dtype")
    if torch.cuda.get_device_capability() < (9, 0):
        with pytest.raises(ValueError, match=r"compute capability 9\.0"):
            check_precision("fp8", torch.device("cuda"), torch.bfloat16)
    else:
        with pytest.raises(ValueError, match="needs bfloat16 weights"):
            check_precision("fp8", torch.device("cuda"), torch.float32)


def test_janus_decodes_in_fp8_with_the_samplers_log_probs() -> None:
    """JanusEngine(precision="fp8"): the decode and its rescore run the FP8 layers, so the
    log-probs are the sampler's; an unquantized replay of the same tokens differs from them by
    the quantization's gap, where the unquantized engine's rescore is exact."""
    from rl_rollout.janus import JanusEngine

    engine = JanusEngine.from_pretrained(tiny.build("janus"), dtype=torch.float32, device="cpu")
    exact = engine.sample(["a red cube", "a blue ball"], seeds=[0, 1])
    assert torch.equal(engine.replay(exact.tokens, guidance_scale=exact.guidance_scale, temperature=1.0),
                       exact.log_probs)
    engine.precision = "fp8"
    fp8 = engine.sample(["a red cube", "a blue ball"], seeds=[0, 1])
    assert engine.over(engine.model).precision == "fp8"
    engine.precision = "bf16"
    gap = (engine.replay(fp8.tokens, guidance_scale=fp8.guidance_scale, temperature=1.0) - fp8.log_probs).abs()
    assert 0 < gap.max() < 0.5


@needs_fp8_gpu
def test_janus_decodes_in_fp8_on_the_gpu() -> None:
    """The tiny Janus in bf16 on CUDA, log-probs from the decode itself: the FP8 decode runs the
    kernel, a rescore of its tokens through the same FP8 layers stays closer to the sampler's
    log-probs than a bf16 replay does, and the bf16 replay's gap is small."""
    from rl_models.janus import janus_causal_lm
    from rl_rollout.janus import JanusEngine

    engine = JanusEngine.from_pretrained(tiny.build("janus"), dtype=torch.bfloat16, device="cuda", precision="fp8",
                                         logprobs="decode", compile=False)
    fp8 = engine.sample(["a red cube", "a blue ball"], seeds=[0, 1])
    with engine._sampling_precision(janus_causal_lm(engine.model).model.language_model):
        rescored = engine.replay(fp8.tokens, guidance_scale=fp8.guidance_scale, temperature=1.0).float()  # [B, N]
    engine.precision = "bf16"
    bf16 = engine.replay(fp8.tokens, guidance_scale=fp8.guidance_scale, temperature=1.0).float()  # [B, N]
    same_kernels, across = (rescored - fp8.log_probs).abs(), (bf16 - fp8.log_probs).abs()
    print(f"FP8 rescore gap mean {same_kernels.mean():.2e} max {same_kernels.max():.2e}; "
          f"bf16 replay gap mean {across.mean():.2e} max {across.max():.2e}")
    assert bool(torch.isfinite(fp8.log_probs).all())
    assert same_kernels.mean() < across.mean() and 0 < across.max() < 0.5
