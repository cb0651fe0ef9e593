"""Next-token sampling shared by the engines: temperature, top-k, top-p, seeded draws.

Log-probs follow the `Generation` contract (and vLLM's default `logprobs`): they are taken
under `softmax(logits / temperature)` over the full vocabulary, *before* top-k/top-p filtering,
so a teacher-forced forward pass at the same temperature reproduces them exactly and the
importance ratio of the first on-policy replay is 1. Filtering only restricts which tokens can
be drawn. Greedy decoding (`temperature == 0`) reports log-probs at temperature 1.
"""

from __future__ import annotations

import torch


def compute_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of `logits / temperature` in float32 (temperature 0 is treated as 1).

    logits: [..., V] -> [..., V]
    """
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)  # [..., V]


def compute_filtered_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus.

    Nucleus (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"): keep the
    smallest set of most likely tokens whose probability mass reaches `top_p`; the most likely
    token is always kept. `top_k=0` / `top_p=1.0` switch a filter off.

    logits: [B, V] (already divided by the temperature) -> [B, V]
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # [B, V]
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, V] mass of strictly better tokens
        drop_sorted = mass_before >= top_p  # [B, V]; first token has mass_before 0 -> kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [B, V]
        logits = logits.masked_fill(drop, float("-inf"))  # [B, V]
    return logits


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return `(tokens [B], logprobs [B])`.

    Sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1), as vLLM does):
    it equals a categorical draw, needs no host sync, and is reproducible from `generator`.

    logits: [B, V] raw model logits.
    """
    logprobs = compute_logprobs(logits, temperature)  # [B, V]
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)  # [B]
    else:
        filtered = compute_filtered_logits(logprobs, top_k, top_p)  # [B, V]
        probs = torch.softmax(filtered, dim=-1)  # [B, V]
        race = torch.empty_like(probs).exponential_(generator=generator)  # [B, V]
        tokens = torch.argmax(probs / race, dim=-1)  # [B]
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    return tokens, chosen
