"""rider-grm: VeRL-with-RMs on the shared trainer loop (`rider_recipe.py`) — a text policy trained
with REINFORCE++ (or GRPO/RLOO) on a rule reward plus several generative judges plus an
embedding-similarity reward.

    uv run apps/rider-grm                                    # embedded tiny CPU default
    uv run apps/rider-grm --config examples/rider-grm/verl-with-rms.toml   # the verl-with-rms preset
    accelerate launch apps/rider-grm/__main__.py --config FILE train.batch_size=128
    uv run apps/rider-grm --resume                            # continue the latest run

This file reads the command line and the config (`rider_config.py`) before torch is imported, so
`--help` and config errors answer at once; the recipe and torch load only to train.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rider_config import DEFAULT_CONFIG, ENV, NAME, Config

from rl_core.train import parse_run, run_app


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_run(NAME, Config, DEFAULT_CONFIG, ENV, argv)
    if parsed is None:
        return None
    from rider_recipe import RECIPE

    from rl_core.train import train

    return train(RECIPE, *parsed)


def __getattr__(name: str) -> Any:
    """The recipe module's names (`RECIPE`, ...) as this module's, imported on first use (the tests
    load this file as the app)."""
    if name.startswith("__"):  # Python's own probes (`__path__`, ...) must not import torch
        raise AttributeError(name)
    import rider_recipe

    return getattr(rider_recipe, name)


if __name__ == "__main__":
    sys.exit(run_app(NAME, main))
