"""FP8 rollouts at SD3.5-Medium shape: `DiffusionEngine(precision="fp8")` against the compiled plain
diffusers pipeline (the peer) and the compiled bf16 engine, the log-prob gap per step, and where
the forward's time goes (a kernel profile of one CFG forward, bf16 vs FP8).

    PYTHONPATH=packages/rl-core/src:packages/rl-models/src:packages/rl-rollout/src \
        python benchmarks/fp8_rollout.py           # one H100/H200, ~5 minutes with compiling
    python benchmarks/fp8_rollout.py --smoke       # tiny SD3 on the CPU (FP8 emulated), no RESULTS.md
    python benchmarks/fp8_rollout.py --train 20    # diffusion-grpo itself, FP8 + TIS, 20 epochs: the gap per epoch

Model, prompts and timing as benchmarks/diffusion_grpo.py's part (a): SD3.5-Medium's transformer
and VAE with random weights at full shape in bf16, embeddings given (encoders outside the
timings), 512x512, 10 SDE steps, CFG 4.5, `--rounds` batches of n=8 per timed call, median of
`--repeats` after a warm-up. Every row compiles the transformer blocks (torch.compile,
fullgraph, one graph per block, the engine's regional compile; the peer runs the same compiled
blocks). FP8: each linear layer of the blocks as a row-scaled e4m3 `torch._scaled_mm` (weights
quantized once, activations per token at each call; `rl_rollout.fp8`).

Columns: images/s, the ratio to the compiled plain pipeline, the transformer's TFLOP/s (its bf16
FLOPs per image x images/s) against the dense bf16 peak, and against the compiled bf16 engine on
the same seeds: max |image diff| and the log-prob gap an FP8 rollout brings to training (the
mean and max |bf16 replay - FP8 rollout| per SDE step: the ratio's offset before any update).
The profile sums CUDA kernel time of one compiled CFG forward (n=8) by kind: GEMMs (cuBLAS /
CUTLASS / scaled_mm), attention (flash / cuDNN / efficient SDPA), and inductor's fused Triton
kernels (norms, modulation, GELU, and with FP8 the activations' max and cast).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from diffusion_grpo import (  # noqa: E402
    add_lora,
    bf16_peak,
    build_pipeline_dir,
    compile_warmup,
    forward_flops,
    replay_updates,
    seconds,
    timed,
)
from results import append_results, kernel_times, markdown_table  # noqa: E402

from rl_rollout.diffusion import DiffusionEngine, SampleBatch  # noqa: E402

# first match wins: inductor's fused kernels are named after every op they hold (`triton_..._scaled_mm_...`)
KINDS = (("Triton (fused elementwise, norms, FP8 casts)", ("triton",)),
         ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
         ("GEMM", ("gemm", "xmma", "cutlass", "scaled_mm", "nvjet", "matmul", "sm90")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def profile_forward(engine: DiffusionEngine, conditioning, n: int, size: int, top: int = 0) -> dict[str, float]:
    """CUDA milliseconds by kernel kind of one CFG forward of n images (compiled, warmed up), in
    the engine's sampling precision; `top` > 0 prints the longest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    latents = engine.initial_noise(n, size, size, [torch.Generator().manual_seed(i) for i in range(n)])
    sigma = torch.full((n,), 0.5, device=engine.device)  # [n]
    cond = conditioning.index([0] * n)
    with torch.no_grad(), engine._sampling_precision(getattr(engine.transformer, engine.blocks_attribute)):
        for _ in range(2):
            engine.velocity(latents, sigma, cond, guidance_scale=4.5)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.velocity(latents, sigma, cond, guidance_scale=4.5)
            torch.cuda.synchronize()
    times, _ = kernel_times(prof, kernel_kind, top)
    times["total"] = sum(times.values())
    return dict(times)


def step_gaps(engine: DiffusionEngine, fp8_trajs: list) -> tuple[list[float], list[float]]:
    """Per SDE step: mean and max |log-prob of the bf16 replay - the FP8 rollout's| over the first
    batch (the replay runs in the weights' dtype, as the trainer's does)."""
    traj, means, peaks = fp8_trajs[0], [], []
    with torch.no_grad():
        for step in range(traj.num_steps):
            gap = (engine.replay(traj, step).log_prob - traj.log_probs[:, step]).abs()  # [n]
            means.append(float(gap.mean()))
            peaks.append(float(gap.max()))
    return means, peaks


