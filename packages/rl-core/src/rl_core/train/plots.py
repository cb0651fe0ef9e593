"""`reward_curve.png`: one figure per run, drawn from its `metrics.csv` after every step.

Panels, each drawn when the run logged any of its metrics (names from the metric table):
reward (`reward/mean`, every `reward/<component>` but scorers' sub-components,
`eval/reward/mean` as points), KL
(`loss/kl`, `policy/approx_kl`), entropy (`policy/entropy`), response length
(`response/length_mean`) and loss (`loss/policy`, `loss/total`). Outside the reward panel, a
metric that is 0 at every step is a quantity switched off (`loss/kl` without a KL term) and is
not drawn; a reward component at 0 throughout is drawn (nothing was learnt on it). The figure is
titled with the run's name; steps are integers.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PANELS", "plot_panels", "plot_reward_curve"]

# (panel title, metric names or a `prefix*` family): the metric table's names
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "reward/*", "eval/reward/mean")),
    ("KL", ("loss/kl", "policy/approx_kl")),
    ("entropy", ("policy/entropy",)),
    ("response length (tokens)", ("response/length_mean",)),
    ("loss", ("loss/policy", "loss/total")),
)
# reward/* columns that are counts or spreads, not reward values
_NOT_A_REWARD = {"reward/std", "reward/failed", "reward/zero_std_group_fraction"}


def _read(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]


def _columns(rows: list[dict[str, str]], names: Sequence[str], *, hide_zero: bool = False) -> list[str]:
    """The logged columns a panel shows, in the panel's order (`prefix*` expands to a family)."""
    found: list[str] = []
    columns = list(rows[0]) if rows else []
    for name in names:
        matches = ([c for c in columns if c.startswith(name[:-1]) and c not in _NOT_A_REWARD and c.count("/") == 1
                    and "." not in c]  # a component, not a scorer's sub-component (`length.n_tokens`: a count)
                   if name.endswith("*") else [name] if name in columns else [])
        found += [m for m in matches if m not in found and not (hide_zero and _always_zero(rows, m))]
    return found


def _always_zero(rows: list[dict[str, str]], column: str) -> bool:
    """Logged only as 0: a quantity that is off (`loss/kl` with no KL term), not a flat curve."""
    values = [float(r[column]) for r in rows if r.get(column) not in (None, "")]
    return bool(values) and all(v == 0 for v in values)


def plot_panels(rows: list[dict[str, str]]) -> list[tuple[str, list[str]]]:
    """The panels a run's metrics.csv rows fill: `(title, columns)`, empty panels left out."""
    return [(name, cols) for name, keys in PANELS if (cols := _columns(rows, keys, hide_zero=name != "reward"))]


def plot_reward_curve(run_dir: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Draw `run_dir/reward_curve.png` (written atomically) from `run_dir/metrics.csv`; returns
    its path. `title` defaults to the run directory's name."""
    from matplotlib.figure import Figure  # no pyplot: no backend, no global figure registry
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    rows = _read(run_dir / "metrics.csv")
    panels = plot_panels(rows) or [("reward", [])]
    fig = Figure(figsize=(7, 2.4 * len(panels) + 0.6))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)
    for ax, (name, cols) in zip(axes[:, 0], panels, strict=True):
        for col in cols:
            points = _series(rows, col)
            if points:
                eval_points = col.startswith("eval/")
                ax.plot(*zip(*points, strict=True), "o" if eval_points or len(points) == 1 else "-", label=col)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or run_dir.name)
    fig.tight_layout()
    out = run_dir / "reward_curve.png"
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, out)
    return out
