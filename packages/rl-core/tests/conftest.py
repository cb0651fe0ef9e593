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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests (opt-in: `nox -s gpu`) skip with the reason on a machine without CUDA,
    instead of failing there."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
