"""Janus-Pro-7B image-token rollout: our `janus` engine vs transformers' image `generate()`, and
the peak memory of one token-level GRPO training step.

    PYTHONPATH=packages/rl-core/src:packages/rl-models/src:packages/rl-rollout/src \
        python benchmarks/janus.py --out benchmarks/RESULTS.md   # one H100/H200, ~5-8 minutes
    python benchmarks/janus.py --tiny                          # tiny Janus, CPU, seconds, prints only

Model: Janus-Pro-7B at full shape with random bf16 weights, built in memory from
`rl_models.shapes.janus_pro_config("pro-7b")` (30-layer 4096-wide language model, 16,384-code VQ
head, 576 tokens per 384x384 image). 16 prompts x 8 images, CFG 5, temperature 1.

(a) Rollout, images/s (VQ decode included in both), median of `--repeats` after a warm-up run:
    - transformers: `model.generate(**inputs, generation_mode="image", do_sample=True,
      guidance_scale=5, num_return_sequences=8)` (its eager decode loop), `--chunk` images per call;
    - ours: `JanusEngine.sample` (static cache, compiled decode step with CUDA graphs, per-sample
      seeds, per-token log-probs by one teacher-forced rescoring forward), same chunk size.
    The engine's compile time is reported separately (the warm-up).
(b) One training step at micro-batch 8 (`--micro`): LoRA r=32/alpha=64 on the language model and
    generation head's proj_out, CFG log-probs with gradients (`JanusImagePolicy`), the reference
    log-probs with the adapters off, ppo_clip + 0.04 k3 KL, backward, AdamW. Peak GPU memory
    (weights included) and seconds; with `--grad-ckpt` (or after an out-of-memory error) the
    language model recomputes its activations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for src in ("rl-core", "rl-models", "rl-rollout"):
    sys.path.insert(0, str(REPO / "packages" / src / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from results import RESULTS, append_results, markdown_table  # noqa: E402

from rl_core.kl import compute_kl  # noqa: E402
from rl_core.losses import aggregate, compute_policy_loss  # noqa: E402
from rl_models.janus import (  # noqa: E402
    JanusImagePolicy,
    generate_image_tokens,
    reference_image_token_logprobs,
)
from rl_models.lora import add_lora  # noqa: E402
from rl_rollout.janus import JanusEngine  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(seconds of the warm-up call, median seconds of `repeats` calls after it)."""
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    warm = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return warm, statistics.median(times)


def load(tiny: bool, device: str):
    """(model, processor): the tiny checkpoint, or Janus-Pro-7B's shape with random bf16 weights."""
    from transformers import GenerationConfig, JanusForConditionalGeneration, JanusProcessor

    if tiny:
        from rl_models import tiny as tiny_models
        from rl_models.janus import load_janus

        return load_janus(tiny_models.build("janus"), dtype="float32")
    from rl_models.shapes import build_shape, janus_pro_config

    folder = build_shape("janus", "pro-7b", tempfile.mkdtemp(prefix="janus-pro-7b-"), config_only=True)
    with torch.device(device):
        model = JanusForConditionalGeneration._from_config(janus_pro_config("pro-7b"), dtype=torch.bfloat16)
    model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval(), JanusProcessor.from_pretrained(folder)


def prompts(count: int) -> list[str]:
    lines = (REPO / "examples" / "data" / "ocr" / "train.txt").read_text().splitlines()
    return [line for line in lines if line.strip()][:count]


def reference_rollout(model, processor, texts: list[str], n: int, chunk: int) -> int:
    """transformers' image generate over `texts` x `n`, `chunk` images per call; returns images."""
    per_call = max(1, chunk // n)
    images = 0
    for start in range(0, len(texts), per_call):
        batch = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": t}]}],
                                               add_generation_prompt=True) for t in texts[start:start + per_call]]
        inputs = processor(text=batch, generation_mode="image", return_tensors="pt", padding=True).to(model.device)
        tokens = generate_image_tokens(model, **inputs, do_sample=True, guidance_scale=5.0,
                                       num_return_sequences=n)  # [b * n, N]
        pixels = model.decode_image_tokens(tokens)  # [b * n, H, W, 3]
        images += pixels.shape[0]
    return images


