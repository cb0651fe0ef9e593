"""A text recipe's eval share (`rl_policy.evaluation.greedy_answers`), with the tiny Qwen3 and its
hf engine: the processes' shares answer every prompt once, and greedily, so two processes answer
as one does."""

from __future__ import annotations

import torch

from rl_models import tiny
from rl_models.text import load_causal_lm
from rl_policy.engine import build_policy_engine
from rl_policy.evaluation import greedy_answers

PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 0)]]


def test_two_shares_answer_every_prompt_once_as_one_process_does() -> None:
    model, tokenizer = load_causal_lm(str(tiny.build("qwen3")), dtype="float32")
    torch.manual_seed(0)
    with torch.no_grad():  # larger random weights than the checkpoint's: answers that differ by prompt
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    engine = build_policy_engine("hf", model=model, processor=tokenizer, path="", dtype="float32",
                                 device=torch.device("cpu"), seed=0, compile=False)
    alone, answers = greedy_answers(engine, PROMPTS, max_new_tokens=5)
    first, firsts = greedy_answers(engine, PROMPTS, max_new_tokens=5, rank=0, world_size=2)
    second, seconds = greedy_answers(engine, PROMPTS, max_new_tokens=5, rank=1, world_size=2)
    assert alone == [0, 1, 2, 3, 4] and (first, second) == ([0, 2, 4], [1, 3])  # the second share one shorter
    assert [g.request_index for g in firsts] == [0, 1, 2] and all(len(g.completion_ids) <= 5 for g in answers)
    by_prompt = dict(zip(first + second, [g.completion_ids for g in firsts + seconds], strict=True))
    assert [by_prompt[i] for i in alone] == [g.completion_ids for g in answers]  # greedy: the same answers
    assert len({tuple(g.completion_ids) for g in answers}) > 1  # not one answer for every prompt
