"""Diffusion RL methods side by side: on the task diffusion-grpo learns on a CPU (reward against
images and against seconds for Flow-GRPO, Flow-GRPO-Fast, MixGRPO's sliding window and
DiffusionNFT), and on one GPU at SD3.5-Medium shape (seconds per epoch and peak memory of each
method at the same images per epoch, GRPO-Guard and CFG-free Flow-GRPO included).

    uv run --package diffusion-grpo python benchmarks/diffusion_methods.py       # CPU, ~6 minutes
    ... --seeds 0 1 --epochs 12 --png docs/diffusion_methods.png --no-append
    python benchmarks/diffusion_methods.py --shape sd3.5-medium   # one H100/H200, ~10 minutes
    uv run --package diffusion-grpo python benchmarks/diffusion_methods.py --smoke   # the GPU table's path, CPU

The app's embedded default (tiny random SD3, 32x32 images, 4 sampling steps, the images' mean
brightness as the reward, 4 groups x 8 images per epoch, lr 0.05, clip 0.2, no KL), each method
as a config choice of the same app, each run in its own process. Every method samples the same
images per epoch, so reward against epoch is reward against images; seconds are the cumulative
`time/step` of the run (sampling, reward and update; not the evals, which are off). Scaled to 4
sampling steps, Flow-GRPO trains every stochastic step; Fast 1 step at a random place in the first
half ([0, 2), upstream 2 of 10 in [0, 5)); MixGRPO a window of 1 sliding by 1 step every 3 epochs
over [0, 3) (upstream 4 of 25, every 25 iterations); DiffusionNFT (`train.method=nft`) its own
forward-process loss on images its old policy sampled by the ODE without CFG, at beta 1 and lr 0.1,
one optimizer step an epoch (upstream takes one or two over hundreds of images).
Reported per method: the rise (mean train reward of the last 3 epochs minus the first 3, mean over
seeds) and the seconds per epoch. The tiny model's brightness moves little in absolute terms (see
apps/diffusion-grpo/tests/test_learning.py): compare the rises with each other.

`--shape sd3.5-medium` (`timings`): SD3.5-Medium's transformer and VAE at full shape with random
bf16 weights (`benchmarks/diffusion_grpo.py`'s `build_pipeline_dir`, written once and loaded by
every run), the app on one GPU with `model.compile=true` as on CUDA, each method from its preset
file with the same epoch: 8 prompts x 8 images, 512x512, 10 steps, sampled in batches of 8,
replayed in micro-batches of 8, two optimizer steps, the brightness reward in process, no eval.
Each method runs 2 epochs in its own process (the first compiles) and the second is reported:
seconds per epoch split into sampling (`time/rollout`), training (`time/update`) and the rest
(reward, advantages), the peak CUDA memory of the epoch's phases, and the ratios to Flow-GRPO's
epoch against the issue's goals (Fast and the window >= 3x fewer seconds than Flow-GRPO;
DiffusionNFT's epoch no slower than Fast's). `--smoke` runs the same code on the tiny SD3 on CPU
(2 prompts x 4 images, 32x32, float32, not compiled: inductor on 2 CPU cores would take minutes
per method) and prints the table without appending it.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import (  # noqa: E402
    append_results,
    cached_figures,
    load_figures,
    markdown_table,
    save_figures,
)

EDGE = 3  # epochs averaged at each end for the rise

METHODS: dict[str, list[str]] = {
    "Flow-GRPO": [],
    "Flow-GRPO-Fast": ["sampling.sde_window_mode=random", "sampling.sde_window_size=1", "sampling.sde_window_range=[0,2]"],
    "MixGRPO window": ["sampling.sde_window_mode=sliding", "sampling.sde_window_size=1",
                       "sampling.sde_window_range=[0,3]", "sampling.shift_interval=3", "sampling.window_stride=1"],
}
NFT = "DiffusionNFT"
# DiffusionNFT's settings on the tiny task (apps/diffusion-grpo/tests/test_learning.py): the old
# policy samples by the ODE without CFG (upstream's way), beta 1 (upstream's OCR 0.1 stays flat on the
# tiny model), lr 0.1 (0.05 for the others, the default's)
NFT_TINY = ["sampling.kind=ode", "sampling.guidance_scale=1", "train.lr=0.1", "train.gradient_accumulation_steps=4"]


def nft_overrides() -> list[str] | None:
    """DiffusionNFT's settings for the tiny task, where the app has it (None before)."""
    help_text = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), "--help"],
                               capture_output=True, text=True).stdout
    return ["train.method=nft", *NFT_TINY] if "train.method" in help_text else None


