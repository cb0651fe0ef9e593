"""Shared fixtures: the app module (loaded from __main__.py), tiny runs in process."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rl_models import tiny
from rl_rewards.client import RewardClient

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is first imported (in a test)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

APP = Path(__file__).resolve().parents[1]
REPO = APP.parents[1]
DATA = REPO / "examples" / "data"
RULE_SPEC = APP / "tests" / "rule_reward.toml"
sys.path.insert(0, str(APP))  # what `python apps/caption-rl` does: siblings of __main__ import


def _load_app():
    spec = importlib.util.spec_from_file_location("caption_rl_app", APP / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def app():
    return _load_app()


def tiny_overrides(out: Path, *extra: str) -> list[str]:
    """A fast configuration: 2 prompts x 4 captions of 8 tokens, rule reward, absolute data paths,
    112x112 images at lr 1e-4 (the numbers pinned here were measured so; the embedded default's
    56x56 at lr 1e-2 is for a curve that moves within its 32 steps)."""
    return [
        f"data.train_files=[\"{DATA / 'caption_qa_images.jsonl'}\", \"{DATA / 'caption_qa_videos.jsonl'}\"]",
        "data.eval_size=2", "data.video_max_frames=4", "data.max_pixels=12544",
        "rollout.n=4", "rollout.max_new_tokens=8",
        f"reward.spec={RULE_SPEC}",
        "train.batch_size=2", "train.micro_batch_size=8", "train.max_steps=2", "train.eval_freq=0", "train.lr=1e-4",
        "train.save_freq=100", f"train.output_dir={out}", "train.samples_to_log=2",
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def reward_server(tmp_path):
    """A real `rl-rewards serve` process in CapRL qa mode with the tiny judge (REWARD_TASK=video)."""
    port = free_port()
    env = {**os.environ, "REWARD_MODEL": str(tiny.build("qwen3")), "REWARD_PORT": str(port), "REWARD_TASK": "video"}
    cli = Path(sys.executable).with_name("rl-rewards")
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(cli), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}/get_reward"
    with RewardClient(f"http://127.0.0.1:{port}") as client:
        try:
            client.wait_ready(timeout=180)
        except TimeoutError:
            proc.kill()
            raise AssertionError(log.read_text()[-3000:]) from None
    yield url, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


