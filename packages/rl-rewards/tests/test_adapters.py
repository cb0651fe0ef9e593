"""Adapters, each called exactly the way its framework calls it (signatures from the TRL, verl and
OpenRLHF docs; the frameworks themselves are too heavy to install here)."""

import asyncio
import inspect

import pytest

from rl_rewards.adapters import as_openrlhf_reward_func, as_trl_reward, as_verl_compute_score
from rl_rewards.composition import build_reward
from rl_rewards.samples import ScoreResult

SPEC = {
    "components": {
        "fmt": {"scorer": "timestamp_format"},
        "ref": {"scorer": "x", "weight": 0.5},
    }
}


class ReferenceMatch:
    """1.0 when the completion contains the reference; fails when the reference is 'BAD'."""

    name = "reference_match"

    def score(self, samples):
        return [
            ScoreResult.failed("unusable reference") if s.reference == "BAD"
            else ScoreResult(score=float(str(s.reference) in s.completion)) for s in samples
        ]


def _reward():
    return build_reward(SPEC, scorers={"ref": ReferenceMatch()})


class TrainerState:  # TRL passes its TrainerState as a keyword; it is not a dataset column
    global_step = 3


@pytest.mark.no_torch
def test_trl_reward_function_standard_and_conversational():
    f = as_trl_reward(_reward(), name="caption_reward")
    assert f.__name__ == "caption_reward" and not inspect.iscoroutinefunction(f)
    # GRPOTrainer: reward_func(prompts=..., completions=..., completion_ids=..., **reward_kwargs)
    scores = f(
        prompts=["describe", "describe", "describe"],
        completions=["[00:01] cat", "no stamps cat", "[00:02] dog"],
        completion_ids=[[1, 2], [3], [4]],
        reference=["cat", "cat", "BAD"],
        data_source=["v", "v", "v"],
        trainer_state=TrainerState(),
    )
    assert scores == [1.5, 0.5, None]  # fmt + 0.5*ref; the failed row abstains
    conversational = f(
        prompts=[[{"role": "user", "content": "describe"}]],
        completions=[[{"role": "assistant", "content": "[00:01] a cat"}]],
        completion_ids=[[1]],
        reference=["dog"],
        trainer_state=TrainerState(),
    )
    assert conversational == [1.0]


@pytest.mark.no_torch
def test_trl_reward_is_async_for_a_server_url(tmp_path):
    from rl_rewards.server.process import ServerProcess

    with ServerProcess([], log_path=tmp_path / "server.log") as server:
        f = as_trl_reward(server.url, reward="timestamp_format")
        assert inspect.iscoroutinefunction(f)  # TRL awaits async reward functions
        scores = asyncio.run(f(prompts=["p", "p"], completions=["[00:01] a", "none"], completion_ids=None))
    assert scores == [1.0, 0.0]


@pytest.mark.no_torch
def test_verl_single_and_batch_forms():
    compute_score = as_verl_compute_score(_reward())
    # NaiveRewardManager: compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)
    out = compute_score(data_source="caprl_video", solution_str="[00:01] cat", ground_truth="cat", extra_info={"index": 0})
    assert out == {"score": 1.5, "failed": 0.0, "fmt": 1.0, "ref": 1.0}
    failed = compute_score(data_source="caprl_video", solution_str="[00:01] cat", ground_truth="BAD")
    assert failed == {"score": 0.0, "failed": 1.0, "fmt": 1.0, "ref": 0.0}  # same keys for every sample
    batch = as_verl_compute_score(_reward(), batch=True, error_score=-1.0)
    # BatchRewardManager: compute_score(data_sources=..., solution_strs=..., ground_truths=..., extra_infos=...)
    outs = batch(data_sources=["a", "b"], solution_strs=["[00:01] x", "y"], ground_truths=["x", "BAD"], extra_infos=[None, None])
    assert [o["score"] for o in outs] == [1.5, -1.0]
    assert [set(o) for o in outs] == [{"score", "failed", "fmt", "ref"}] * 2


def test_openrlhf_reward_func():
    import torch

    reward_func = as_openrlhf_reward_func(_reward(), error_score=-1.0)
    # OpenRLHF --remote_rm_url reward_func.py: reward_func(queries, prompts, labels)
    out = reward_func(
        ["<|user|>describe<|assistant|>[00:01] cat", "<|user|>describe<|assistant|>dog", "other [00:01]"],
        ["<|user|>describe<|assistant|>", "<|user|>describe<|assistant|>", "mismatched prompt"],
        ["cat", "BAD", "zzz"],
    )
    assert isinstance(out["rewards"], torch.Tensor)
    assert out["rewards"].tolist() == [1.5, -1.0, 1.0]
    assert out["scores"].tolist() == out["rewards"].tolist()
    assert out["extra_logs"]["failed"] == 1.0
    assert out["extra_logs"]["fmt"] == pytest.approx(2 / 3)  # over the 3 samples (the failed one too)
