"""caption-rl: CapRL++ caption RL on the shared trainer loop (`caption_recipe.py`); `uv run
apps/caption-rl` runs the embedded tiny default (README.md next to this file)."""

from caption_config import ENTRY

ENTRY.attach(__name__)
