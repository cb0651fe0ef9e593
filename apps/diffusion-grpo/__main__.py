"""diffusion-grpo: Flow-GRPO for Stable Diffusion 3 / 3.5 with LoRA and an OCR reward (the VRL
canonical recipe), on the shared trainer loop (`grpo_recipe.py`).

    uv run apps/diffusion-grpo                                       # embedded tiny CPU default
    uv run apps/diffusion-grpo --config examples/diffusion-grpo/vrl.toml        # or flow_grpo.toml
    accelerate launch apps/diffusion-grpo/__main__.py --config FILE  # one process per GPU

The command line and the config are read before the recipe and torch load.
"""

from __future__ import annotations

from grpo_config import DEFAULT_CONFIG, ENV, NAME, Config

from rl_core.train.entry import AppEntry

entry = AppEntry(NAME, Config, DEFAULT_CONFIG, ENV, recipe="grpo_recipe")
main, __getattr__ = entry.main, entry.module_getattr

if __name__ == "__main__":
    entry.exit()
