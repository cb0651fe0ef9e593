"""The `vllm` rollout path on a real vLLM (opt-in `-m vllm`, needs a GPU): a colocated engine
asleep during the update, the policy's weights pushed after every optimizer step (LoRA merged,
or full fine-tuning), images and videos; and `rollout.engine=auto` picking vLLM there."""

from __future__ import annotations

import csv
import importlib.util

import pytest
import torch
from conftest import tiny_overrides

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vLLM and a GPU"),
]
# enforce_eager: a tiny model starts in seconds instead of compiling and capturing CUDA graphs
FAST = ["rollout.gpu_memory_utilization=0.2", "rollout.engine_options.enforce_eager=true",
        "rollout.engine_options.max_model_len=4096"]


def app_rows(run):
    with (run / "metrics.csv").open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("step")]


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_weight_sync_with_real_vllm(app, tmp_path, tuning):
    """3 steps at a high learning rate: each rollout after the first comes from the weights of the
    previous optimizer step (version = optimizer steps), so the engine's log-probs keep matching
    the trainer's; without the push they would drift apart as the policy moves."""
    tune = ["model.lora_rank=4", "train.lr=5e-2"] if tuning == "lora" else ["model.lora_rank=0", "train.lr=1e-3"]
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, *tune, "data.eval_size=0",
                                  "train.max_steps=3", "algo.old_logprobs=replay"))
    rows = app_rows(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 1.0, 2.0]
    for row in rows:
        assert float(row["replay/engine_diff_mean"]) < 1e-2, row  # trainer vs vLLM kernels (passed at this bound on an H100)


def test_auto_picks_vllm_and_says_so(app, tmp_path, capfd):
    app.main(tiny_overrides(tmp_path, *FAST, "data.eval_size=0", "train.max_steps=1"))
    assert "rollout.engine: vllm (auto: CUDA device and vLLM found)" in capfd.readouterr().out


def test_asynchronous_rollouts_with_real_vllm(app, tmp_path):
    """train.max_staleness=1: the engine stays awake, the rollout thread samples step j + 1 while
    step j trains, and each version of the weights reaches vLLM as a push between its requests: step
    j samples with the weights after step j - 2 (optimizer steps 0, 0, 1, 2), never newer, never
    older. Step 1 samples with the weights it trains, so its engine gap is kernels only."""
    run = app.main(tiny_overrides(tmp_path, "rollout.engine=vllm", *FAST, "model.lora_rank=0", "train.lr=1e-3",
                                  "data.eval_size=0", "train.max_steps=4", "train.max_staleness=1",
                                  "algo.rollout_correction=token_truncate"))
    rows = app_rows(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert [float(r["rollout/staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert float(rows[0]["replay/engine_diff_mean"]) < 1e-2, rows[0]
    for row in rows:
        assert 0.0 <= float(row["replay/engine_kl"]) < 1.0, row  # finite, and the push landed (else it grows)
