"""`rl-rewards score`: score a JSONL file of samples offline with a reward spec.

Input: one `Sample` per line (`{"completion": ..., "prompt": ..., "reference": ..., "metadata": {...}}`).
Output: one `ScoreResult` per line, in input order (`{"score", "components", "error"}`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rl_rewards.composition import Reward, build_reward
from rl_rewards.samples import Sample, ScoreResult

_decoder = msgspec.json.Decoder(Sample)
_encoder = msgspec.json.Encoder()


def read_samples(path: Path) -> list[Sample]:
    """Decode every line of a JSONL file into a Sample; a bad line names the file and line."""
    samples = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                samples.append(_decoder.decode(line))
            except msgspec.DecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a sample ({e})") from None
    return samples


def score_file(reward: Reward, samples: Sequence[Sample], output: Path, batch_size: int, console: Console) -> list[ScoreResult]:
    """Score in batches with a progress bar, writing each batch's results as it finishes."""
    results: list[ScoreResult] = []
    columns = (TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with output.open("wb") as out, Progress(*columns, console=console) as progress:
        task = progress.add_task("score", total=len(samples))
        for start in range(0, len(samples), batch_size):
            batch = reward.score(samples[start : start + batch_size])
            for result in batch:
                out.write(_encoder.encode(result) + b"\n")
            results.extend(batch)
            progress.advance(task, len(batch))
    return results


def summary_table(results: Sequence[ScoreResult]) -> Table:
    """Mean/std (population) per component and of the total, over the samples that have it."""
    table = Table(title=f"{len(results)} samples, {sum(r.error is not None for r in results)} errors")
    for column in ("value", "n", "mean", "std"):
        table.add_column(column, justify="left" if column == "value" else "right")
    series = {"score": [r.score for r in results if r.score is not None]}
    for r in results:
        for key, value in r.components.items():
            series.setdefault(key, []).append(value)
    for key, values in series.items():
        if values:
            mean = math.fsum(values) / len(values)
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            table.add_row(key, str(len(values)), f"{mean:.4f}", f"{std:.4f}")
        else:
            table.add_row(key, "0", "-", "-")
    return table


def score_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="Reward spec (TOML).", exists=True, dir_okay=False)],
    input: Annotated[Path, typer.Argument(help="Samples, one JSON object per line.", exists=True, dir_okay=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Results, one JSON object per line.")],
    batch_size: Annotated[int, typer.Option(min=1, help="Samples per scorer call.")] = 64,
) -> None:
    """Score a JSONL file of samples offline and print a per-component summary."""
    console = Console(stderr=True)
    try:
        samples = read_samples(input)
        reward = build_reward(config)
    except (ValueError, KeyError, TypeError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")  # the message is text, not markup
        raise typer.Exit(code=2) from None
    results = score_file(reward, samples, output, batch_size, console)
    console.print(summary_table(results))
    console.print(f"wrote {len(results)} results to {output}")