def run(out: Path, name: str, seed: int, epochs: int, overrides: list[str]) -> tuple[list[float], list[float]]:
    """One diffusion-grpo run in a fresh process: its train reward and step seconds per epoch."""
    done = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), f"train.output_dir={out}",
                           f"train.run_name={name}", f"train.epochs={epochs}", f"train.seed={seed}", "train.eval_freq=0",
                           f"train.save_freq={epochs}", *overrides], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"diffusion-grpo {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with (out / name / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("reward/mean")]
    return [float(r["reward/mean"]) for r in rows], [float(r["time/step"]) for r in rows]


def rise(curve: list[float]) -> float:
    return statistics.fmean(curve[-EDGE:]) - statistics.fmean(curve[:EDGE])


def per_epoch(seconds: list[float]) -> float:
    """Seconds per epoch after the first (which also builds and warms the engine)."""
    return statistics.fmean(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "diffusion_methods.png")
    parser.add_argument("--no-append", action="store_true", help="print the table, leave RESULTS.md alone")
    parser.add_argument("--shape", choices=["tiny", "sd3.5-medium"], default="tiny",
                        help="tiny: the CPU reward curves; sd3.5-medium: seconds and memory per method on one GPU")
    parser.add_argument("--smoke", action="store_true", help="the sd3.5-medium table's code on the tiny SD3, CPU")
    parser.add_argument("--cache", type=Path, default=None,
                        help="keep each method's figures in DIR/<method>.json and reuse them: split the GPU table "
                             "over several commands on one machine (each command under its time limit)")
    parser.add_argument("--methods", nargs="+", choices=list(GPU_METHODS), default=list(GPU_METHODS),
                        help="sd3.5-medium/--smoke: the methods to time (Flow-GRPO is always run: the ratios' base)")
    args = parser.parse_args()
    if args.smoke or args.shape != "tiny":
        timings(args)
    else:
        curves(args)


def curves(args: argparse.Namespace) -> None:
    """The tiny CPU task: reward curves per method, a plot and a table."""
    methods = dict(METHODS)
    nft = nft_overrides()
    if nft is not None:
        methods[NFT] = nft
    rewards: dict[str, list[list[float]]] = {}
    seconds: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in methods.items():
            runs = [run(Path(tmp), f"{name.replace(' ', '_')}-s{seed}", seed, args.epochs, overrides)
                    for seed in args.seeds]
            rewards[name], seconds[name] = [r for r, _ in runs], [s for _, s in runs]
            print(f"{name}: rise " + " ".join(f"{rise(c):+.4f}" for c in rewards[name]) + "; s/epoch "
                  + " ".join(f"{per_epoch(s):.2f}" for s in seconds[name]), flush=True)
    mean_reward = {m: [statistics.fmean(e) for e in zip(*c, strict=True)] for m, c in rewards.items()}
    mean_seconds = {m: [statistics.fmean(e) for e in zip(*c, strict=True)] for m, c in seconds.items()}
    plot(mean_reward, mean_seconds, args.png, args.seeds)
    header = ["method", "reward rise (last 3 - first 3 epochs)", "per seed", "s/epoch after the first",
              "vs Flow-GRPO s/epoch"]
    base = per_epoch(mean_seconds["Flow-GRPO"])
    rows = [[m, f"{statistics.fmean(rise(c) for c in rewards[m]):+.4f}",
             " / ".join(f"{rise(c):+.4f}" for c in rewards[m]), f"{per_epoch(mean_seconds[m]):.2f}",
             f"{per_epoch(mean_seconds[m]) / base:.2f}x"] for m in methods]
    png = args.png.relative_to(REPO) if args.png.is_relative_to(REPO) else args.png
    notes = (f"diffusion-grpo's embedded default (tiny random SD3, brightness reward, 32 images per epoch, lr 0.05; NFT lr 0.1), "
             f"{args.epochs} epochs, seeds {args.seeds}, CPU; each method a config choice of the app (the overrides "
             f"are in benchmarks/diffusion_methods.py). Curves (mean over seeds): {png}. "
             + ("DiffusionNFT not in the app yet: not run." if nft is None else ""))
    if args.no_append:
        print(header, *rows, notes, sep="\n")
    else:
        append_results("Diffusion RL methods on the tiny SD3 brightness task (CPU)", header, rows, notes)


