"""The end-of-run summary rider-grm prints: the headline metrics per step and the last train
and val generation with each judge's raw output."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def print_summary(run_dir: Path) -> None:
    """The headline metrics per step and two sample generations with each judge's raw output."""
    with (run_dir / "metrics.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    keys = [k for k in rows[0] if k.endswith(("_mean", "/mean", "parse_failures", "/scored"))
            or (k.startswith("time/") and not k.endswith(("_wake", "_sleep")))]
    table = Table(title=f"rider-grm: {run_dir / 'metrics.csv'}")
    table.add_column("metric")
    for row in rows:
        table.add_column(f"step {row['step']}", justify="right")
    for key in keys:
        table.add_row(key, *[_short(row.get(key, "")) for row in rows])
    console = Console()
    console.print(table)
    for split in ("train", "val"):
        lines = (run_dir / "samples" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        sample = json.loads(lines[-1])
        console.print(f"[bold]{split} step {sample['step']}[/] prompt: {sample['prompt']!r}")
        console.print(f"  completion: {sample['completion'][:200]!r}  reward: {sample['reward']}")
        for name, judge in sample["judges"].items():
            raw = repr(judge["raw"][:120]) if judge["raw"] is not None else (
                "(served: no text returned)" if judge["judged"] else "(gated out: never sent to the judge)")
            console.print(f"  judge {name}: score={judge['score']} raw={raw}")
    console.print(f"run directory: {run_dir}")


def _short(value: str) -> str:
    try:
        return f"{float(value):.4g}"
    except ValueError:
        return value
