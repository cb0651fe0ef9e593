"""DAPO's soft overlong punishment over the trainer's token count (no model, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from rl_rewards.rules import overlong_punishment
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.length import WHITESPACE, load_token_counter

FIELD = "completion_tokens"


class OverlongScorer:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13; TRL's
    `get_soft_overlong_punishment`): 0 up to `max_length - cache` tokens, linear down to -1 at
    `max_length` (L_max), -1 beyond (`rl_rewards.rules.overlong_punishment`). Add it, weight 1,
    next to an outcome reward when completions run into the generation limit: a truncated answer
    then costs reward in proportion to how far it got into the last `cache` (L_cache) tokens,
    instead of being a noisy 0 of the outcome reward. DAPO: L_max = 20480 (the generation
    limit), L_cache = 4096.

    The count n is `sample.metadata["completion_tokens"]`, an int the trainer puts there: it has
    the generated token ids (TRL and DAPO count every generated token, EOS included). A sample
    without it fails, unless `tokenizer` is set (the `length` scorer's option: a transformers
    tokenizer path or hub id, or `"whitespace"`): the completion's text is then counted without
    special tokens, which misses the EOS and any re-tokenization drift. Component: `n_tokens`.
    """

    name = "overlong"

    def __init__(self, *, max_length: int, cache: int, tokenizer: str | None = None) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"overlong: option max_length (L_max, tokens) must be an int > 0, got {max_length!r}")
        if isinstance(cache, bool) or not isinstance(cache, int) or not 0 <= cache <= max_length:
            raise ValueError(f"overlong: option cache (L_cache, tokens) must be an int with 0 <= cache <= "
                             f"max_length={max_length}, got {cache!r}")
        self.max_length, self.cache = max_length, cache
        self.count = None if tokenizer is None else load_token_counter(tokenizer)
        self.inline = tokenizer in (None, WHITESPACE)  # a real tokenizer is a model-sized load

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        counts = [s.metadata.get(FIELD) for s in samples]
        if self.count is not None:
            missing = [i for i, n in enumerate(counts) if n is None]
            for i, n in zip(missing, self.count([samples[i].completion for i in missing]), strict=True):
                counts[i] = n
        return [self._one(n) for n in counts]

    def _one(self, n: object) -> ScoreResult:
        if n is None:
            return ScoreResult.failed(f"overlong: the sample has no metadata.{FIELD} (the completion's token count, "
                                      "which the trainer must put in the sample's metadata; or set option tokenizer)")
        if isinstance(n, bool) or not isinstance(n, Integral) or n < 0:  # numpy ints pass
            return ScoreResult.failed(f"overlong: metadata.{FIELD} must be an int >= 0, got {n!r}")
        score = overlong_punishment(int(n), self.max_length, self.cache)
        return ScoreResult(score=score, components={"n_tokens": float(n)})