def epoch(engine: DiffusionEngine, conditioning, args, reference, *, precision: str,
          window: tuple[int, int] | None) -> dict[str, float]:
    """One Flow-GRPO epoch (`args.groups` x 8 images, brightness reward, GRPO advantages, 2
    optimizer steps of ppo_clip + 0.04 flow KL through the LoRA; diffusion_grpo.py's part (b)),
    sampled in `precision`. `window`: Flow-GRPO-Fast's SDE window, the only trained steps (None:
    every step SDE, the first 9 trained). FP8 adds the trainer's rescore of the trained steps (no
    gradient, bf16: diffusion-grpo's `rollout.precision = "fp8"`), whose log-probs are the old ones."""
    from rl_core.advantages import compute_advantages

    engine.precision = precision
    optimizer = torch.optim.AdamW([p for p in engine.transformer.parameters() if p.requires_grad], lr=3e-4)
    phases: dict[str, float] = {}
    n, steps = 8, 10
    trained = list(range(*window)) if window else list(range(int(steps * 0.99)))

    def phase(name: str, fn):
        elapsed, out = seconds(fn)
        phases[name] = elapsed
        return out

    trajs = phase("rollout", lambda: [engine.sample(
        ["p"] * n, conditioning=conditioning.index([0] * n), num_steps=steps, guidance_scale=4.5, height=args.size,
        width=args.size, seeds=[g * n + i for i in range(n)], sde_window=window) for g in range(args.groups)])
    engine.precision = "bf16"
    rewards = torch.cat([t.images.float().mean(dim=(1, 2, 3)).cpu() for t in trajs])  # [N]
    adv = compute_advantages("grpo", rewards=rewards, mask=torch.ones(len(rewards), 1),
                             group_ids=torch.arange(len(rewards)) // n, scale="batch", eps=1e-4, clip=5.0)[:, 0]
    if precision == "fp8":
        def rescore() -> list:
            out = []
            with torch.no_grad():
                for traj in trajs:
                    logp = traj.log_probs.clone()
                    for rows in torch.arange(n).split(args.micro):
                        for k in trained:
                            logp[rows, k] = engine.replay(traj, k, rows=rows).log_prob
                    out.append(dataclasses.replace(traj, log_probs=logp))
            return out
        trajs = phase("rescore", rescore)
    worst = phase("train", lambda: replay_updates(engine, trajs, adv, micro=args.micro, train_steps=trained,
                                                 reference=reference, optimizer=optimizer))
    phases["first_replay"] = float(worst)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny SD3 on the CPU, FP8 emulated, no RESULTS.md")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="batches of n=8 per timed call")
    parser.add_argument("--train", type=int, default=0, metavar="EPOCHS",
                        help="instead: run diffusion-grpo at this shape, rollout.precision=fp8 with TIS, for EPOCHS epochs")
    parser.add_argument("--profile", action="store_true", help="only the kernel profile, with the longest kernels by name")
    parser.add_argument("--epochs", action="store_true",
                        help="instead of the rollout rows: one Flow-GRPO and one Flow-GRPO-Fast epoch in each precision")
    args = parser.parse_args()
    args.groups, args.micro, args.n, args.steps = (2 if args.smoke else 8), 8, 8, 10
    n, steps = args.n, args.steps
    size = args.size = 32 if args.smoke else 512
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {what}", flush=True)

    if args.train:
        return train_run(args, progress)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_pipeline_dir(args.smoke, Path(tmp))
        engine = DiffusionEngine.from_pretrained(path, dtype=dtype, device=device, compile=False)
    conditioning = engine.encode(["a storefront sign that reads \"OPEN\""], max_sequence_length=128)
    negative = engine.negative(conditioning.embeds.shape[1])
    flops = forward_flops(engine, conditioning, n, size) * steps / n  # bf16 FLOPs per image (counted eagerly)
    engine.compile = True
    peak = bf16_peak()
    batches = [SampleBatch(["p"] * n, conditioning=conditioning.index([0] * n), seeds=list(range(r * n, (r + 1) * n)))
               for r in range(args.rounds)]
    plain_inputs = dict(prompt_embeds=conditioning.embeds.expand(n, -1, -1),
                        pooled_prompt_embeds=conditioning.pooled.expand(n, -1),
                        negative_prompt_embeds=negative.embeds.expand(n, -1, -1),
                        negative_pooled_prompt_embeds=negative.pooled.expand(n, -1),
                        num_inference_steps=steps, guidance_scale=4.5, height=size, width=size, output_type="pt")

    def plain() -> object:
        return [engine.pipeline(**plain_inputs) for _ in range(args.rounds)]

    def ours() -> list:
        return engine.sample_many(batches, num_steps=steps, guidance_scale=4.5, height=size, width=size)

    if args.epochs:
        return epochs(engine, conditioning, args, progress)
    if args.profile:
        for precision in ("bf16", "fp8"):
            engine.precision = precision
            print(precision, profile_forward(engine, conditioning, n, size, top=25))
        return None
    seconds_by, first_by, samples = {}, {}, {}
    rows_spec = [("plain pipeline, compiled blocks (PEER)", "bf16", False, plain),
                 ("engine compiled, bf16", "bf16", False, ours),
                 ("engine compiled, precision=fp8", "fp8", False, ours)]
    if not args.smoke:
        rows_spec += [("engine compiled + cuda_graphs, bf16", "bf16", True, ours),
                      ("engine compiled + cuda_graphs, precision=fp8", "fp8", True, ours)]
    with torch.no_grad():
        engine._sync_compiled()  # the plain pipeline shares the transformer: the same compiled blocks
        for label, precision, graphs, fn in rows_spec:
            progress(f"{label} (compiling on the first call)")
            engine.precision, engine.cuda_graphs = precision, graphs
            first_by[label], _ = seconds(fn)
            seconds_by[label], out = timed(fn, args.repeats)
            if fn is ours:
                samples[label] = out
        engine.precision, engine.cuda_graphs = "bf16", False
    progress("log-prob gap: bf16 replay of the FP8 rollout")
    gap_mean, gap_max = step_gaps(engine, samples["engine compiled, precision=fp8"])
    reference = samples["engine compiled, bf16"]
    peer = seconds_by["plain pipeline, compiled blocks (PEER)"]
    images = args.rounds * n
    table = []
    for label, _, _, fn in rows_spec:
        rate = images / seconds_by[label]
        tflops = flops * rate / 1e12
        diff = ""
        if fn is ours:
            diff = f"{max(float((a.images - b.images).abs().max()) for a, b in zip(samples[label], reference, strict=True)):.3g}"
        table.append([label, f"{rate:.2f}", f"{peer / seconds_by[label]:.2f}x", f"{tflops:.3g}",
                      f"{100 * tflops * 1e12 / peak:.0f}%" if peak == peak else "n/a", f"{first_by[label]:.1f}", diff])
    header = ["rollout (n=8 per batch, compiled blocks)", "images/s", "vs compiled plain (peer)", "transformer TFLOP/s (bf16 count)",
              "of bf16 peak", "first call s", "max |image diff| vs bf16 engine"]
    gaps = ", ".join(f"{m:.2g}/{x:.2g}" for m, x in zip(gap_mean, gap_max, strict=True))
    fp8_bytes = engine._fp8.nbytes() if engine._fp8 is not None else 0
    model = "tiny SD3" if args.smoke else "SD3.5-Medium transformer + VAE at full shape, random weights"
    notes = [f"{model}, {dtype}; embeddings given. {size}x{size}, "
             f"{steps} SDE steps, CFG 4.5, {args.rounds} batches of n={n} per timed call (median of {args.repeats} after "
             f"a warm-up). Transformer FLOPs per image {flops / 1e12:.3g} TFLOP (bf16 count; FP8 GEMMs have 2x the "
             "dense peak). FP8 log-prob gap per SDE step, mean/max |bf16 replay - FP8 rollout| over 8 images "
             f"(per-element-mean log-probs, as Flow-GRPO's; its clip is 1e-4): {gaps}. FP8 weight copy: "
             f"{fp8_bytes / 2**30:.2f} GiB."]
    profile_rows = []
    if torch.cuda.is_available():
        progress("kernel profile of one CFG forward, bf16 and FP8")
        engine.precision = "bf16"
        bf16 = profile_forward(engine, conditioning, n, size)
        engine.precision = "fp8"
        fp8 = profile_forward(engine, conditioning, n, size)
        engine.precision = "bf16"
        for kind in [k for k, _ in KINDS] + ["other", "total"]:
            a, b = bf16.get(kind, 0.0), fp8.get(kind, 0.0)
            profile_rows.append([kind, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x" if b else ""])
    if args.smoke:
        print(markdown_table(header, table))
        print(notes[0])
    else:
        append_results("FP8 rollouts vs the compiled plain pipeline (SD3.5-M shape)", header, table, notes[0])
        if profile_rows:
            append_results("FP8 rollouts: CUDA kernel time of one compiled CFG forward by kind (SD3.5-M shape, n=8)",
                           ["kernels", "bf16 ms", "fp8 ms", "bf16 / fp8"], profile_rows,
                           "torch.profiler over one warmed-up forward; kinds by kernel name.")
    progress("done")


def train_run(args, progress) -> None:
    """diffusion-grpo's own loop (`python apps/diffusion-grpo`, one process) on the shape's
    pipeline: FP8 rollouts with TIS, the brightness reward, Flow-GRPO's update (lr 3e-4, clip
    1e-4, KL 0.04), 2 prompts x 4 images an epoch; the per-epoch gap, TIS weights and reward."""
    import csv
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        path = build_pipeline_dir(args.smoke, Path(tmp))
        out = Path(tmp) / "run"
        overrides = [f"model.path={path}", f"model.dtype={'float32' if args.smoke else 'bfloat16'}",
                     f"sampling.resolution={args.size}", "sampling.num_steps=10", "sampling.max_sequence_length=32",
                     "rollout.precision=fp8", "algo.rollout_correction=token_truncate", "rollout.n=4",
                     "rollout.groups_per_epoch=2", "rollout.sample_batch_size=4", "train.micro_batch_size=4",
                     "train.gradient_accumulation_steps=1", "train.lr=3e-4", "train.clip_range=1e-4",
                     "algo.kl_coef=0.04", f"train.epochs={args.train}", "train.eval_freq=0", "train.save_freq=1000",
                     f"train.output_dir={out}"]
        progress(f"diffusion-grpo, {args.train} epochs: " + " ".join(overrides[2:]))
        subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), *overrides], check=True)
        [metrics] = out.glob("run-*/metrics.csv")
        with metrics.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    keys = ("replay/engine_diff_mean", "replay/engine_diff_max", "replay/engine_kl", "policy/is_ratio_mean",
            "policy/clip_fraction", "reward/mean", "time/step")
    table = [[r["step"], *(f"{float(r[k]):.3g}" if r.get(k) else "" for k in keys)] for r in rows]
    header = ["epoch", *keys]
    model = "tiny SD3 (CPU, FP8 emulated)" if args.smoke else "SD3.5-Medium shape, random weights, bf16, an H200"
    notes = (f"python apps/diffusion-grpo with {' '.join(overrides[2:-1])}: {model}, {args.size}x{args.size}, the "
             "embedded default's OCR prompts and brightness reward. The gap is the FP8 rollout's log-probs against the "
             "trainer's bf16 rescore of every trained step, before the epoch's first optimizer step.")
    if args.smoke:
        print(markdown_table(header, table))
        print(notes)
    else:
        append_results(f"FP8 rollouts in diffusion-grpo: {args.train} epochs with TIS, the gap per epoch "
                       "(SD3.5-M shape)", header, table, notes)