def train_step(model, rollout, micro: int, grad_ckpt: bool) -> dict[str, float]:
    """One LoRA GRPO step on the first `micro` images of `rollout`: seconds and peak GiB."""
    if grad_ckpt:
        model.model.language_model.gradient_checkpointing_enable()
    model.requires_grad_(False)
    peft = add_lora(model, family="janus", r=32, alpha=64)
    policy = JanusImagePolicy(peft).train()
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    batch = rollout.tokens.index(slice(0, micro))
    old = rollout.log_probs[:micro]
    adv = torch.linspace(-1, 1, micro, device=old.device)[:, None].expand_as(old)  # [b, N]
    mask = torch.ones_like(old)

    def step() -> None:
        logp = policy(batch, guidance_scale=rollout.guidance_scale, temperature=rollout.temperature)  # [b, N]
        ref = reference_image_token_logprobs(peft, batch, guidance_scale=rollout.guidance_scale,
                                             temperature=rollout.temperature)
        num = torch.tensor(float(mask.numel()), device=old.device)
        loss, _ = compute_policy_loss("ppo_clip", logp=logp, old_logp=old, advantages=adv, mask=mask, num_valid=num)
        loss = loss + 0.04 * aggregate(compute_kl("k3", logp, ref), mask, "token-mean", num_valid=num)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        warm, seconds = timed(step, 1)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    finally:
        peft.unload()  # drop the adapters again (the model object is reused on a retry)
    return {"seconds": seconds, "first_seconds": warm, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Janus on CPU in seconds; prints only unless --out")
    parser.add_argument("--out", type=Path, default=None, help=f"results file to append to (default {RESULTS})")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="images per prompt")
    parser.add_argument("--chunk", type=int, default=64, help="images per sampling call (KV cache: ~20 GiB per 32 at 7B)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro", type=int, default=8, help="images per training micro-batch")
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the training step")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.n, args.chunk, args.micro, args.repeats = 2, 2, 4, 2, 1
    device = "cpu" if args.tiny else "cuda"
    start = time.perf_counter()
    model, processor = load(args.tiny, device)
    build_s = time.perf_counter() - start
    texts = prompts(args.prompts)
    engine = JanusEngine(model, processor, device=device, max_batch_size=args.chunk, compile=not args.tiny)
    group = [t for t in texts for _ in range(args.n)]  # n copies of each prompt, as a GRPO rollout
    seeds = list(range(len(group)))
    results: dict[str, object] = {}

    def ours() -> None:
        results["rollout"] = engine.sample(group, guidance_scale=5.0, temperature=1.0, seeds=seeds)

    with torch.no_grad():
        ours_warm, ours_s = timed(ours, args.repeats)
        engine.release_cache()
        ref_warm, ref_s = timed(lambda: reference_rollout(model, processor, texts, args.n, args.chunk), args.repeats)
    rollout = results["rollout"]
    images = len(group)
    ckpt, step = args.grad_ckpt, None
    try:
        step = train_step(model, rollout, args.micro, ckpt)
    except torch.OutOfMemoryError:
        print("training step: out of memory without gradient checkpointing; retrying with it")
    if step is None:  # retried outside the except block, so the failed step's tensors are freed
        torch.cuda.empty_cache()
        ckpt, step = True, train_step(model, rollout, args.micro, True)
    header = ["measure", "value"]
    rows = [
        [f"transformers generate(image), images/s ({args.prompts} prompts x {args.n}, {args.chunk} per call)",
         f"{images / ref_s:.2f}"],
        ["JanusEngine.sample (+ per-token log-probs, rescored), images/s", f"{images / ours_s:.2f}"],
        ["engine / generate", f"{ref_s / ours_s:.2f}x"],
        ["engine warm-up s (compile + CUDA graphs) / generate warm-up s", f"{ours_warm:.0f} / {ref_warm:.0f}"],
        [f"training step, micro-batch {args.micro}: peak GPU memory GiB (weights included)", f"{step['peak_gib']:.1f}"],
        ["training step s (LoRA fwd+bwd with CFG rows, reference fwd, AdamW)", f"{step['seconds']:.2f}"],
        ["training step gradient checkpointing", "on" if ckpt else "off"],
        ["model build s", f"{build_s:.0f}"],
    ]
    shape = "tiny Janus (float32, CPU)" if args.tiny else "Janus-Pro-7B shape, random bf16 weights"
    notes = (f"{shape}; 384x384 = 576 tokens per image (tiny: 16), CFG 5, temperature 1; both samplers "
             "VQ-decode their images. LoRA r=32/alpha=64, ppo_clip + 0.04 k3 in the training step. "
             "Ratio measured in the same process, median of the runs after one warm-up.")
    if args.tiny and args.out is None:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results("janus: image-token engine vs transformers generate(image), training step memory (Janus-Pro-7B shape)"
                       if not args.tiny else "janus (tiny, CPU check)", header, rows, notes, path=args.out or RESULTS)


if __name__ == "__main__":
    main()
