"""diffusion-grpo: Flow-GRPO for Stable Diffusion 3 / 3.5 with LoRA and an OCR reward (the VRL
canonical recipe), on the shared trainer loop (`grpo_recipe.py`).

    uv run apps/diffusion-grpo                                       # embedded tiny CPU default
    uv run apps/diffusion-grpo --config examples/diffusion-grpo/vrl.toml        # or flow_grpo.toml
    accelerate launch apps/diffusion-grpo/__main__.py --config FILE  # one process per GPU

This file reads the command line and the config (`grpo_config.py`) before torch is imported, so
`--help` and config errors answer at once; the recipe and torch load only to train.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from grpo_config import DEFAULT_CONFIG, ENV, NAME, Config

from rl_core.train import parse_run, run_app


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_run(NAME, Config, DEFAULT_CONFIG, ENV, argv)
    if parsed is None:
        return None
    from grpo_recipe import RECIPE

    from rl_core.train import train

    return train(RECIPE, *parsed)


def __getattr__(name: str) -> Any:
    """The recipe module's names (`RECIPE`, `grpo_scores`, ...) as this module's, imported on first
    use (the tests load this file as the app)."""
    if name.startswith("__"):  # Python's own probes (`__path__`, ...) must not import torch
        raise AttributeError(name)
    import grpo_recipe

    return getattr(grpo_recipe, name)


if __name__ == "__main__":
    sys.exit(run_app(NAME, main))
