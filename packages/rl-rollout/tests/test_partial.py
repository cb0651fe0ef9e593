"""Partial rollouts streamed by group (`rl_rollout.partial`) on the real hf engine: a sample
continued chunk by chunk is the sample decoded at once, a step takes the groups that finish first
and finishes the overdue ones, each token carries its version, and a save/load resumes exactly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rl_rollout import Continuation, Drawn, PartialRollouts, SamplingParams
from rl_rollout.hf import HFEngine
from rl_rollout.partial import round_generator

PROMPTS = [[11, 12, 13, 14, 15], "the cat sat on", [{"role": "user", "content": "Describe a red square."}]]


def drawer(prompts: Sequence[Any]) -> Any:
    """draw(count): keys 0, 1, 2, ... over `prompts` in turn, seed = key."""
    taken: list[int] = []

    def draw(count: int) -> Drawn:
        keys = list(range(len(taken), len(taken) + count))
        taken.extend(keys)
        return keys, [prompts[k % len(prompts)] for k in keys], keys

    return draw


def no_stop(engine: HFEngine) -> HFEngine:
    engine.stop_token_ids = []  # lengths come from the budgets alone
    return engine


def test_a_continuation_resumes_after_its_prefix(qwen3_engine: HFEngine) -> None:
    """Greedy: the prompt + 3 tokens, continued for 5, is the 8-token greedy completion."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for prompt in PROMPTS:
        whole = qwen3_engine.generate([prompt], params)[0]
        head = whole.completion_ids[:3]
        rest = qwen3_engine.generate([Continuation(prompt, head)], SamplingParams(temperature=0.0, max_new_tokens=5))[0]
        assert rest.prompt_ids == whole.prompt_ids + head
        assert head + rest.completion_ids == whole.completion_ids[: 3 + len(rest.completion_ids)]
        assert rest.logprobs == pytest.approx(whole.logprobs[3 : 3 + len(rest.logprobs)], abs=1e-4)


def test_chunked_greedy_samples_equal_the_uninterrupted_ones(qwen3_engine: HFEngine) -> None:
    """steps=0: a step samples its own groups to the end, 3 tokens a round: greedy, that is the
    plain generate's completion, text and log-probs included."""
    partial = PartialRollouts(3, 0, lambda ids: qwen3_engine.tokenizer.decode(ids, skip_special_tokens=True))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    keys, gens = partial.run(round_generator(qwen3_engine), drawer(PROMPTS), 3, params, version=0)
    assert keys == [0, 1, 2] and partial.in_flight == 0
    plain = qwen3_engine.generate(PROMPTS, params)
    assert [g.request_index for g in gens] == [0, 0, 1, 1, 2, 2]
    for got, want in zip(gens, plain, strict=True):
        assert got.prompt_ids == want.prompt_ids and got.completion_ids == want.completion_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert got.token_versions == [0] * len(got.completion_ids)


def test_a_step_takes_the_first_groups_to_finish_and_finishes_the_overdue(qwen3_path: Path) -> None:
    """Even keys sample 4 tokens, odd keys 20 (budgets), 8 tokens a round, 2 groups a step, K=1:
    step 1 returns the short groups 0 and 2 and keeps 1 and 3 in flight; step 2 (version 1)
    must finish 1 and 3 (drawn a step ago), whose first 8 tokens are version 0's."""
    engine = no_stop(HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu"))
    partial = PartialRollouts(8, 1, lambda ids: engine.tokenizer.decode(ids))
    draw, params = drawer(PROMPTS), SamplingParams(n=2, max_new_tokens=20, seed=0)

    def budgets(key: int, j: int) -> int:
        return 4 if key % 2 == 0 else 20

    keys, gens = partial.run(round_generator(engine), draw, 2, params, version=0, budgets=budgets)
    assert keys == [0, 2] and partial.in_flight == 2
    assert [len(g.completion_ids) for g in gens] == [4] * 4
    keys, gens = partial.run(round_generator(engine), draw, 2, params, version=1, budgets=budgets)
    assert keys == [1, 3]  # overdue first; group 4 (4 tokens) finished in this step's first round
    for g in gens:
        assert len(g.completion_ids) == 20 and g.finish_reason == "length"
        assert g.token_versions == [0] * 8 + [1] * 12
        assert g.text == engine.tokenizer.decode(g.completion_ids)
    assert partial.in_flight == 2  # 4 finished and waiting, 5 carried to the next step
    keys, gens = partial.run(round_generator(engine), draw, 2, params, version=2, budgets=budgets)
    assert keys == [4, 5]
    assert gens[0].token_versions == [1] * 4 and gens[2].token_versions == [1] * 16 + [2] * 4


def test_groups_in_flight_saved_and_loaded_sample_as_if_never_stopped(qwen3_path: Path, tmp_path: Path) -> None:
    engine = no_stop(HFEngine.from_pretrained(qwen3_path, dtype=torch.float32, device="cpu"))
    params = SamplingParams(n=2, max_new_tokens=12, seed=0)

    def budgets(key: int, j: int) -> int:
        return 3 + 3 * ((key + j) % 4)

    def two_steps(partial: PartialRollouts, draw: Any, first: int) -> list[Any]:
        return [partial.run(round_generator(engine), draw, 2, params, version=v, budgets=budgets) for v in (first, first + 1)]

    straight = PartialRollouts(4, 1, engine.tokenizer.decode)
    draw = drawer(PROMPTS)
    two_steps(straight, draw, 0)
    straight.save(tmp_path)
    want = two_steps(straight, draw, 2)
    resumed = PartialRollouts(4, 1, engine.tokenizer.decode)
    resumed.load(tmp_path)
    draw_again = drawer(PROMPTS)
    draw_again(2 * 2 + 2)  # the prompts the first two steps drew
    got = two_steps(resumed, draw_again, 2)
    assert got == want
    with pytest.raises(ValueError, match="the run had 1 processes, this one has 2"):
        PartialRollouts(4, 1, engine.tokenizer.decode, world_size=2).load(tmp_path)


def test_a_stop_string_is_refused(qwen3_engine: HFEngine) -> None:
    partial = PartialRollouts(4, 1, qwen3_engine.tokenizer.decode)
    with pytest.raises(ValueError, match="stop string"):
        partial.run(round_generator(qwen3_engine), drawer(PROMPTS), 1, SamplingParams(stop=("\n",)), version=0)


@pytest.mark.parametrize("per_request", [False, True])
def test_the_samples_of_a_group_are_drawn_apart(qwen3_engine: HFEngine, per_request: bool) -> None:
    """Each sample of a group from noise of its own: the hf batch's one generator, or (an engine
    without row budgets: requests one by one) a seed per sample. One round of 6 tokens, 4 samples."""
    engine = SimpleNamespace(generate=qwen3_engine.generate) if per_request else qwen3_engine
    partial = PartialRollouts(6, 0, qwen3_engine.tokenizer.decode)
    _, gens = partial.run(round_generator(engine), drawer(PROMPTS[:1]), 1, SamplingParams(n=4, max_new_tokens=6, seed=0),
                          version=0)
    assert len({tuple(g.completion_ids) for g in gens}) == 4
