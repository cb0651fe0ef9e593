"""diffusion-grpo: Flow-GRPO for SD3 / 3.5 and Janus-Pro with LoRA and an OCR reward (the VRL
canonical recipe) on the shared trainer loop (`grpo_recipe.py`); `uv run apps/diffusion-grpo`
runs the embedded tiny CPU default, `accelerate launch apps/diffusion-grpo/__main__.py` one
process per GPU."""

from grpo_config import ENTRY

ENTRY.attach(__name__)
