"""arith-grpo: text GRPO on "a + b" with an exact-answer rule, the smallest recipe on the shared
trainer loop (`arith_recipe.py`); `uv run apps/arith-grpo` trains a tiny Qwen3 on CPU in a minute."""

from arith_config import ENTRY

ENTRY.attach(__name__)
