"""CapRL++'s length reward over a named tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rl_rewards.rules import length_reward, whitespace_words
from rl_rewards.samples import Sample, ScoreResult

WHITESPACE = "whitespace"


def load_token_counter(tokenizer: str) -> Callable[[list[str]], list[int]]:
    """Token counter for `tokenizer`: a transformers tokenizer path or hub id (counted without
    special tokens, as CapRL++ does), or `"whitespace"` — words split on whitespace, an explicit
    approximation for when no tokenizer is at hand (it is not CapRL++'s count)."""
    if tokenizer == WHITESPACE:
        return lambda texts: [whitespace_words(text) for text in texts]  # = len(text.split())
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f'the length scorer needs transformers to load tokenizer {tokenizer!r}: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf '
            f'(or use tokenizer = "{WHITESPACE}")'
        ) from e
    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda texts: [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


class LengthScorer:
    """R_len of the completion: 1 up to `l1` tokens, linear to 0 at `l2` (CapRL++: the caption
    model's tokenizer, l1=2048, l2=3072, weight 0.2). The token count is reported as `n_tokens`."""

    name = "length"

    def __init__(self, *, tokenizer: str, l1: int = 2048, l2: int = 3072) -> None:
        length_reward(0, l1, l2)  # validates l1 < l2 at build time
        self.l1, self.l2 = l1, l2
        self.count = load_token_counter(tokenizer)
        self.inline = tokenizer == WHITESPACE  # a tokenizer is a model-sized load: not inline

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        counts = self.count([s.completion for s in samples])
        return [
            ScoreResult(score=length_reward(n, self.l1, self.l2), components={"n_tokens": float(n)}) for n in counts
        ]
