"""Shared test setup for rl-core: offline hub, fixed seeds, a hypothesis profile for 2 CPU cores."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

settings.register_profile("rl-core", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("rl-core")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