def epochs(engine: DiffusionEngine, conditioning, args, progress) -> None:
    """Flow-GRPO (all 10 steps SDE, 9 trained) and Flow-GRPO-Fast (an SDE window of 2 at steps
    [2, 4)) epochs, bf16 then FP8 each, after a compile warm-up of both precisions' graphs."""
    lora_kind, reference = add_lora(engine.transformer, r=32, alpha=64)
    engine.compile = True
    progress("compiling the LoRA graphs (bf16 and FP8 sampling, replay, reference)")
    warm = compile_warmup(engine, conditioning, args, reference)
    engine.precision = "fp8"
    warm += compile_warmup(engine, conditioning, args, reference)
    engine.precision = "bf16"
    rows = []
    for name, window in (("Flow-GRPO", None), ("Flow-GRPO-Fast", (2, 4))):
        results = {}
        for precision in ("bf16", "fp8"):
            progress(f"{name} epoch, {precision}")
            results[precision] = epoch(engine, conditioning, args, reference, precision=precision, window=window)
        for precision, phases in results.items():
            total = phases["rollout"] + phases.get("rescore", 0.0) + phases["train"]
            bf16 = results["bf16"]
            rows.append([f"{name}, {precision}", f"{phases['rollout']:.1f}", f"{phases.get('rescore', 0.0):.1f}",
                         f"{phases['train']:.1f}", f"{total:.1f}",
                         f"{(bf16['rollout'] + bf16['train']) / total:.2f}x", f"{phases['first_replay']:.2g}"])
    header = [f"epoch ({args.groups * 8} images)", "rollout s", "rescore s", "train s", "total s", "bf16 total / this",
              "first replay max |log ratio|"]
    model = "tiny SD3, float32" if args.smoke else "SD3.5-Medium shape, bf16 weights"
    notes = (f"{model}, LoRA {lora_kind} r=32; {args.size}x{args.size}, 10 steps, CFG 4.5, {args.groups} groups of 8, "
             f"micro-batch 8, 2 optimizer steps; compiled blocks (warm-up {warm:.0f} s, outside the epochs). FP8: "
             "the rollout in FP8, then the trained steps rescored in bf16 without gradient (the old log-probs), "
             "then the same update; the first replay is checked against the rescore.")
    if args.smoke:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results("FP8 rollouts: one Flow-GRPO and Flow-GRPO-Fast epoch, bf16 vs FP8 (SD3.5-M shape)",
                       header, rows, notes)


if __name__ == "__main__":
    main()
