"""What staleness costs in learning: arith-grpo synchronous vs `train.max_staleness` 1 and 2.

    uv run --package arith-grpo python benchmarks/async_learning.py      # CPU, ~5 minutes
    ... --steps 300 --seeds 0 1 2 --png docs/async_learning.png

The app's embedded default (tiny Qwen3, "a + b" with an exact-answer rule, a format bonus and
credit for near misses; its `configs/default.toml`), `algo.rollout_correction=token_truncate` for every schedule, each run in its own
process. Every schedule sees the same number of samples per step, so reward against step is
reward against samples. Reported per schedule: the mean reward of the last 5 steps (mean over
seeds) and its ratio to the synchronous run's; the curves (mean over seeds) go to a PNG.
Goal (issue 31): staleness 1 and 2 within 10% of the synchronous final reward.
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

LAST = 5  # steps averaged for the final reward


def run(out: Path, name: str, seed: int, steps: int, overrides: list[str], env: dict[str, str] | None = None) -> list[float]:
    """One arith-grpo run in a fresh process with `overrides`; its train reward per step."""
    done = subprocess.run([sys.executable, str(REPO / "apps" / "arith-grpo"), f"train.output_dir={out}",
                           f"train.run_name={name}", f"train.max_steps={steps}", f"train.seed={seed}", *overrides],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"arith-grpo {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with (out / name / "metrics.csv").open() as f:
        return [float(r["reward/mean"]) for r in csv.DictReader(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "async_learning.png")
    parser.add_argument("--no-append", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args()
    curves: dict[int, list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.staleness:
            schedule = [f"train.max_staleness={n}", "algo.rollout_correction=token_truncate", "train.eval_freq=0"]
            curves[n] = [run(Path(tmp), f"n{n}-s{seed}", seed, args.steps, schedule) for seed in args.seeds]
            print(f"max_staleness={n}: " + "; ".join(" ".join(f"{r:.3f}" for r in c) for c in curves[n]), flush=True)
    mean_curve = {n: [statistics.fmean(step) for step in zip(*runs, strict=True)] for n, runs in curves.items()}
    final = {n: statistics.fmean(statistics.fmean(c[-LAST:]) for c in runs) for n, runs in curves.items()}
    base = final[min(final)]
    plot(mean_curve, args.png, args.seeds)
    header = ["schedule", "final reward (last 5 steps)", "per seed", "vs synchronous"]
    rows = [[f"max_staleness={n}", f"{final[n]:.4f}",
             " / ".join(f"{statistics.fmean(c[-LAST:]):.4f}" for c in curves[n]), f"{final[n] / base:.2f}"]
            for n in curves]
    notes = (f"arith-grpo's embedded default (tiny Qwen3, sums of digits 0-4, near misses graded; its "
             f"configs/default.toml), {args.steps} steps, seeds {args.seeds}, algo.rollout_correction=token_truncate "
             f"everywhere; final reward = mean train reward of the last {LAST} steps, mean over seeds. Curves (mean "
             f"over seeds): {args.png.relative_to(REPO) if args.png.is_relative_to(REPO) else args.png}. Goal: "
             "staleness 1 and 2 within 10% of synchronous.")
    if args.no_append:
        print(header, *rows, notes, sep="\n")
    else:
        append_results("What staleness costs in learning: arith-grpo, max_staleness 0 / 1 / 2 (CPU)", header, rows,
                       notes)


def plot(curves: dict[int, list[float]], png: Path, seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for n, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, marker="o", markersize=3,
                label="synchronous" if n == 0 else f"max_staleness={n}")
    ax.set_xlabel("step (same samples per step in every schedule)")
    ax.set_ylabel(f"train reward (mean of seeds {seeds})")
    ax.set_title("arith-grpo: sync vs async rollouts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


if __name__ == "__main__":
    main()
