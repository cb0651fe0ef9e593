"""The one interface every generation engine implements (`hf`, `vllm`, `openai`).

Trainers call `generate` for policy rollouts; reward scorers call `score_next_tokens` for
"which option letter comes next?" questions. An engine never sees a config object: builders
pass flat keyword arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeGuard, runtime_checkable

import msgspec
import torch

# A prompt is token ids, plain text, or chat messages (OpenAI/transformers style, where a
# message's content may hold {"type": "image", "image": ...} / {"type": "video", ...} parts).
Prompt = list[int] | str | list[dict[str, Any]]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Continuation:
    """A request that resumes a sample: `prompt` as the engine encodes it, then the `prefix`
    tokens already sampled (by earlier weights), then new tokens. The generation's
    `completion_ids` and `logprobs` hold the new tokens only and count against
    `max_new_tokens`; its `prompt_ids` end with `prefix`. Partial rollouts
    (`rl_rollout.partial`) continue unfinished samples with a newer policy this way; `hf` and
    `vllm` take it (vLLM's prefix cache keeps the re-read prompt cheap)."""

    prompt: Prompt
    prefix: list[int]


def is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    """`prompt` is a list of token ids (an empty list counts: callers reject it where it matters)."""
    return isinstance(prompt, list) and all(isinstance(tok, int) for tok in prompt)


def is_chat_messages(prompt: Prompt) -> TypeGuard[list[dict[str, Any]]]:
    """`prompt` is a list of chat messages (an empty list counts, as in `is_token_ids`)."""
    return isinstance(prompt, list) and all(isinstance(msg, dict) for msg in prompt)


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How to sample. Unknown fields are rejected (`msgspec.convert(d, SamplingParams)`).

    `temperature=0` means greedy. `top_k=0` and `top_p=1.0` switch those filters off.
    `stop` holds strings that end a completion (the stop string is kept out of `text`).
    `seed` makes sampling deterministic for a given engine, batch and prompt order.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


class Generation(msgspec.Struct, kw_only=True, frozen=True):
    """One sampled completion.

    `logprobs[i]` is the log-probability of `completion_ids[i]` under the distribution the
    token was actually drawn from (temperature applied; top-k/top-p filtering NOT applied, as in
    vLLM's default `logprobs`), so a teacher-forced recomputation at the same temperature
    reproduces it.
    """

    request_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    token_versions: list[int] = []  # partial rollouts: the weight version that sampled each token


@runtime_checkable
class Engine(Protocol):
    """A generation engine. `generate` returns `len(requests) * params.n` generations, request
    major: all `n` samples of request 0, then request 1, ...; an empty request list returns [].

    `state`: "awake" (ready), "asleep" (accelerator memory released by `sleep`), "closed", or
    "remote" (the model lives in another process: `sleep`/`wake` do nothing here)."""

    @property
    def state(self) -> str: ...

    def generate(self, requests: Sequence[Prompt], params: SamplingParams) -> list[Generation]: ...

    def score_next_tokens(
        self,
        shared_prefix: list[int],
        suffixes: Sequence[list[int]],
        candidates: Sequence[int],
        *,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Log-probs `[len(suffixes), len(candidates)]` of each candidate token right after
        `shared_prefix + suffixes[i]`, under softmax(logits / temperature) over the full vocab.
        The prefix is computed once per call and reused for every suffix."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Copy `(hf_name, tensor)` pairs into the served model in place; `version` (default: the
        previous one + 1) is kept in `weight_version`, so a trainer can check which optimizer step
        its rollouts were sampled with."""
        ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class BatchScoringEngine(Protocol):
    """An engine that also scores many `(shared_prefix, suffixes)` items in one call (`hf`).

    Callers with several prefixes (a caption-QA reward over a batch of captions) should check
    `isinstance(engine, BatchScoringEngine)` and pass every item at once: the engine can then
    batch the prefixes of different items into the same forwards.
    """

    def score_next_tokens_batch(
        self,
        items: Sequence[tuple[list[int], Sequence[list[int]]]],
        candidates: Sequence[int],
        *,
        temperature: float = 1.0,
    ) -> list[torch.Tensor]:
        """For each item, log-probs `[len(suffixes), len(candidates)]` of each candidate right
        after `prefix + suffixes[j]` (as `Engine.score_next_tokens`, item by item)."""
        ...


def generate_seeded(engine: Engine, requests: Sequence[Prompt], params: SamplingParams,
                    seeds: Sequence[int]) -> list[Generation]:
    """`engine.generate` with each request sampled from its own seed (`params.n` samples each,
    request-major, `request_index` into `requests`): the same samples whatever the batch a
    request lands in, so a trainer's rollouts do not depend on its process count or batch split.
    One engine call per request: slower than one call per batch."""
    if len(seeds) != len(requests):
        raise ValueError(f"got {len(seeds)} seeds for {len(requests)} requests")
    own = getattr(engine, "generate_seeded", None)  # an engine that spreads the requests itself (Ray actors)
    if own is not None:
        return list(own(requests, params, seeds))
    return [msgspec.structs.replace(g, request_index=i) for i, (request, seed) in enumerate(zip(requests, seeds, strict=True))
            for g in engine.generate([request], msgspec.structs.replace(params, seed=seed))]
