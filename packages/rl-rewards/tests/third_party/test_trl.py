# ruff: noqa: E402  (imports follow the importorskip of the optional framework)
"""The TRL adapter in a real TRL GRPOTrainer step on the CPU (trl 1.16, tiny qwen3 policy): the
total reaches TRL as the reward (None for a failed sample), and the reward's components reach
TRL's own metrics through the `log_metric` callable TRL passes to reward functions."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
trl = pytest.importorskip("trl")
from datasets import Dataset

from rl_rewards.adapters import as_trl_reward
from rl_rewards.composition import build_reward
from rl_rewards.samples import Sample, ScoreResult

pytestmark = [pytest.mark.third_party, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

SPEC = {"components": {
    "words": {"scorer": "length", "options": {"tokenizer": "whitespace", "l1": 1000, "l2": 2000}},
    "ref": {"scorer": "x"},
}}


class FailsOnBad:
    """1.0 unless the row's reference is "BAD", which fails the sample."""

    name = "fails_on_bad"

    def score(self, samples):
        return [ScoreResult.failed("unusable reference") if s.reference == "BAD" else ScoreResult(score=1.0)
                for s in samples]


def test_grpo_trainer_step_logs_components(tmp_path):
    from rl_models.tiny import build

    seen: list[list[float | None]] = []
    inner = as_trl_reward(build_reward(SPEC, scorers={"ref": FailsOnBad()}), name="caption")

    def caption(**kwargs):  # records what TRL got back; TRL names reward functions by __name__
        seen.append(inner(**kwargs))
        return seen[-1]

    dataset = Dataset.from_dict({"prompt": ["Describe a cat.", "Describe a dog."], "reference": ["ok", "BAD"]})
    config = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
        max_steps=1, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
    )
    trainer = trl.GRPOTrainer(model=str(build("qwen3")), reward_funcs=[caption], args=config, train_dataset=dataset)
    trainer.train()
    (scores,) = seen
    assert sorted(s is None for s in scores) == [False, False, True, True]  # the "BAD" rows failed
    assert all(s == 2.0 for s in scores if s is not None)  # words 1.0 (short) + ref 1.0
    logged = next(entry for entry in trainer.state.log_history if "caption/failed" in entry)
    assert logged["caption/failed"] == pytest.approx(0.5)
    assert logged["caption/words"] == 1.0 and logged["caption/ref"] == 1.0
    assert 0 < logged["caption/words.n_tokens"] <= 4


def test_overlong_equals_trl_soft_overlong_punishment():
    """DAPO's soft overlong punishment: our `overlong` scorer and TRL's own reward function give the
    same value for every length 0..130 (L_max = 100, L_cache = 20: free, ramp, past the limit)."""
    from trl.rewards import get_soft_overlong_punishment

    lengths = range(131)
    theirs = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)([[7] * n for n in lengths])
    reward = build_reward({"components": {"o": {"scorer": "overlong", "options": {"max_length": 100, "cache": 20}}}})
    ours = [r.score for r in reward.score([Sample(completion="", metadata={"completion_tokens": n}) for n in lengths])]
    assert ours == theirs
    assert {theirs[80], theirs[90], theirs[100], theirs[101]} == {0.0, -0.5, -1.0}  # the sweep crosses all 3 regions
