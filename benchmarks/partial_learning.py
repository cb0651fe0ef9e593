"""What partial rollouts cost in learning: arith-grpo synchronous against partial rollouts with
`train.max_staleness` 0, 1 and 2.

    uv run --package arith-grpo python benchmarks/partial_learning.py      # CPU, 6 seeds, ~12 minutes

arith-grpo's embedded default with 3-token answers (`rollout.max_new_tokens=3`: the reward reads
the first number), `algo.rollout_correction=token_truncate` everywhere, each run in its own
process, two at a time. Partial rollouts: `train.partial_rollouts.steps=1` and one token a round,
so a group drawn at a step finishes at that step or the next, with the next weights: most trained
samples hold tokens of two versions. Every schedule trains the same number of groups a step, so
reward against step is reward against samples. Reported: the mean train reward of the last 10
steps (mean over seeds), its ratio to the synchronous run's, and the curves (docs/partial_learning.png).
Goal (issue: asynchronous training that pays): within 5% of synchronous.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.async_learning import run  # noqa: E402
from benchmarks.results import append_results  # noqa: E402

LAST = 10  # steps averaged for the final reward
COMMON = ["rollout.max_new_tokens=3", "algo.rollout_correction=token_truncate", "train.eval_freq=0"]
PARTIAL = ["train.partial_rollouts.steps=1", "train.partial_rollouts.chunk_tokens=1"]
SCHEDULES = {
    "synchronous": [],
    "partial, max_staleness=0": PARTIAL,
    "partial, max_staleness=1": [*PARTIAL, "train.max_staleness=1"],
    "partial, max_staleness=2": [*PARTIAL, "train.max_staleness=2"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "partial_learning.png")
    parser.add_argument("--no-append", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = {(label, seed): pool.submit(run, Path(tmp), f"{i}-s{seed}", seed, args.steps, [*COMMON, *overrides],
                                              {**os.environ, "OMP_NUM_THREADS": "1"})
                   for i, (label, overrides) in enumerate(SCHEDULES.items()) for seed in args.seeds}
        curves = {label: [futures[(label, seed)].result() for seed in args.seeds] for label in SCHEDULES}
    final = {label: statistics.fmean(statistics.fmean(c[-LAST:]) for c in runs) for label, runs in curves.items()}
    base = final["synchronous"]
    plot({label: [statistics.fmean(s) for s in zip(*runs, strict=True)] for label, runs in curves.items()}, args.png,
         args.seeds)
    header = ["schedule", f"final reward (last {LAST} steps)", "per seed", "vs synchronous"]
    rows = [[label, f"{final[label]:.4f}", " / ".join(f"{statistics.fmean(c[-LAST:]):.3f}" for c in runs),
             f"{final[label] / base:.2f}"] for label, runs in curves.items()]
    notes = (f"`benchmarks/partial_learning.py`: arith-grpo's embedded default with rollout.max_new_tokens=3, "
             f"{args.steps} steps, seeds {args.seeds}, algo.rollout_correction=token_truncate everywhere; partial: "
             "train.partial_rollouts.steps=1, chunk_tokens=1. Final reward = mean train reward of the last "
             f"{LAST} steps, mean over seeds. Curves: {args.png.relative_to(REPO) if args.png.is_relative_to(REPO) else args.png}. "
             "Goal: within 5% of synchronous.")
    if args.no_append:
        print(header, *rows, notes, sep="\n")
    else:
        append_results("What partial rollouts cost in learning: arith-grpo, 3-token answers (CPU)", header, rows, notes)


def plot(curves: dict[str, list[float]], png: Path, seeds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for label, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, linewidth=1.2, label=label)
    ax.set_xlabel("step (the same groups per step in every schedule)")
    ax.set_ylabel(f"train reward (mean of {len(seeds)} seeds)")
    ax.set_title("arith-grpo: synchronous vs partial rollouts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


if __name__ == "__main__":
    main()
