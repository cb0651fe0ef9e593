"""Load the recipe (`__main__.py`) and its helpers as importable modules; offline, one thread."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

APP = Path(__file__).resolve().parents[1]
REPO = APP.parents[1]
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(APP))


def _load_app():
    spec = importlib.util.spec_from_file_location("rider_grm_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rider_grm_app"] = module
    spec.loader.exec_module(module)
    return module


app = _load_app()


# Two judges on vLLM engines of their own (opt-in `vllm` tests). tiny:qwen3_vllm: tiny checkpoints with
# 64-wide heads, which vLLM's attention kernels take (it hangs on tiny:qwen3's 8-wide ones); enforce_eager:
# they start in seconds instead of compiling and capturing CUDA graphs
VLLM_OPTIONS = '{gpu_memory_utilization = 0.15, enforce_eager = true, dtype = "bfloat16", max_model_len = 2048}'
VLLM_JUDGES = (
    f'[{{name = "score", module = "{REPO}/examples/rider-grm/reward_function/rating_judge.py", model = "tiny:qwen3_vllm:1", '
    f'weight = 0.3, combine = "add", max_new_tokens = 4, fallback = 0.25, engine = "vllm", engine_options = {VLLM_OPTIONS}}}, '
    f'{{name = "consistency", module = "{REPO}/examples/rider-grm/reward_function/no_contradiction_judge.py", '
    f'model = "tiny:qwen3_vllm:2", weight = 0.5, combine = "mul", max_new_tokens = 4, fallback = 0.5, engine = "vllm", '
    f'engine_options = {VLLM_OPTIONS}}}]'
)


def tiny_overrides(out: Path, **extra: object) -> list[str]:
    """The embedded default, smaller still (CPU tests), writing under `out`: 3 steps of 2 prompts x
    2 replies at lr 1e-3, the rider example's format rule (the default's learnable letter rule and
    lr 3e-2 are for a curve that moves in 16 steps) and the similarity term at weight 1."""
    base = {
        "train.output_dir": f'"{out}"', "rollout.max_new_tokens": "8",
        "rollout.n": "2", "train.batch_size": "2", "train.mini_batch_size": "2", "train.micro_batch_size": "4",
        "train.lr": "1e-3", "train.epochs": "1", "train.max_steps": "3", "train.save_freq": "2",
        "train.val_before_train": "false",
        "reward.rule": '"rider_rules:compute_score"', "reward.embedding.weight": "1.0",
    }
    base |= {k: str(v) for k, v in extra.items()}
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(autouse=True)
def _chdir_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)


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


def read_metrics(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return list(csv.DictReader(f))
