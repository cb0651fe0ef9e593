"""`reward_curve.png`: the training reward per step and the eval reward, from the CSV logs."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["plot_reward_curve"]


def _series(path: Path, key: str) -> list[tuple[float, float]]:
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return [(float(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key) not in (None, "")]


def plot_reward_curve(run_dir: str | os.PathLike[str], *, curves: Sequence[tuple[str, str, str]] = (
        ("metrics.csv", "reward/mean", "train"), ("metrics.csv", "eval/reward/mean", "eval")),
        xlabel: str = "step") -> Path:
    """Plot each `(csv file in run_dir, column, label)` against its `step` column into
    `run_dir/reward_curve.png` (written atomically) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    run_dir = Path(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    for file, key, label in curves:
        points = _series(run_dir / file, key)
        if points:
            ax.plot(*zip(*points, strict=True), "-" if len(points) > 1 else "o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    out = run_dir / "reward_curve.png"
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out
