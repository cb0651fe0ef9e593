from __future__ import annotations

import math

import torch

from rl_rollout.sampling import compute_filtered_logits, compute_logprobs, sample_next_tokens


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    out = compute_filtered_logits(logits, top_k=2, top_p=1.0)
    assert torch.isinf(out[0, [0, 3]]).all() and out[0, 1] == 4.0 and out[0, 2] == 3.0


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probs 0.5, 0.3, 0.2: top_p=0.6 needs the first two (0.5 < 0.6), top_p=0.5 only the first.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isfinite(compute_filtered_logits(logits, 0, 0.6)).tolist() == [[True, True, False]]
    assert torch.isfinite(compute_filtered_logits(logits, 0, 0.5)).tolist() == [[True, False, False]]
    assert torch.isfinite(compute_filtered_logits(logits, 0, 0.01)).tolist() == [[True, False, False]]


def test_logprobs_are_unfiltered_and_tempered() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])  # probs 1/4, 3/4 at temperature 1
    tokens, lps = sample_next_tokens(logits, temperature=1.0, top_k=1)
    assert tokens.tolist() == [1]  # top-1 can only draw the larger one
    assert abs(lps.item() - math.log(0.75)) < 1e-6  # ... but reports its unfiltered log-prob
    # temperature 0.5 squares the odds: 1 : 9 -> p = 0.9
    expected = compute_logprobs(logits, 0.5)[0, 1].item()
    assert abs(expected - math.log(0.9)) < 1e-6


def test_greedy_reports_temperature_one_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, lps = sample_next_tokens(logits, temperature=0.0)
    assert tokens.tolist() == [0]
    assert abs(lps.item() - torch.log_softmax(logits, -1)[0, 0].item()) < 1e-6


def test_draws_follow_the_distribution_and_the_seed() -> None:
    logits = torch.tensor([0.1, 0.2, 0.7]).log().expand(20000, 3)
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample_next_tokens(logits, temperature=1.0, generator=gen)
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.015)
    again, _ = sample_next_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)
