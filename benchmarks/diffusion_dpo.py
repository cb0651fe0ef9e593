"""Diffusion-DPO steps of diffusion-grpo itself (`train.method = "dpo"`) at full model shape on one
GPU: SD3.5-Medium (512x512 images), Wan 2.1-1.3B and Cosmos-Predict2.5-2B (33 frames at 480x480),
random bf16 weights.

    python benchmarks/diffusion_dpo.py                       # one H100/H200, ~12 minutes
    python benchmarks/diffusion_dpo.py --only cosmos --steps 2   # one family, fewer steps
    python benchmarks/diffusion_dpo.py --smoke               # the tiny SD3 and Wan on the CPU, no RESULTS.md

Each run is the app in a fresh process with `model.path` = the shape (`rl_models.shapes.build_shape`):
3 steps of 8 preference pairs (the lighter and darker copies of examples/data/preference/brightness,
centre-cropped and resized; for the video families, 33-frame GIF pairs written here), 9 of the sampler's 10 noise
levels a pair, LoRA r=32, micro-batches of 2 pairs (4 rows a forward: the chosen and rejected
together), AdamW, no eval. Reported: the last step's seconds split into reading and VAE-encoding
the pairs (`time/rollout`) and the update, pairs per second, the peak CUDA memory, and the first
step's loss (log 2 = 0.6931: the fresh LoRA is the reference, in bf16 too). No peer: Diffusion-DPO's
own code trains SD1.5/SDXL's noise prediction, not a flow model.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
for src in ("rl-core", "rl-models", "rl-rollout"):
    sys.path.insert(0, str(REPO / "packages" / src / "src"))

from benchmarks.results import append_results  # noqa: E402

PAIRS = REPO / "examples" / "data" / "preference" / "brightness"
SHAPES = {"SD3.5-Medium": ("sd3", "3.5-medium"), "Wan 2.1-1.3B": ("wan", "2.1-1.3b"),
          "Cosmos-Predict2.5-2B": ("cosmos", "2.5-2b")}


def video_pairs(out: Path, frames: int) -> Path:
    """8 pairs of `frames`-frame GIFs: each image pair of the brightness set, moved 1 px a frame."""
    from PIL import Image, ImageChops

    rows = []
    for line in (PAIRS / "images.jsonl").read_text().splitlines()[:8]:
        row = json.loads(line)
        for key in ("chosen", "rejected"):
            picture = Image.open(PAIRS / row[key]).convert("RGB")
            clip = [ImageChops.offset(picture, t, 0) for t in range(frames)]
            row[key] = str(out / f"{row['id']:02d}_{key}.gif")
            clip[0].save(row[key], save_all=True, append_images=clip[1:], duration=62, loop=0)
        rows.append(row)
    path = out / "videos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(name: str, path: Path, pairs: Path, out: Path, smoke: bool, steps: int) -> dict[str, float]:
    family = SHAPES[name][0]
    size, frames = (32, 5) if smoke else ((512, 33) if family == "sd3" else (480, 33))
    tokens = {"sd3": 128, "wan": 226, "cosmos": 512}[family] if not smoke else (8 if family == "sd3" else 64)
    overrides = [
        f"model.family={family}", f"model.path={path}", f"model.dtype={'float32' if smoke else 'bfloat16'}",
        "model.lora_rank=32", "model.lora_alpha=64", "model.compile=false", "train.method=dpo",
        f"data.preferences={pairs}", "data.eval_manifest=examples/data/ocr/test.txt",
        "reward.components={brightness=1.0}", f"sampling.resolution={size}", f"sampling.num_frames={frames}",
        "sampling.num_steps=10", f"sampling.max_sequence_length={tokens}", "rollout.groups_per_epoch=8",
        "rollout.sample_batch_size=8", "train.micro_batch_size=2", "train.gradient_accumulation_steps=4",
        "train.lr=1e-4", "dpo.beta=500", f"train.epochs={steps}", "train.eval_freq=0", "train.save_freq=1000",
        f"train.output_dir={out}", "train.run_name=dpo"]
    done = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), *overrides],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"diffusion-grpo {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with (out / "dpo" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/step")]
    last = rows[-1]
    peaks = [float(v) for k, v in last.items() if k.startswith("memory/") and v]
    return {"step": float(last["time/step"]), "encode": float(last["time/rollout"]),
            "update": float(last["time/update"]), "peak": max(peaks, default=float("nan")),
            "first_loss": float(rows[0]["loss/total"]), "margins": [float(r["dpo/margin"]) for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny SD3 and Wan on the CPU, no RESULTS.md")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/dpo_shapes"), help="build the shapes here once")
    parser.add_argument("--only", choices=[f for f, _ in SHAPES.values()], action="append", help="these families")
    parser.add_argument("--steps", type=int, default=3, help="DPO steps a run (the last is reported)")
    args = parser.parse_args()
    start = time.perf_counter()
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        clips = Path(tmp) / "clips"
        clips.mkdir()
        for name, (family, size) in SHAPES.items():
            if args.only and family not in args.only:
                continue
            if args.smoke:
                from rl_models import tiny

                path = tiny.build(family)
            else:
                from rl_models.shapes import build_shape

                path = args.model_dir / family
                if not (path / "model_index.json").exists():
                    build_shape(family, size, path, dtype="bfloat16", device="cuda")
            pairs = PAIRS / "images.jsonl" if family == "sd3" else video_pairs(clips, 5 if args.smoke else 33)
            figures[name] = run(name, path, pairs, Path(tmp) / family, args.smoke, args.steps)
            print(name, figures[name], f"[{time.perf_counter() - start:.0f} s]", flush=True)
    header = ["model (shape)", "pictures", "s/step", "encode s", "update s", "pairs/s", "peak GiB", "first loss"]
    rows = [[name, "512x512 images" if SHAPES[name][0] == "sd3" else "33 frames at 480x480",
             f"{f['step']:.2f}", f"{f['encode']:.2f}", f"{f['update']:.2f}", f"{8 / f['step']:.2f}", f"{f['peak']:.1f}",
             f"{f['first_loss']:.4f}"] for name, f in figures.items()]
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    notes = (f"{device}: diffusion-grpo with train.method=dpo at full shape, random bf16 weights, eager "
             "(benchmarks/diffusion_dpo.py's docstring lists the run): 8 pairs a step, 9 noise levels a pair, micro-batches "
             f"of 2 pairs (4 rows a forward), LoRA r=32; step {args.steps} of {args.steps} reported. "
             "First loss: log 2 = 0.6931 expected "
             "(the fresh LoRA is the reference). Margins per step: "
             + "; ".join(f"{n} {', '.join(f'{m:.2e}' for m in f['margins'])}" for n, f in figures.items()))
    if args.smoke:
        print(header, *rows, notes, sep="\n")
    else:
        append_results(f"Diffusion-DPO steps at {' and '.join(figures)} shape (one GPU)", header, rows, notes)


if __name__ == "__main__":
    main()
