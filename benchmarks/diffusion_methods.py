"""Diffusion RL methods side by side on the task diffusion-grpo learns on a CPU: reward against
images and against seconds for Flow-GRPO, Flow-GRPO-Fast, MixGRPO's sliding window and
DiffusionNFT.

    uv run --package diffusion-grpo python benchmarks/diffusion_methods.py       # CPU, ~6 minutes
    ... --seeds 0 1 --epochs 12 --png docs/diffusion_methods.png --no-append

The app's embedded default (tiny random SD3, 32x32 images, 4 sampling steps, the images' mean
brightness as the reward, 4 groups x 8 images per epoch, lr 0.05, clip 0.2, no KL), each method
as a config choice of the same app, each run in its own process. Every method samples the same
images per epoch, so reward against epoch is reward against images; seconds are the cumulative
`time/step` of the run (sampling, reward and update; not the evals, which are off). Scaled to 4
sampling steps, Flow-GRPO trains every stochastic step; Fast 1 step at a random place in the first
half ([0, 2), upstream 2 of 10 in [0, 5)); MixGRPO a window of 1 sliding by 1 step every 3 epochs
over [0, 3) (upstream 4 of 25, every 25 iterations); DiffusionNFT its own forward-process loss.
Reported per method: the rise (mean train reward of the last 3 epochs minus the first 3, mean over
seeds) and the seconds per epoch. The tiny model's brightness moves little in absolute terms (see
apps/diffusion-grpo/tests/test_learning.py): compare the rises with each other.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import append_results  # noqa: E402

EDGE = 3  # epochs averaged at each end for the rise

METHODS: dict[str, list[str]] = {
    "Flow-GRPO": [],
    "Flow-GRPO-Fast": ["sampling.sde_window_mode=random", "sampling.sde_window_size=1", "sampling.sde_window_range=[0,2]"],
    "MixGRPO window": ["sampling.sde_window_mode=sliding", "sampling.sde_window_size=1",
                       "sampling.sde_window_range=[0,3]", "sampling.shift_interval=3", "sampling.window_stride=1"],
}
NFT = "DiffusionNFT"
NFT_TINY: list[str] = []  # DiffusionNFT's own settings on the tiny task, beside train.method=nft


def nft_overrides() -> list[str] | None:
    """DiffusionNFT's settings for the tiny task, where the app has it (None before)."""
    help_text = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), "--help"],
                               capture_output=True, text=True).stdout
    return ["train.method=nft", *NFT_TINY] if "train.method" in help_text and "nft" in help_text else None


def run(out: Path, name: str, seed: int, epochs: int, overrides: list[str]) -> tuple[list[float], list[float]]:
    """One diffusion-grpo run in a fresh process: its train reward and step seconds per epoch."""
    done = subprocess.run([sys.executable, str(REPO / "apps" / "diffusion-grpo"), f"train.output_dir={out}",
                           f"train.run_name={name}", f"train.epochs={epochs}", f"train.seed={seed}", "eval.every=0",
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
    args = parser.parse_args()
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
    notes = (f"diffusion-grpo's embedded default (tiny random SD3, brightness reward, 32 images per epoch, lr 0.05), "
             f"{args.epochs} epochs, seeds {args.seeds}, CPU; each method a config choice of the app (the overrides "
             f"are in benchmarks/diffusion_methods.py). Curves (mean over seeds): {png}. "
             + ("DiffusionNFT not in the app yet: not run." if nft is None else ""))
    if args.no_append:
        print(header, *rows, notes, sep="\n")
    else:
        append_results("Diffusion RL methods on the tiny SD3 brightness task (CPU)", header, rows, notes)


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
