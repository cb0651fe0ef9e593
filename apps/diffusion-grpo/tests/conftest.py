"""Shared fixtures: the app module (loaded from __main__.py) and tiny in-process runs."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

APP = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP))  # what `python apps/diffusion-grpo` does: siblings of __main__ import


def _load_app():
    spec = importlib.util.spec_from_file_location("diffusion_grpo_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def app():
    return _load_app()


# model.family -> the config its tiny runs start from
CONFIGS = {"sd3": APP / "configs" / "default.toml", "janus": APP / "configs" / "janus_tiny.toml"}


def tiny_config(app, family: str, out: Path, *extra: str):
    """`tiny_overrides` applied to the family's tiny config."""
    from rl_core.train import load_config

    return load_config(app.Config, CONFIGS[family], tiny_overrides(out, *extra, family=family))


def tiny_overrides(out: Path, *extra: str, family: str = "sd3") -> list[str]:
    """The smallest useful run: 32x32 images (sd3: 4 steps; janus: 16 tokens), 2 prompts x 4
    images per epoch, the brightness reward (cheap, and the random tiny models' images differ in
    it), no eval."""
    sd3 = ["sampling.resolution=32", "sampling.num_steps=4", "sampling.max_sequence_length=8"]
    return [
        *(sd3 if family == "sd3" else []),
        "rollout.n=4", "rollout.groups_per_epoch=2", "rollout.sample_batch_size=4",
        "train.micro_batch_size=4", "train.gradient_accumulation_steps=1", "train.ema_interval=1",
        "reward.components={brightness=1.0}", "eval.every=0", f"train.output_dir={out}",
        *extra,
    ]


def flat(tree, prefix=""):
    """Nested state -> {path: exact values} (tensors as lists: equality means bit-equality)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in sorted(tree.items(), key=lambda kv: str(kv[0])):
            out.update(flat(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, torch.Tensor):
        return {prefix: tree.float().flatten().tolist()}
    return {prefix: tree}


def in_process_group(app, cfg, resume: str | None = None) -> Path:
    """`app.train` in a gloo group of this one process: FSDP2 with world size 1, in process (the
    app's `end_training` destroys the group, so each run gets its own)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        return app.train(cfg, resume)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
