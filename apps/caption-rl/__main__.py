"""caption-rl: CapRL++ caption RL, a recipe on the shared trainer loop (`caption_recipe.py`).

`uv run apps/caption-rl` runs the embedded tiny default; see README.md next to this file. This
file reads the command line and the config (`caption_config.py`) before torch is imported, so
`--help` and config errors answer at once; the recipe and torch load only to train.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from caption_config import ENV, NAME, Config, default_config

from rl_core.train import parse_run, run_app


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_run(NAME, Config, default_config(), ENV, argv)
    if parsed is None:
        return None
    from caption_recipe import RECIPE

    from rl_core.train import train

    return train(RECIPE, *parsed)


def __getattr__(name: str) -> Any:
    """The recipe module's names (`RECIPE`, ...) as this module's, imported on first use (the tests
    load this file as the app)."""
    if name.startswith("__"):  # Python's own probes (`__path__`, ...) must not import torch
        raise AttributeError(name)
    import caption_recipe

    return getattr(caption_recipe, name)


if __name__ == "__main__":
    sys.exit(run_app(NAME, main))
