from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from rl_models import tiny


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every test session builds its tiny checkpoints afresh in a private cache."""
    root = tmp_path_factory.mktemp("rl-models-cache")
    previous = os.environ.get("RL_MODELS_CACHE")
    os.environ["RL_MODELS_CACHE"] = str(root)
    yield root
    if previous is None:
        os.environ.pop("RL_MODELS_CACHE")
    else:
        os.environ["RL_MODELS_CACHE"] = previous


@pytest.fixture(scope="session")
def qwen3_path(_tiny_cache):
    return tiny.build("qwen3")


@pytest.fixture(scope="session")
def embedding_path(_tiny_cache):
    return tiny.build("embedding")


@pytest.fixture(scope="session")
def clip_path(_tiny_cache):
    return tiny.build("clip")


@pytest.fixture(scope="session")
def vl_paths(_tiny_cache):
    return {family: tiny.build(family) for family in ("qwen2_5_vl", "qwen3_vl")}


@pytest.fixture(scope="session")
def sd3_path(_tiny_cache):
    return tiny.build("sd3")


@pytest.fixture(scope="session")
def janus_path(_tiny_cache):
    return tiny.build("janus")


@pytest.fixture(scope="session")
def wan_path(_tiny_cache):
    return tiny.build("wan")


@pytest.fixture(scope="session")
def cosmos_path(_tiny_cache):
    return tiny.build("cosmos")


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
