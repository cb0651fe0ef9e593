"""A text recipe's shared setup (`rl_policy.setup`): the key rules `check_token_config` applies
before any model loads, and the tiny Qwen3 prepared by `prepare_token_policy` and sampled by
`engine_for`'s engine, built from the config tables alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from rl_core.train import (
    ConfigError,
    NonFiniteGuard,
    PhaseTimer,
    RunContext,
    SampleLog,
    TokenPolicyFields,
    TokenTrainFields,
)
from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.placement import PolicyRolloutFields
from rl_policy.setup import check_token_config, engine_for, prepare_token_policy
from rl_rollout import SamplingParams


def test_the_shared_keys_are_checked_together() -> None:
    algo, rollout, train = TokenPolicyFields(), PolicyRolloutFields(), TokenTrainFields(batch_size=8)
    assert check_token_config(algo, rollout, train, world_size=2) == "hf"  # auto on a CPU
    with pytest.raises(ConfigError, match=r"train.batch_size=8 must divide by the 3 processes"):
        check_token_config(algo, rollout, train, world_size=3)
    with pytest.raises(ConfigError, match=r"train.batch_size=8 must divide .* train.mini_batch_size=3"):
        check_token_config(algo, rollout, TokenTrainFields(batch_size=8, mini_batch_size=3), world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.n=1: algo.advantage='grpo' compares"):
        check_token_config(TokenPolicyFields(advantage="grpo"), PolicyRolloutFields(n=1), train, world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.placement=split .* needs train.max_staleness >= 1"):
        check_token_config(algo, PolicyRolloutFields(placement="split"), train, world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.precision='fp8' quantizes a vLLM engine's .* resolves to 'hf'"):
        check_token_config(algo, PolicyRolloutFields(precision="fp8"), train, world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.weight_push='adapter' pushes a LoRA adapter to Ray actors "
                                          r"\(rollout.workers\) or to a colocated, synchronous vLLM engine; here "
                                          r"rollout.engine resolves to 'hf'"):
        check_token_config(algo, PolicyRolloutFields(weight_push="adapter"), train, world_size=1)


def test_the_prepared_policy_trains_what_requires_grad_with_warm_up_and_samples_from_its_engine(tmp_path: Path) -> None:
    model, tokenizer = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    model.get_input_embeddings().requires_grad_(False)
    acc = Accelerator(cpu=True)
    run = RunContext(acc, tmp_path, 0, PhaseTimer(), SampleLog(tmp_path), NonFiniteGuard(3))
    trained = prepare_token_policy(run, model, TokenTrainFields(lr=0.1, weight_decay=0.01, warmup_steps=3))
    [group] = trained.optimizer.param_groups
    assert len(group["params"]) == sum(p.requires_grad for p in model.parameters()) < len(list(model.parameters()))
    assert group["weight_decay"] == 0.01 and trained.full is None
    lrs = []
    for _ in range(5):
        lrs.append(trained.scheduler.get_last_lr()[0])
        trained.optimizer.step()
        trained.scheduler.step()
    assert lrs == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])
    engine = engine_for(PolicyRolloutFields(engine="hf", max_batch_size=2), run, model=model, processor=tokenizer,
                        path="", dtype="float32", compile=False)
    gens, _ = engine.sample([[{"role": "user", "content": "Hi"}]], SamplingParams(n=3, max_new_tokens=4))
    assert engine.kind == "hf" and len(gens) == 3 and all(len(g.completion_ids) == 4 for g in gens)
    engine.close()


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token() -> None:
    """Hand-worked: completions of 3, 1 and 0 tokens; scores 1.0, None (failed: NaN) and 0.5."""
    from rl_policy.training import token_rewards
    from rl_rollout import Generation

    gens = [Generation(request_index=0, prompt_ids=[1], completion_ids=ids, text="", logprobs=[0.0] * len(ids),
                       finish_reason="stop") for ids in ([5, 6, 7], [5], [])]
    rewards, mask = token_rewards(gens, [1.0, None, 0.5])
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert rewards[0].tolist() == [0, 0, 1.0] and rewards[2].tolist() == [0.5, 0, 0]
    assert rewards[1, 0].isnan() and rewards[1, 1:].tolist() == [0, 0]
    kl = [torch.tensor([0.1, 0.2, 0.4]), torch.tensor([1.0]), torch.tensor([])]
    shaped, _ = token_rewards(gens, [1.0, 0.0, 0.5], kl=kl, kl_coef=0.5)
    assert shaped.flatten().tolist() == pytest.approx([-0.05, -0.1, 0.8, -0.5, 0, 0, 0.5, 0, 0])
