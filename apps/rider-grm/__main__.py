"""rider-grm: VeRL-with-RMs on the shared trainer loop (`rider_recipe.py`) — a text policy trained
with REINFORCE++ (or GRPO/RLOO) on a rule reward plus several generative judges plus an
embedding-similarity reward.

    uv run apps/rider-grm                                    # embedded tiny CPU default
    uv run apps/rider-grm --config examples/rider-grm/verl-with-rms.toml   # the verl-with-rms preset
    accelerate launch apps/rider-grm/__main__.py --config FILE train.batch_size=128
    uv run apps/rider-grm --resume                            # continue the latest run

The command line and the config are read before the recipe and torch load.
"""

from __future__ import annotations

from rider_config import DEFAULT_CONFIG, ENV, NAME, Config

from rl_core.train.entry import AppEntry

entry = AppEntry(NAME, Config, DEFAULT_CONFIG, ENV, recipe="rider_recipe")
main, __getattr__ = entry.main, entry.module_getattr

if __name__ == "__main__":
    entry.exit()
