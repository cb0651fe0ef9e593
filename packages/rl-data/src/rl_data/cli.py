"""`rl-data` command line: `convert` any supported source to our JSONL, parquet or manifest."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from rl_data.errors import RecordError
from rl_data.layouts import KINDS, Kind
from rl_data.sources import open_source
from rl_data.writers import RecordWriter

app = typer.Typer(
    help="rl-data: read RL training data from files, save_to_disk directories or the Hub cache.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """rl-data: records in, batches out."""


def _mapping(pairs: list[str]) -> dict[str, str]:
    mapping = {}
    for pair in pairs:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise typer.BadParameter(f"expected FIELD=COLUMN (e.g. reward_model.ground_truth=qa), got {pair!r}")
        mapping[field] = column
    return mapping


@app.command("convert")
def convert_command(
    src: Annotated[str, typer.Argument(help="A .jsonl/.parquet file, an OCR manifest, a save_to_disk directory, or a Hub id in the local cache.")],
    dst: Annotated[Path, typer.Argument(help="Output: .jsonl or .parquet (.txt for --kind ocr).")],
    kind: Annotated[str, typer.Option("--kind", "-k", help=f"Record kind: {', '.join(KINDS)}.")],
    split: Annotated[str | None, typer.Option(help="Split of a DatasetDict or Hub dataset.")] = None,
    map_: Annotated[list[str] | None, typer.Option("--map", "-m", help="FIELD=COLUMN: read our FIELD from the source's COLUMN (dotted; repeatable).")] = None,
    media_root: Annotated[Path | None, typer.Option(help="caption_qa, preference, ocr: directory relative media paths are resolved against.")] = None,
    strict: Annotated[bool, typer.Option(help="Stop at the first bad row instead of skipping and counting it.")] = False,
) -> None:
    """Convert SRC to DST, validating every row; bad rows are skipped and summarized (or, with
    --strict, the first one stops the run naming its split, row and field)."""
    console = Console(stderr=True)
    if kind not in KINDS:
        raise typer.BadParameter(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}", param_hint="--kind")
    record_kind = cast(Kind, kind)
    mapping = _mapping(map_ or [])
    try:
        reader = open_source(src, kind=record_kind, split=split, mapping=mapping or None,
                             media_root=media_root, on_error="raise" if strict else "skip")
        with RecordWriter(dst, record_kind) as writer, Progress(
            SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), console=console,
        ) as progress:
            task = progress.add_task(f"convert {src}", total=reader.rows.num_rows)
            for record in reader:
                writer.write(record)
                progress.update(task, completed=writer.written + reader.skipped)
    except (RecordError, FileNotFoundError, ValueError, ImportError) as exc:
        console.print("[red]error:[/red]", Text(str(exc)), soft_wrap=True)
        raise typer.Exit(code=1) from None
    say = partial(console.print, soft_wrap=True, markup=False, highlight=False)  # paths stay whole
    say(f"wrote {writer.written} records to {dst}; skipped {reader.skipped} bad rows")
    for error in reader.stats.errors:
        say(f"  {error}")
    if reader.skipped > len(reader.stats.errors):
        say(f"  ... and {reader.skipped - len(reader.stats.errors)} more")


if __name__ == "__main__":
    app()
