"""`embedding_similarity`: VeRL-with-RMs' BGE similarity reward.

Cosine similarity s of the L2-normalized embeddings of the completion and the reference answer
(`Sample.reference`, a string), mapped with `rl_rewards.rules.embedding_similarity_map`; the raw
cosine is reported as the `cosine` component. VeRL-with-RMs' trainer then adds
bge_weight * (0.7 * mapped + 0.3): set `scale=0.7, offset=0.3` (and the weight in the spec)
to reproduce it.

VeRL-with-RMs compares the `"Response"` field of the completion's JSON with the one of the
reference (a JSON string) and scores 0.0 when either does not parse: set
`completion_field="Response", reference_field="Response"` (`rules.json_field`); such samples
score `on_malformed` (0.0; None makes them errors) with the `malformed` component 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rl_rewards.rules import embedding_similarity_map, json_field
from rl_rewards.samples import Sample, ScoreResult

try:
    from rl_models.encoders import compute_text_embeddings, load_embedding_model
    from rl_models.loading import default_device
    from rl_models.tiny import resolve
except ImportError as e:
    raise ImportError(f'embedding_similarity needs torch, transformers and rl-models: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf ({e})') from e


class EmbeddingSimilarityScorer:
    """pooling: `cls` for BGE (the default), `mean` for mean-pooled encoders (E5, MiniLM).
    completion_field/reference_field/on_malformed: compare one JSON field (module docstring)."""

    name = "embedding_similarity"

    def __init__(
        self, *, model: str, pooling: Literal["cls", "mean"] = "cls", scale: float = 1.0, offset: float = 0.0,
        max_length: int = 512, device: str | None = None, completion_field: str | None = None,
        reference_field: str | None = None, on_malformed: float | None = 0.0,
    ) -> None:
        if pooling not in ("cls", "mean"):
            raise ValueError(f"embedding_similarity: pooling must be 'cls' or 'mean', got {pooling!r}")
        self.encoder = load_embedding_model(resolve(model, key="model"), device=device or default_device())
        self.pooling, self.scale, self.offset, self.max_length = pooling, scale, offset, max_length
        self.completion_field, self.reference_field, self.on_malformed = completion_field, reference_field, on_malformed
        self.fields = completion_field is not None or reference_field is not None

    def _texts(self, sample: Sample) -> tuple[str, str]:
        """(completion text, reference text) to compare; ValueError names what is malformed."""
        if not isinstance(sample.reference, str):
            raise TypeError("embedding_similarity: Sample.reference must be the reference text")
        completion, reference = sample.completion, sample.reference
        if self.completion_field is not None:
            completion = json_field(completion, self.completion_field)
        if self.reference_field is not None:
            try:
                reference = json_field(reference, self.reference_field)
            except ValueError as e:
                raise ValueError(f"reference: {e}") from None
        return completion, reference

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        results: list[ScoreResult] = [ScoreResult(score=None)] * len(samples)
        keep, pairs = [], []
        for i, sample in enumerate(samples):
            try:
                pairs.append(self._texts(sample))
                keep.append(i)
            except TypeError as e:
                results[i] = ScoreResult.failed(str(e))
            except ValueError as e:
                results[i] = (
                    ScoreResult.failed(f"embedding_similarity: {e}") if self.on_malformed is None
                    else ScoreResult(score=self.on_malformed, components={"cosine": 0.0, "malformed": 1.0})
                )
        if not keep:
            return results
        texts = [c for c, _ in pairs] + [r for _, r in pairs]
        emb = compute_text_embeddings(self.encoder, texts, pooling=self.pooling, max_length=self.max_length)  # [2N, H]
        cos = (emb[: len(keep)] * emb[len(keep) :]).sum(-1).tolist()  # [N]
        for i, s in zip(keep, cos, strict=True):
            value = self.scale * embedding_similarity_map(s) + self.offset
            components = {"cosine": s, "malformed": 0.0} if self.fields else {"cosine": s}
            results[i] = ScoreResult(score=value, components=components)
        return results
