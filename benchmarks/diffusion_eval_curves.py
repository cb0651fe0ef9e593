"""Held-out reward curves of diffusion-grpo's three updates on the tiny SD3 (CPU): Flow-GRPO (the
embedded default), DiffusionNFT and Diffusion-DPO, each a config choice of the same app, each run
in its own process, several seeds.

    uv run --package diffusion-grpo python benchmarks/diffusion_eval_curves.py      # CPU, ~6 minutes
    ... --seeds 0 1 2 --png docs/diffusion_eval_curves.png --no-append

One measure fits all three: the eval's brightness (8 held-out OCR prompts, fixed seeds, the EMA
weights, the ODE in 8 steps), every 2 epochs. A training step's own reward does not: DPO samples
no training image (its step is 8 preference pairs of examples/data/preference/brightness, the
lighter picture preferred), and NFT's come from its old policy. Flow-GRPO and NFT run 12 epochs of
32 sampled images (NFT: lr 0.1, the ODE sampler without CFG, one optimizer step an epoch, as
test_learning.py); DPO runs its tiny preset (apps/diffusion-grpo/configs/dpo_tiny.toml: 24 steps,
lr 0.1, beta 10). Reported per method: the eval brightness before the first step and after the
last (mean over seeds, and each).
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

APP = REPO / "apps" / "diffusion-grpo"
METHODS: dict[str, list[str]] = {
    "Flow-GRPO": ["train.epochs=12"],
    "DiffusionNFT": ["train.epochs=12", "train.method=nft", "sampling.kind=ode", "sampling.guidance_scale=1",
                     "train.lr=0.1", "train.gradient_accumulation_steps=4"],  # one optimizer step an epoch
    "Diffusion-DPO": ["--config", str(APP / "configs" / "dpo_tiny.toml")],
}


def run(out: Path, name: str, seed: int, overrides: list[str]) -> tuple[list[int], list[float]]:
    """One run in a fresh process: the steps it evaluated at and its eval reward there."""
    done = subprocess.run([sys.executable, str(APP), *overrides, f"train.output_dir={out}", f"train.run_name={name}",
                           f"train.seed={seed}", "train.eval_freq=2", "train.save_freq=1000"],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"diffusion-grpo {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with (out / name / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("eval/reward/mean")]
    return [int(r["step"]) for r in rows], [float(r["eval/reward/mean"]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "diffusion_eval_curves.png")
    parser.add_argument("--no-append", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args()
    curves: dict[str, tuple[list[int], list[list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method, overrides in METHODS.items():
            runs = [run(Path(tmp), f"{method}-s{seed}", seed, overrides) for seed in args.seeds]
            curves[method] = (runs[0][0], [r for _, r in runs])
            print(f"{method}: " + "; ".join(f"{r[0]:.4f} -> {r[-1]:.4f}" for _, r in runs), flush=True)
    plot(curves, args.png, args.seeds)
    header = ["method", "eval brightness before -> after (mean of seeds)", "per seed", "steps"]
    rows = [[m, f"{statistics.fmean(r[0] for r in rs):.4f} -> {statistics.fmean(r[-1] for r in rs):.4f}",
             " / ".join(f"{r[0]:.4f} -> {r[-1]:.4f}" for r in rs), str(steps[-1])] for m, (steps, rs) in curves.items()]
    png = args.png.relative_to(REPO) if args.png.is_relative_to(REPO) else args.png
    notes = (f"diffusion-grpo on the tiny random SD3, CPU, seeds {args.seeds}: the eval's brightness (8 held-out prompts, "
             "fixed seeds, EMA weights) every 2 steps; Flow-GRPO and DiffusionNFT sample 32 images a step, "
             f"Diffusion-DPO trains 8 preference pairs a step and samples none (benchmarks/diffusion_eval_curves.py). "
             f"Curves (mean over seeds): {png}.")
    if args.no_append:
        print(header, *rows, notes, sep="\n")
    else:
        append_results("Flow-GRPO, DiffusionNFT and Diffusion-DPO on the tiny SD3: held-out reward (CPU)", header,
                       rows, notes)


def plot(curves: dict[str, tuple[list[int], list[list[float]]]], png: Path, seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=120)
    for method, (steps, runs) in curves.items():
        ax.plot(steps, [statistics.fmean(v) for v in zip(*runs, strict=True)], marker="o", markersize=3, label=method)
    ax.set_xlabel("step (Flow-GRPO, NFT: 32 sampled images; DPO: 8 pairs)")
    ax.set_ylabel(f"eval brightness (mean of seeds {seeds})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle("diffusion-grpo, tiny SD3 on CPU: held-out reward per update")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


if __name__ == "__main__":
    main()