# ----------------------------------------------------------------------- seconds and memory on one GPU

PRESETS = REPO / "examples" / "diffusion-grpo"
# each method from its preset; the epoch's shape is then made equal (EPOCH): only what defines the
# method differs. The window is MixGRPO's rule at its share of the steps (4 of 25 -> 2 of 10).
GPU_METHODS: dict[str, tuple[str, list[str]]] = {
    "Flow-GRPO": ("flow_grpo.toml", []),
    "Flow-GRPO-Fast": ("flow_grpo_fast.toml", []),
    "MixGRPO window": ("flow_grpo.toml", ["sampling.sde_window_mode=sliding", "sampling.sde_window_size=2",
                                          "sampling.shift_interval=25", "sampling.window_stride=1"]),
    "GRPO-Guard": ("flow_grpo.toml", ["train.ratio_norm=true"]),
    "Flow-GRPO CFG-free": ("flow_grpo.toml", ["sampling.guidance_scale=1"]),
    "DiffusionNFT": ("diffusion_nft.toml", []),
}
GOALS = {"Flow-GRPO-Fast": "<= 0.33x Flow-GRPO", "MixGRPO window": "<= 0.33x Flow-GRPO",
         "DiffusionNFT": "<= Flow-GRPO-Fast"}


def epoch_overrides(smoke: bool, pipeline: Path) -> list[str]:
    """The same epoch for every method: 8 prompts x 8 images at 512x512 in 10 steps (smoke: 2 x 4 at
    32x32), batches of 8, two optimizer steps; the brightness reward in process; no eval; 2 epochs."""
    n, groups, size, tokens = (4, 2, 32, 8) if smoke else (8, 8, 512, 128)
    return [f"model.path={pipeline}", f"model.dtype={'float32' if smoke else 'bfloat16'}",
            f"model.compile={'false' if smoke else 'true'}", "data.manifest=examples/data/ocr/train.txt",
            "data.eval_manifest=examples/data/ocr/test.txt", "reward.components={brightness=1.0}",
            f"sampling.resolution={size}", "sampling.num_steps=10", f"sampling.max_sequence_length={tokens}",
            f"rollout.n={n}", f"rollout.groups_per_epoch={groups}", f"rollout.sample_batch_size={n}",
            f"train.micro_batch_size={n}", f"train.gradient_accumulation_steps={groups // 2}",
            "algo.replay_tolerance=0.05",  # compiled bf16 rollout vs replay (the app's model.compile note)
            "train.eval_freq=0", "train.epochs=2", "train.save_freq=1000"]


def time_method(out: Path, name: str, overrides: list[str]) -> dict[str, float]:
    """One method's second epoch in a fresh process: `time/*` and the largest `memory/*_peak_gib`."""
    preset, own = GPU_METHODS[name]
    done = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), "--config", str(PRESETS / preset),
                           *own, *overrides, f"train.output_dir={out}", f"train.run_name={name.replace(' ', '_')}"],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"diffusion-grpo {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with (out / name.replace(" ", "_") / "metrics.csv").open() as f:
        row = [r for r in csv.DictReader(f) if r.get("time/step")][-1]
    peaks = [float(v) for k, v in row.items() if k.startswith("memory/") and v]

    def value(key: str) -> float:
        return float(row[key]) if row.get(key) else 0.0

    return {"epoch": value("time/step"), "sampling": value("time/rollout"), "training": value("time/update"),
            "peak": max(peaks, default=math.nan), "images/s": value("throughput/samples_per_s")}


