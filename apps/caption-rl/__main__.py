"""caption-rl: CapRL++ caption RL, a recipe on the shared trainer loop (`caption_recipe.py`).

`uv run apps/caption-rl` runs the embedded tiny default; see README.md next to this file. This
file reads the command line and the config (`caption_config.py`) before torch is imported, so
`--help` and config errors answer at once; the recipe and torch load only to train.
"""

from __future__ import annotations

from caption_config import ENV, NAME, Config, default_config

from rl_core.train.entry import AppEntry

entry = AppEntry(NAME, Config, default_config, ENV, recipe="caption_recipe")
main, __getattr__ = entry.main, entry.module_getattr

if __name__ == "__main__":
    entry.exit()
