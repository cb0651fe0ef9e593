"""Shared fixtures: the app module (loaded from __main__.py) and tiny in-process runs."""

from __future__ import annotations

import importlib.util
import json
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


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster on 2 CPUs for a module's tests (`rollout.workers > 0`)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


# model.family -> the config its tiny runs start from
CONFIGS = {"sd3": APP / "configs" / "default.toml", "janus": APP / "configs" / "janus_tiny.toml",
           "wan": APP / "configs" / "wan_tiny.toml"}


def tiny_config(app, family: str, out: Path, *extra: str):
    """`tiny_overrides` applied to the family's tiny config."""
    from rl_core.train import load_config

    return load_config(app.Config, CONFIGS[family], tiny_overrides(out, *extra, family=family))


def tiny_overrides(out: Path, *extra: str, family: str = "sd3") -> list[str]:
    """The smallest useful run: 32x32 images (sd3: 4 steps; janus: 16 tokens), 2 prompts x 4
    images per epoch, the brightness reward (cheap, and the random tiny models' images differ in
    it), no eval; sd3 with Flow-GRPO's update (lr 3e-4, clip 1e-4, KL 0.04) for 4 epochs, not the
    embedded default's (lr 0.05, clip 0.2, no KL, 12 epochs: a curve that moves within the run)."""
    sd3 = ["sampling.resolution=32", "sampling.num_steps=4", "sampling.max_sequence_length=8",
           "train.lr=3e-4", "train.clip_range=1e-4", "algo.kl_coef=0.04", "train.epochs=4", "train.save_freq=2"]
    return [
        *(sd3 if family == "sd3" else []),
        "rollout.n=4", "rollout.groups_per_epoch=2", "rollout.sample_batch_size=4",
        "train.micro_batch_size=4", "train.gradient_accumulation_steps=1", "train.ema_interval=1",
        "reward.components={brightness=1.0}", "train.eval_freq=0", f"train.output_dir={out}",
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


def checked(app, *argv: str):
    """The config of a command line (`--config FILE`, `key=value`) after the recipe's checks:
    what the loop runs before any model loads."""
    from rl_core.train import load_config, parse_cli

    cli = parse_cli(list(argv))
    cfg = load_config(app.Config, cli.config or app.DEFAULT_CONFIG, cli.overrides, env=app.RECIPE.env)
    app.RECIPE.check(cfg, 1)
    return cfg


def train(app, cfg, resume: str | None = None) -> Path:
    """The trainer loop on the app's recipe (what `main` runs after parsing the command line)."""
    from rl_core.train import train as loop

    return loop(app.RECIPE, cfg, resume)


def setup_state(app, cfg):
    """The recipe's state as the loop builds it on one process (checked, seeded, set up, started),
    for tests that drive the hooks themselves."""
    from accelerate import Accelerator

    from rl_core.train import (
        NonFiniteGuard,
        PhaseTimer,
        RunContext,
        SampleLog,
        make_run_dir,
        seed_everything,
    )

    acc = Accelerator(cpu=True)
    app.RECIPE.check(cfg, acc.num_processes)
    run_dir = make_run_dir(cfg.train.output_dir, None, config=cfg, accelerator=acc)
    seed_everything(cfg.train.seed)
    run = RunContext(acc, run_dir, 0, PhaseTimer(), SampleLog(run_dir), NonFiniteGuard(cfg.train.max_nonfinite_steps))
    state = app.RECIPE.setup(cfg, run)
    run.guard.after_step(app.RECIPE.policy(state).stepped)  # the loop counts each optimizer step taken (and the EMA's)
    app.RECIPE.start(state)
    return state


def advantages(app, state, batch, rewards):
    """The loop's advantages for `rewards` `[N]` of `batch` (the recipe's groups and options)."""
    from rl_core.train import group_advantages

    acc = state.run.accelerator
    scores = app.grpo_scores(state.cfg, acc, rewards, batch.group_ids, [r.prompt for r in batch.records], {})
    return group_advantages(scores.estimator, scores.rewards, scores.group_ids, accelerator=acc, options=scores.options)


def in_process_group(app, cfg, resume: str | None = None) -> Path:
    """`train` in a gloo group of this one process: FSDP2 with world size 1, in process (the
    loop's `end_training` destroys the group, so each run gets its own)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        return train(app, cfg, resume)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def world_rows(where: Path, media: list[str]) -> Path:
    """A JSONL of OCR prompts, each starting from its own picture: a grey square per image row
    (grey i x 80), a 5-frame GIF per video row."""
    from PIL import Image

    rows = []
    for i, kind in enumerate(media):
        frame = Image.new("RGB", (48, 40), (i * 80,) * 3)
        name = f"start{i}.{'gif' if kind == 'video' else 'png'}"
        if kind == "video":  # frames that differ (Pillow merges equal ones)
            later = [Image.new("RGB", (48, 40), (i * 80 + 10 * k,) * 3) for k in range(1, 5)]
            frame.save(where / name, save_all=True, append_images=later, duration=100)
        else:
            frame.save(where / name)
        rows.append(json.dumps({"prompt": f'A sign that says "WORLD{i}"', kind: name}))
    path = where / "world.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path
