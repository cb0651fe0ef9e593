"""`rl-models` command line: build tiny or full-shape random-weight checkpoints."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Tiny offline checkpoints and full-shape random-weight checkpoints.")


@app.command()
def tiny(
    family: str = typer.Argument(help="qwen3, qwen2_5_vl, qwen3_vl, sd3, embedding, clip, ..."),
    out_dir: Path = typer.Argument(help="folder to write the checkpoint into"),
    seed: int = typer.Option(0, help="torch seed of the random init"),
) -> None:
    """Build a tiny random-weight checkpoint with a real tokenizer/processor."""
    from rl_models import tiny as tiny_module

    try:
        path = tiny_module.build(family, out_dir, seed=seed)
    except KeyError as err:
        raise typer.BadParameter(str(err.args[0]), param_hint="FAMILY") from err
    typer.echo(str(path))


@app.command()
def shape(
    family: str = typer.Argument(help="qwen3, qwen3_vl or sd3"),
    size: str = typer.Argument(help="e.g. 4b, 1.7b, 2b, 3.5-medium"),
    out_dir: Path = typer.Argument(help="folder to write the checkpoint into"),
    config_only: bool = typer.Option(False, help="write configs and tokenizer only"),
    dtype: str = typer.Option("bfloat16", help="weight dtype"),
    device: str | None = typer.Option(None, help="init device (default: cuda if available)"),
) -> None:
    """Write a random-weight checkpoint at a published full-size shape."""
    from rl_models.shapes import build_shape

    try:
        path = build_shape(
            family, size, out_dir, config_only=config_only, dtype=dtype, device=device
        )
    except KeyError as err:
        raise typer.BadParameter(str(err.args[0]), param_hint="FAMILY SIZE") from err
    typer.echo(str(path))


if __name__ == "__main__":
    app()
