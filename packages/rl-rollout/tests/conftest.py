"""Shared fixtures: tiny random-weight checkpoints from `rl_models.tiny` (built offline)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

from rl_models import tiny
from rl_rollout.hf import HFEngine


@pytest.fixture(scope="session")
def qwen3_path() -> Path:
    return tiny.build("qwen3")


@pytest.fixture(scope="session")
def qwen3_engine(qwen3_path: Path) -> HFEngine:
    """A float32 CPU engine shared by read-only tests (never put to sleep or reloaded)."""
    return HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu")


@pytest.fixture()
def fresh_engine(qwen3_path: Path) -> HFEngine:
    """A private engine for tests that mutate weights or state."""
    return HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu")
