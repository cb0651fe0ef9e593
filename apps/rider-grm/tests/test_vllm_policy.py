"""The policy's rollouts on a real vLLM (opt-in `-m vllm`, needs a GPU): a colocated engine awake
only while it generates, the policy's weights pushed after every optimizer step; `rollout.engine
= auto` picking it; and the policy and two judges all on vLLM engines, each asleep when not used.
Run one test per process (`.ci/marked_tests.py vllm`): vLLM keeps process-wide state."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import REPO, VLLM_JUDGES, app, read_metrics, tiny_overrides

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vLLM and a GPU"),
]
# tiny:qwen3_vllm: 64-wide heads, which vLLM's attention kernels take (it hangs on tiny:qwen3's 8-wide
# ones); bfloat16: as rl-rollout's and the judges' vLLM tests (in float32 vLLM takes its flex-attention
# path, which failed on a tiny checkpoint there); enforce_eager: starts in seconds instead of compiling and
# capturing CUDA graphs; max_model_len: rider-grm's default, rollout.max_prompt_length + max_new_tokens
POLICY = {"model.path": '"tiny:qwen3_vllm"', "model.dtype": '"bfloat16"', "rollout.gpu_memory_utilization": 0.15,
          "rollout.engine_options.enforce_eager": "true"}
# hf judges (swapped on and off the GPU by the swap plan) on the tiny checkpoints vLLM does not run
HF_JUDGES = (
    f'[{{name = "score", module = "{REPO}/examples/rider-grm/reward_function/rating_judge.py", model = "tiny:qwen3:1", '
    f'weight = 0.3, combine = "add", max_new_tokens = 4, fallback = 0.25, engine = "hf"}}, '
    f'{{name = "consistency", module = "{REPO}/examples/rider-grm/reward_function/no_contradiction_judge.py", '
    f'model = "tiny:qwen3:2", weight = 0.5, combine = "mul", max_new_tokens = 4, fallback = 0.5, engine = "hf"}}]'
)



def test_weight_sync_with_real_vllm(tmp_path: Path) -> None:
    """3 steps at a high learning rate (one optimizer step each): every rollout after the first
    comes from the weights of the previous optimizer step (version = optimizer steps pushed), so
    the engine's sampling log-probs keep matching the trainer's replay; without the push they
    would drift apart as the policy moves. The vLLM engine sleeps while the hf judges score, and
    the swap plan (`auto` stays `always` with a vLLM engine) moves the training model off the GPU."""
    run = app.main(tiny_overrides(tmp_path, **POLICY, **{
        "rollout.engine": '"vllm"', "reward.judges": HF_JUDGES, "train.lr": 1e-2, "train.max_steps": 3,
        "train.save_freq": 100}))
    rows = read_metrics(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 1.0, 2.0]
    for row in rows:
        assert float(row["replay/engine_diff_mean"]) < 1e-2, row  # trainer vs vLLM kernels, bf16
        assert row["check/policy_awake_during_score"] == "0"
        assert row["check/policy_awake_during_consistency"] == "0"
        assert row["check/judges_awake_during_rollout"] == "0"
        assert float(row["swap/offload_policy"]) == 1.0


def test_auto_picks_vllm_and_says_so(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = app.main(tiny_overrides(tmp_path, **POLICY, **{"rollout.engine": '"auto"', "reward.judges": "[]",
                                                         "train.max_steps": 1}))
    assert "rollout.engine: vllm (auto: CUDA device and vLLM found)" in capfd.readouterr().out
    assert [float(r["rollout/weight_version"]) for r in read_metrics(run)] == [0.0]


def test_policy_and_two_judges_all_on_vllm(tmp_path: Path) -> None:
    """Three vLLM engines on one GPU: the judges' engine cores in processes of their own, the
    policy's in this process; each awake only while it works (the judges while they score, the
    policy while it generates), and the weight sync as above."""
    run = app.main(tiny_overrides(tmp_path, **POLICY, **{
        "rollout.engine": '"vllm"', "reward.judges": VLLM_JUDGES, "train.lr": 1e-2, "train.max_steps": 2,
        "train.save_freq": 100}))
    rows = read_metrics(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 1.0]
    for row in rows:
        assert row["check/judges_awake_during_rollout"] == "0"  # both judges asleep while the policy samples
        assert row["check/policy_awake_during_score"] == "0"  # the policy asleep while each judge scores
        assert row["check/policy_awake_during_consistency"] == "0"
        assert float(row["replay/engine_diff_mean"]) < 1e-2, row
        for name in ("score", "consistency"):
            assert float(row[f"reward/{name}"]) == float(row[f"reward/{name}"])  # finite, scored


def test_asynchronous_rollouts_with_real_vllm(tmp_path: Path) -> None:
    """train.max_staleness=1 with the policy on vLLM: the engine stays awake (reward.swap auto ->
    never), the rollout thread samples step j + 1 while step j trains, and step j samples with the
    weights pushed after step j - 2 (optimizer steps 0, 0, 1, 2)."""
    run = app.main(tiny_overrides(tmp_path, **POLICY, **{
        "rollout.engine": '"vllm"', "reward.judges": HF_JUDGES, "train.lr": 1e-3, "train.max_steps": 4,
        "train.max_staleness": 1, "algo.rollout_correction": '"token_truncate"', "train.save_freq": 100}))
    rows = read_metrics(run)
    assert [float(r["rollout/weight_version"]) for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert [float(r["rollout/staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert float(rows[0]["replay/engine_diff_mean"]) < 1e-2, rows[0]
    for row in rows:
        assert 0.0 <= float(row["replay/engine_kl"]) < 1.0, row
