"""`embedding_similarity`: VeRL-with-RMs' BGE similarity reward.

Cosine similarity s of the L2-normalized embeddings of the completion and the reference answer
(`Sample.reference`, a string), mapped with `rl_rewards.rules.embedding_similarity_map`; the raw
cosine is reported as the `cosine` component. VeRL-with-RMs' trainer then adds
bge_weight * (0.7 * mapped + 0.3): set `scale=0.7, offset=0.3` (and the weight in the spec)
to reproduce it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rl_rewards.rules import embedding_similarity_map
from rl_rewards.samples import Sample, ScoreResult

try:
    from rl_models.encoders import compute_text_embeddings, load_embedding_model
    from rl_models.loading import default_device
except ImportError as e:
    raise ImportError(f'embedding_similarity needs torch, transformers and rl-models: pip install "rl-rewards[hf]" ({e})') from e


class EmbeddingSimilarityScorer:
    """pooling: `cls` for BGE (the default), `mean` for mean-pooled encoders (E5, MiniLM)."""

    name = "embedding_similarity"

    def __init__(
        self, *, model: str, pooling: Literal["cls", "mean"] = "cls", scale: float = 1.0, offset: float = 0.0,
        max_length: int = 512, device: str | None = None,
    ) -> None:
        if pooling not in ("cls", "mean"):
            raise ValueError(f"embedding_similarity: pooling must be 'cls' or 'mean', got {pooling!r}")
        self.encoder = load_embedding_model(model, device=device or default_device())
        self.pooling, self.scale, self.offset, self.max_length = pooling, scale, offset, max_length

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        keep = [i for i, s in enumerate(samples) if isinstance(s.reference, str)]
        results = [ScoreResult.failed("embedding_similarity: Sample.reference must be the reference text")] * len(samples)
        if not keep:
            return results
        texts = [samples[i].completion for i in keep] + [samples[i].reference for i in keep]
        emb = compute_text_embeddings(self.encoder, texts, pooling=self.pooling, max_length=self.max_length)  # [2N, H]
        cos = (emb[: len(keep)] * emb[len(keep) :]).sum(-1).tolist()  # [N]
        for i, s in zip(keep, cos, strict=True):
            value = self.scale * embedding_similarity_map(s) + self.offset
            results[i] = ScoreResult(score=value, components={"cosine": s})
        return results
