"""Tiny random-weight checkpoints from `rl_models.tiny` (built offline) and no network."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
