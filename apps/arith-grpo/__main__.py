"""arith-grpo: text GRPO on "a + b" with an exact-answer rule, the smallest recipe on the shared trainer loop.
`uv run apps/arith-grpo` trains a tiny Qwen3 on CPU in a minute.

This file reads the command line and the config (`arith_config.py`) before torch is imported, so `--help` and config
errors answer at once; the recipe (`arith_recipe.py`) and torch load only to train.
"""

from __future__ import annotations

import sys
from pathlib import Path

from arith_config import DEFAULT_CONFIG, NAME, Config

from rl_core.train import parse_run, run_app


def main(argv: list[str] | None = None) -> Path | None:
    """Run the app; returns the run directory (None after --help)."""
    parsed = parse_run(NAME, Config, DEFAULT_CONFIG, argv=argv)
    if parsed is None:
        return None
    from arith_recipe import RECIPE

    from rl_core.train import train

    return train(RECIPE, *parsed)


if __name__ == "__main__":
    sys.exit(run_app(NAME, main))
