# ruff: noqa: E402  (imports follow the importorskip of torch)
"""One adapter smoke per trainer for `nox -s "coinstall(<trainer>)"`, which installs the trainer
with its own dependencies (verl 0.9.1: transformers < 5.11; TRL 1.16; OpenRLHF 0.11.2:
transformers 5.15) together with rl-core, rl-models and rl-rewards, as `pip install verl==0.9.1
rl-models rl-rewards` would, and runs that trainer's test here (`-k test_verl_`). Samples go
through the trainer's own reward call, the failing one first (the case for which the adapters
must keep every key): two for verl and OpenRLHF, two prompts x two generations for TRL's GRPO.
The tokenizer and policy are rl-models' tiny qwen3, built under the transformers the trainer
resolved. The third_party session skips this file: the other files here test each adapter in
depth inside the same trainers."""

from __future__ import annotations

import asyncio
import functools
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from rl_rewards.composition import build_reward
from rl_rewards.samples import ScoreResult

pytestmark = [pytest.mark.third_party, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

ROWS = [("[00:01] cat", "BAD"), ("[00:01] cat", "cat")]  # (response, reference): failed, then scored
# hand-worked: failed -> error_score -1 (fmt still 1, ref 0); scored -> fmt 1 + ref 1
SCORES, FAILED, FMT, REF = [-1.0, 2.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]


class ReferenceMatch:
    """1.0 when the reference occurs in the completion; the reference "BAD" fails the sample."""

    name = "reference_match"

    def score(self, samples):
        return [ScoreResult.failed("unusable reference") if s.reference == "BAD"
                else ScoreResult(score=float(str(s.reference) in s.completion)) for s in samples]


def reward():
    return build_reward({"components": {"fmt": {"scorer": "timestamp_format"}, "ref": {"scorer": "x"}}},
                        scorers={"ref": ReferenceMatch()})


@functools.cache
def tiny_qwen3() -> str:
    """Built on first use, after the trainer's importorskip: a test skipped for want of its
    trainer (the default `nox -s tests` runs) costs no build. `nox -s coinstall` points
    $RL_MODELS_CACHE at an empty folder, so the build runs under the trainer's transformers."""
    from rl_models import tiny

    return str(tiny.build("qwen3"))


def test_verl_naive_reward_manager():
    with warnings.catch_warnings():  # verl imports Ray's deprecated experimental state API
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("verl")
        from verl import DataProto
        from verl.workers.reward_manager import NaiveRewardManager
    import numpy as np
    from transformers import AutoTokenizer

    from rl_rewards.adapters import as_verl_compute_score

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3())
    prompt = tokenizer("Describe the video.", add_special_tokens=False)["input_ids"]
    response = tokenizer(ROWS[0][0], add_special_tokens=False)["input_ids"]  # both rows answer the same
    data = DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt] * 2), "responses": torch.tensor([response] * 2),  # [2, P], [2, R]
                 "attention_mask": torch.ones(2, len(prompt) + len(response), dtype=torch.long)},  # [2, P + R]
        non_tensors={"data_source": np.array(["caption"] * 2, dtype=object),
                     "reward_model": np.array([{"ground_truth": ref} for _, ref in ROWS], dtype=object)},
    )
    manager = NaiveRewardManager(tokenizer=tokenizer, num_examine=0,
                                 compute_score=as_verl_compute_score(reward(), error_score=-1.0))
    out = manager(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == SCORES  # [2, R], the score on the last token
    assert {k: list(v) for k, v in out["reward_extra_info"].items()} == {
        "score": SCORES, "failed": FAILED, "fmt": FMT, "ref": REF}


def test_trl_grpo_trainer_step(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from rl_rewards.adapters import as_trl_reward

    seen: list[list[float | None]] = []
    inner = as_trl_reward(reward(), name="caption")

    def caption(**kwargs):  # records what TRL got back; TRL names reward functions by __name__
        seen.append(inner(**kwargs))
        return seen[-1]

    # two prompts (one reference each) x two generations: the smallest batch GRPO takes
    dataset = Dataset.from_dict({"prompt": ["Describe a cat.", "Describe a dog."], "reference": ["BAD", "cat"]})
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                            max_completion_length=2, max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                            use_cpu=True, seed=0)
    trainer = trl.GRPOTrainer(model=tiny_qwen3(), reward_funcs=[caption], args=config, train_dataset=dataset)
    trainer.train()
    (scores,) = seen
    assert sorted(s is None for s in scores) == [False, False, True, True]  # the "BAD" rows failed (None)
    logged = next(entry for entry in trainer.state.log_history if "caption/failed" in entry)
    assert logged["caption/failed"] == pytest.approx(0.5)


REWARD_FILE = '''
from rl_rewards.adapters import as_openrlhf_reward_func
from rl_rewards.composition import build_reward
from rl_rewards.samples import ScoreResult


class ReferenceMatch:
    name = "reference_match"

    def score(self, samples):
        return [ScoreResult.failed("unusable reference") if s.reference == "BAD"
                else ScoreResult(score=float(str(s.reference) in s.completion)) for s in samples]


SPEC = {"components": {"fmt": {"scorer": "timestamp_format"}, "ref": {"scorer": "x"}}}
reward_func = as_openrlhf_reward_func(build_reward(SPEC, scorers={"ref": ReferenceMatch()}), error_score=-1.0)
'''


def test_openrlhf_reward_file_through_the_agent_executor(tmp_path):
    with warnings.catch_warnings():  # openrlhf.utils.math_utils has invalid escape sequences
        warnings.simplefilter("ignore")
        pytest.importorskip("openrlhf")
        from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3())
    (tmp_path / "reward_func.py").write_text(REWARD_FILE)
    executor = SingleTurnAgentExecutor(remote_rm_url=str(tmp_path / "reward_func.py"))

    class Policy:  # stands in for the policy's vLLM engine (GPU only): answers with the row's response
        def __init__(self, response):
            self.ids = tokenizer(response, add_special_tokens=False)["input_ids"]

        async def generate(self, prompt_token_ids, params, multi_modal_data=None):
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=self.ids, finish_reason="stop", logprobs=None)])

    async def run():
        params = SimpleNamespace(max_tokens=32, logprobs=None)
        return [await executor.execute("Describe the video: ", ref, params, 256, tokenizer, Policy(response))
                for response, ref in ROWS]

    outs = asyncio.run(run())
    assert [float(torch.as_tensor(o["reward"]).flatten()[0]) for o in outs] == SCORES
    logs = [{k: float(torch.as_tensor(v).flatten()[0]) for k, v in o["extra_logs"].items()} for o in outs]
    assert logs == [{"failed": f, "fmt": m, "ref": r} for f, m, r in zip(FAILED, FMT, REF, strict=True)]