def timings(args: argparse.Namespace) -> None:
    """Seconds per epoch and peak memory of each method at SD3.5-M shape (or tiny with --smoke)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from diffusion_grpo import build_pipeline_dir

    names = ["Flow-GRPO", *(m for m in args.methods if m != "Flow-GRPO")]
    got: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = build_pipeline_dir(args.smoke, Path(tmp))
        gc.collect()
        torch.cuda.empty_cache()  # the weights were built on the GPU: give it back to the runs
        overrides = epoch_overrides(args.smoke, pipeline)
        for name in names:
            cached = cached_figures(args.cache, name)
            kept = load_figures(cached)
            if kept is not None:
                got[name] = kept
                print(f"{name}: from {cached}", flush=True)
                continue
            got[name] = time_method(Path(tmp) / "runs", name, overrides)
            save_figures(cached, got[name])
            print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got[name].items()), flush=True)
    base, fast = got["Flow-GRPO"]["epoch"], got.get("Flow-GRPO-Fast", {}).get("epoch")
    header = ["method", "s/epoch", "sampling s", "training s", "other s", "peak GiB", "images/s",
              "vs Flow-GRPO s/epoch", "goal"]
    rows = []
    for name in names:
        t = got[name]
        goal = GOALS.get(name, "")
        if goal and not (name == "DiffusionNFT" and fast is None):
            met = t["epoch"] <= (fast if name == "DiffusionNFT" else base / 3)
            goal += f": {'met' if met else 'not met'}"
        rows.append([name, f"{t['epoch']:.1f}", f"{t['sampling']:.1f}", f"{t['training']:.1f}",
                     f"{t['epoch'] - t['sampling'] - t['training']:.1f}", f"{t['peak']:.1f}", f"{t['images/s']:.2f}",
                     f"{t['epoch'] / base:.2f}x", goal])
    images = 8 if args.smoke else 64
    notes = (f"diffusion-grpo on one device, {'the tiny SD3 (smoke, CPU, float32, eager)' if args.smoke else 'SD3.5-Medium transformer + VAE at full shape with random bf16 weights (text encoders with the real widths, one layer), model.compile=true'}; "
             f"each method its preset (examples/diffusion-grpo: flow_grpo.toml; flow_grpo_fast.toml; flow_grpo.toml with "
             f"MixGRPO's sliding window of 2 steps; flow_grpo.toml with train.ratio_norm=true; flow_grpo.toml with "
             f"sampling.guidance_scale=1; diffusion_nft.toml) at the same epoch: {images} images, 10 steps, "
             f"{'32' if args.smoke else '512'} px, batches of {images // (2 if args.smoke else 8)}, two optimizer steps, "
             "brightness reward; the second of 2 epochs, each method in its own process (the first epoch compiles). "
             "sampling = time/rollout, training = time/update, other = reward + advantages; peak = the largest "
             "memory/<phase>_peak_gib of the epoch. Goals (issue 33): Fast and the window >= 3x fewer s/epoch than "
             "Flow-GRPO at equal images; DiffusionNFT's epoch no slower than Fast's.")
    if args.smoke or args.no_append:
        print(markdown_table(header, rows), notes, sep="\n")
    else:
        append_results("Diffusion RL methods: seconds per epoch and peak memory at SD3.5-M shape (one GPU)",
                       header, rows, notes)


def plot(rewards: dict[str, list[float]], seconds: dict[str, list[float]], png: Path, seeds: list[int]) -> None:
    import itertools

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_images, by_seconds) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120, sharey=True)
    for name, curve in rewards.items():
        images = [32 * (e + 1) for e in range(len(curve))]
        by_images.plot(images, curve, marker="o", markersize=3, label=name)
        by_seconds.plot(list(itertools.accumulate(seconds[name])), curve, marker="o", markersize=3, label=name)
    by_images.set_xlabel("images sampled")
    by_seconds.set_xlabel("seconds (sampling, reward, update)")
    by_images.set_ylabel(f"train reward: brightness (mean of seeds {seeds})")
    for ax in (by_images, by_seconds):
        ax.grid(alpha=0.3)
    by_images.legend()
    fig.suptitle("diffusion-grpo, tiny SD3 on CPU: Flow-GRPO and its successors")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


if __name__ == "__main__":
    main()
