"""Cosmos-Predict2.5-2B shape: CosmosEngine's SDE rollout vs the plain diffusers pipeline, and
DiffusionNFT epochs of diffusion-grpo itself (the `cosmos_nft` preset at this shape).

    python benchmarks/cosmos_nft.py --part rollout --cache /tmp/cb --model-dir /tmp/cosmos2b   # (a)
    python benchmarks/cosmos_nft.py --part epoch --cache /tmp/cb --model-dir /tmp/cosmos2b     # (b), the section
    python benchmarks/cosmos_nft.py --smoke          # tiny:cosmos on the CPU, no RESULTS.md

Model: Cosmos-Predict2.5-2B's transformer (28 blocks, 2048 wide) and Wan 2.1's VAE at full shape
with random bf16 weights (`rl_models.shapes.build_shape("cosmos", "2.5-2b")`); the text encoder
is the tiny Qwen2.5-VL, so the transformer's cross-attention projection takes 128 inputs, not the
real 100,352 (0.25% of a forward's FLOPs). Default shape: 33 frames (9 latent frames) at 480x480
(the app's frames are square), 10 steps.

(a) As `benchmarks/wan_flow_grpo.py`'s (a): the plain `Cosmos2_5_PredictBasePipeline(...)` call
    (embeddings and the engine's initial noise given, output_type "pt") eager and with its blocks
    compiled as the engine compiles them (the PEER), against `CosmosEngine.sample` (SDE on every
    step, log-probs kept) eager and compiled; n = 8 videos of one prompt a call, CFG on both (the
    pipeline: two forwards of n rows a step; the engine: one of 2n). diffusers' Cosmos writes CFG
    `cond + w (cond - uncond)`; the scale does not change the cost.
(b) `apps/diffusion-grpo --config examples/diffusion-grpo/cosmos_nft.toml` with `model.path` =
    the shape: 8 videos an epoch (2 prompts x 4), CFG-free ODE sampling, 9 noise levels a video,
    LoRA r=32, brightness of every frame as the reward (in process), micro-batches of 2 videos,
    2 optimizer steps, no eval; 2 epochs in a fresh process, the second reported (`time/*` and
    the largest `memory/*_peak_gib` of metrics.csv).

Needs torch, diffusers, transformers, peft, accelerate (+ the workspace sources on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for src in ("rl-core", "rl-models", "rl-rollout"):
    sys.path.insert(0, str(REPO / "packages" / src / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from results import append_results, cached_figures, load_figures, markdown_table, save_figures  # noqa: E402
from wan_flow_grpo import PROMPTS, rollout, rollout_table, variant_labels  # noqa: E402

LABELS = variant_labels("Cosmos2_5_PredictBasePipeline")


def build_engine(args, progress):
    from rl_rollout.cosmos import CosmosEngine

    if args.smoke:
        from rl_models import tiny

        path = tiny.build("cosmos")
    else:
        from rl_models.shapes import build_shape

        path = Path(args.model_dir)
        if not (path / "model_index.json").exists():
            progress(f"building the Cosmos-Predict2.5-2B shape in {path}")
            build_shape("cosmos", "2.5-2b", path, dtype="bfloat16", device="cuda")
    dtype, device = (torch.float32, "cpu") if args.smoke else (torch.bfloat16, "cuda")
    return path, CosmosEngine.from_pretrained(path, dtype=dtype, device=device, num_frames=args.frames, compile=False)


def app_epochs(args, path: Path, out: Path, compiled: bool) -> dict[str, float]:
    """Two DiffusionNFT epochs of diffusion-grpo in a fresh process: the second's phase seconds and peak."""
    overrides = [f"model.compile={str(compiled).lower()}", f"model.path={path}", f"model.dtype={'float32' if args.smoke else 'bfloat16'}",
                 "data.manifest=examples/data/ocr/train.txt", "data.eval_manifest=examples/data/ocr/test.txt",
                 "reward.components={brightness=1.0}", f"sampling.resolution={args.height}",
                 f"sampling.num_frames={args.frames}", f"sampling.num_steps={args.steps}",
                 f"sampling.max_sequence_length={64 if args.smoke else 512}",
                 "rollout.n=4", "rollout.groups_per_epoch=2", "rollout.sample_batch_size=4",
                 f"train.micro_batch_size={args.micro}", f"train.gradient_accumulation_steps={4 // args.micro}",
                 "train.epochs=2", "train.eval_freq=0", "train.save_freq=1000", f"train.output_dir={out}",
                 "train.run_name=nft"]
    done = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), "--config",
                           str(REPO / "examples" / "diffusion-grpo" / "cosmos_nft.toml"), *overrides],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"diffusion-grpo failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with (out / "nft" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/step")]
    last = rows[-1]
    peaks = [float(v) for k, v in last.items() if k.startswith("memory/") and v]
    return {"epochs": [float(r["time/step"]) for r in rows], "epoch": float(last["time/step"]),
            "sampling": float(last["time/rollout"]), "training": float(last["time/update"]),
            "peak": max(peaks, default=float("nan")), "rewards": [float(r["reward/mean"]) for r in rows],
            "grad_norm": float(last["grad_norm"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny:cosmos on the CPU, no RESULTS.md")
    parser.add_argument("--part", choices=("all", "rollout", "epoch"), default="all")
    parser.add_argument("--cache", type=Path, default=None, help="keep figures here between commands")
    parser.add_argument("--model-dir", default="/tmp/cosmos_predict2_5_2b", help="build the checkpoint here once")
    parser.add_argument("--frames", type=int, default=None, help="4k + 1 (default 33; smoke 5)")
    parser.add_argument("--height", type=int, default=None, help="square frames: default 480 (smoke 32)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="timed rollout calls after the first (median)")
    parser.add_argument("--micro", type=int, default=2, help="videos per NFT micro-batch (divides 4)")
    parser.add_argument("--compiled", action="store_true",
                        help="(b) also with model.compile=true (the eager epochs kept in --cache are reused)")
    args = parser.parse_args()
    args.n = 8
    args.frames = args.frames or (5 if args.smoke else 33)
    args.height = args.height or (32 if args.smoke else 480)
    args.width = args.height
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {what}", flush=True)

    cache = cached_figures(args.cache, "cosmos_nft")
    figures = load_figures(cache) or {}
    shape = [args.frames, args.height, args.steps]
    if figures.get("shape", shape) != shape:
        raise SystemExit(f"{cache} holds figures of another shape ({figures['shape']}); remove it or match it")
    figures["shape"] = shape
    path, engine = build_engine(args, progress)
    progress(f"engine loaded ({type(engine.pipeline.scheduler).__name__}, {engine.dtype})")
    if args.part in ("all", "rollout"):
        conditioning = engine.encode(list(PROMPTS), max_sequence_length=64 if args.smoke else 512)
        rollout(engine, conditioning, args, figures, cache, progress, LABELS)
    if args.part == "rollout":
        progress("(a) done" + (f"; figures kept in {cache}" if cache else ""))
        return
    if "rollout" not in figures or len(figures["rollout"]) < 4:
        raise SystemExit("(b) writes the section with (a)'s figures: run --part rollout first with the same --cache")
    del engine
    torch.cuda.empty_cache()
    for key, compiled in (("epoch", False), ("epoch_compiled", True))[: 2 if args.compiled else 1]:
        if key not in figures:
            progress(f"(b) two NFT epochs of diffusion-grpo, {key}")
            figures[key] = app_epochs(args, path, Path(args.model_dir).parent / f"cosmos_nft_{key}", compiled)
            save_figures(cache, figures)
    figures["wall_s"] = time.perf_counter() - start
    save_figures(cache, figures)
    progress("(b) done")

    epochs = [figures[k] for k in ("epoch", "epoch_compiled") if k in figures]
    latent = (args.frames - 1) // 4 + 1
    tokens = latent * (args.height // 16) * (args.width // 16)
    header = [f"rollout ({args.n} videos of one prompt a call, embeds given)", "videos/s", "vs compiled plain (peer)",
              "vs eager plain", "transformer TFLOP/s", "of bf16 peak", "first call s", "timed calls s", "peak GPU GiB"]
    rows = rollout_table(figures, args.n, LABELS)
    def row(label: str, value) -> list[str]:
        return [label, *(value(x) for x in epochs)]

    e_rows = [row("epoch s (the second of 2)", lambda x: f"{x['epoch']:.1f}"),
              row("sampling s (8 videos, CFG-free ODE)", lambda x: f"{x['sampling']:.1f}"),
              row("training s (8 videos x 9 noise levels, old and reference forwards, 2 AdamW steps)",
                  lambda x: f"{x['training']:.1f}"),
              row("other s (reward, advantages, EMA, logging)", lambda x: f"{x['epoch'] - x['sampling'] - x['training']:.1f}"),
              row("peak GPU memory GiB", lambda x: f"{x['peak']:.1f}"),
              row("seconds per epoch", lambda x: ", ".join(f"{t:.1f}" for t in x["epochs"])),
              row("train reward per epoch", lambda x: ", ".join(f"{r:.4f}" for r in x["rewards"])),
              row("grad_norm of the last step", lambda x: f"{x['grad_norm']:.3g}"),
              ["benchmark wall s (this command: load to end)", f"{figures['wall_s']:.0f}"]]
    model = "tiny:cosmos, float32, CPU" if args.smoke else (
        "Cosmos-Predict2.5-2B transformer (1.96B here, 2.06B published: the cross-attention projection takes the tiny "
        "encoder's 128-wide states, not 100,352) + Wan 2.1 VAE at full shape, random weights, bf16 "
        "(`rl_models.shapes.build_shape(\"cosmos\", \"2.5-2b\")`)")
    notes = (
        f"{model}. "
        f"{args.frames} frames ({latent} latent frames) at {args.height}x{args.width}: {tokens} tokens a video; {args.steps} steps. "
        f"(a) each variant alone, n={args.n} videos of one prompt a call with CFG: the first call (compiling, for the "
        f"compiled variants), then {args.repeats} timed call(s); plain = `Cosmos2_5_PredictBasePipeline(prompt_embeds=..., "
        "negative_prompt_embeds=..., latents=<the engine's noise>, output_type=\"pt\")` (UniPC steps, CFG as two forwards "
        "of n rows, decode included); engine = `CosmosEngine.sample` (SDE steps with log-probs, CFG as one forward of 2n "
        "rows, decode included); compiled = the transformer blocks through torch.compile(fullgraph=True, dynamic=False) on "
        f"the transformer both share; TFLOP/s from torch.utils.flop_counter ({figures['flops_per_video'] / 1e12:.3g} TFLOP "
        "a video); bf16 peak 989 TFLOP/s dense. (b) diffusion-grpo's own run of the cosmos_nft preset at this shape "
        "(benchmarks/cosmos_nft.py's docstring lists the overrides), eager, and with model.compile=true where the "
        "table has that column, "
        f"micro-batches of {args.micro} videos.\n\n"
        + markdown_table(["DiffusionNFT epoch (b)", "eager", "model.compile=true"][: 1 + len(epochs)], e_rows))
    if args.smoke:
        print(markdown_table(header, rows))
        print(notes)
    else:
        append_results(f"Cosmos-Predict2.5-2B shape: CosmosEngine vs the plain compiled pipeline, DiffusionNFT epochs "
                       f"of diffusion-grpo ({args.frames} frames {args.height}x{args.width}, one GPU)", header, rows, notes)


if __name__ == "__main__":
    main()
