"""arith-grpo: text GRPO on "a + b" (`arith_recipe.py`); `uv run apps/arith-grpo` trains on CPU in two minutes."""

from arith_config import ENTRY

ENTRY.attach(__name__)
