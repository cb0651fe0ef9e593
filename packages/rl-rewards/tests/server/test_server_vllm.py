"""`rl-rewards serve` with its qa judge on a real vLLM (opt-in `-m vllm`, needs a GPU): chosen by
`REWARD_ENGINE=vllm`, CapRL's sampled estimator and our exact one through `/get_reward`, the exact
rewards equal to the in-process `hf` judge's (the vLLM engine renormalizes the letters' log-probs
over the options, which leaves the reward unchanged)."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest
from conftest import server_process

torch = pytest.importorskip("torch")
tiny = pytest.importorskip("rl_models.tiny")
pytest.importorskip("rl_rewards.scorers.caption_qa")

from rl_rewards.registry import build_scorer  # noqa: E402
from rl_rewards.samples import Sample  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vLLM and a GPU"),
]
QA = [["What colour is the circle?\n   - A) red\n   - B) blue\n   - C) green", "A"],
      ["Is it moving?\n   - A) yes\n   - B) no", "B"]]
CAPTIONS = ["a red circle that fades", "a dog runs across the street", "nothing to see"]
VLLM_OPTIONS = {"gpu_memory_utilization": 0.25, "enforce_eager": True, "max_model_len": 2048, "dtype": "bfloat16"}
# qwen3_vllm: the tiny judge with 64-wide heads, which vLLM's attention kernels take


def test_qa_judge_served_on_vllm(tmp_path):
    judge = str(tiny.build("qwen3_vllm"))
    args = ["--judge-option", "estimator=exact", "--judge-option", f"engine_options={json.dumps(VLLM_OPTIONS)}"]
    env = {"REWARD_MODEL": judge, "REWARD_ENGINE": "vllm", "REWARD_TASK": "image"}
    with server_process(tmp_path, "vllm-judge", args, env, ready_timeout=240) as proc:
        body = {"prompts": [[c, QA] for c in CAPTIONS], "query": [], "labels": []}
        response = httpx.post(f"{proc.url}/get_reward", json=body, timeout=300)
        assert response.status_code == 200, response.text
        served = response.json()["rewards"]
    expected = build_scorer("caption_qa", model=judge, engine="hf", task="image", estimator="exact",
                            engine_options={"device": "cuda", "dtype": torch.float32})
    reference = [r.score for r in expected.score([Sample(completion=c, reference=QA) for c in CAPTIONS])]
    assert served == pytest.approx(reference, abs=2e-2)  # bf16 engine vs fp32 reference
