"""arith-grpo: text GRPO on "a + b" with an exact-answer rule, the smallest recipe on the shared trainer loop.
`uv run apps/arith-grpo` trains a tiny Qwen3 on CPU in a minute.

The command line and the config are read before the recipe and torch load.
"""

from __future__ import annotations

from arith_config import DEFAULT_CONFIG, NAME, Config

from rl_core.train.entry import AppEntry

entry = AppEntry(NAME, Config, DEFAULT_CONFIG, None, recipe="arith_recipe")
main, __getattr__ = entry.main, entry.module_getattr

if __name__ == "__main__":
    entry.exit()
