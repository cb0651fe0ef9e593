"""Image rewards on CLIP: `clip_score` (CLIPScore) and `aesthetic` (LAION aesthetic predictor).

Flow-GRPO/VRL combine these with OCR as a weighted sum (docs/reference.md §2). Both read the image
from `Sample.metadata["image"]` (path or PIL image); a missing image fails that sample only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.media import load_image

try:
    import torch

    from rl_models.encoders import load_clip
    from rl_models.loading import default_device
    from rl_models.tiny import resolve
except ImportError as e:
    raise ImportError(f'clip_score/aesthetic need torch, transformers and rl-models: pip install "rl-rewards[vision]"; in a clone of the repository: uv sync --all-packages --extra vision ({e})') from e


def score_images(samples: Sequence[Sample], values: Callable[[Sequence[Sample], list], list[float]]) -> list[ScoreResult]:
    """Load every sample's image (a missing one fails that sample), score the rest in one batch."""
    images, keep, failed = [], [], {}
    for i, sample in enumerate(samples):
        try:
            images.append(load_image(sample.metadata))
            keep.append(i)
        except (ValueError, OSError) as e:
            failed[i] = ScoreResult.failed(f"image: {e}")
    scored = values([samples[i] for i in keep], images) if images else []
    results = dict(zip(keep, (ScoreResult(score=v) for v in scored), strict=True))
    return [failed[i] if i in failed else results[i] for i in range(len(samples))]


class _ClipBase:
    def __init__(self, model: str, device: str | None) -> None:
        self.clip, self.processor = load_clip(resolve(model, key="model"), device=device or default_device())
        self.device = self.clip.device

    @torch.no_grad()
    def image_embeddings(self, images: list) -> torch.Tensor:
        """L2-normalized projected image embeddings `[N, D]` (float32)."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device, self.clip.dtype)
        pooled = self.clip.vision_model(pixel_values=pixels).pooler_output  # [N, H]
        return torch.nn.functional.normalize(self.clip.visual_projection(pooled).float(), dim=-1)  # [N, D]

    @torch.no_grad()
    def text_embeddings(self, texts: list[str]) -> torch.Tensor:
        """L2-normalized projected text embeddings `[N, D]` (float32); truncated to CLIP's 77 tokens."""
        enc = self.processor(text=texts, return_tensors="pt", padding=True, truncation=True).to(self.device)
        pooled = self.clip.text_model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).pooler_output
        return torch.nn.functional.normalize(self.clip.text_projection(pooled).float(), dim=-1)  # [N, D]



class ClipScorer(_ClipBase):
    """CLIPScore (Hessel et al., 2021): `weight * max(cos(image, text), 0)`, weight 2.5.

    `text`: which text describes the image — `prompt` for text-to-image policies (the default),
    `completion` for captioners (the caption describes `metadata["image"]`).
    """

    name = "clip_score"

    def __init__(self, *, model: str, text: Literal["prompt", "completion"] = "prompt", weight: float = 2.5,
                 device: str | None = None) -> None:
        if text not in ("prompt", "completion"):
            raise ValueError(f"clip_score: text must be 'prompt' or 'completion', got {text!r}")
        super().__init__(model, device)
        self.text, self.weight = text, weight

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return score_images(samples, self.values)

    def values(self, samples: Sequence[Sample], images: list) -> list[float]:
        texts = [s.prompt if self.text == "prompt" else s.completion for s in samples]
        cos = (self.image_embeddings(images) * self.text_embeddings(texts)).sum(-1)  # [N]
        return (self.weight * cos.clamp(min=0)).tolist()


def laion_head(dim: int) -> torch.nn.Module:
    """The LAION aesthetic predictor MLP (`improved-aesthetic-predictor`): dim -> 1024 -> 128 ->
    64 -> 16 -> 1, with its dropout layers (inactive in eval), state-dict keys `layers.N.*`."""
    head = torch.nn.Module()
    head.layers = torch.nn.Sequential(
        torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1),
    )
    head.forward = head.layers.forward
    return head


class AestheticScorer(_ClipBase):
    """LAION aesthetic score (about 1-10 with the real head) of the image: the MLP head on the
    L2-normalized CLIP image embedding (ViT-L/14 for the published `sac+logos+ava1-l14-linearMSE`
    head). `head`: the head's weights (`.pth` state dict or `.safetensors`); without it the head is
    randomly initialized from `seed` — only useful for tests and shape checks, not as a reward.
    """

    name = "aesthetic"

    def __init__(self, *, model: str, head: str | None = None, seed: int = 0, device: str | None = None) -> None:
        super().__init__(model, device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            dim = self.clip.config.projection_dim
            if dim is None:
                raise ValueError(f"{model}: its CLIP config has no projection_dim for the aesthetic head")
            self.head = laion_head(dim)
        if head is not None:
            self.head.load_state_dict(_load_state_dict(head))
        self.head.to(self.device).eval()

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return score_images(samples, self.values)

    @torch.no_grad()
    def values(self, samples: Sequence[Sample], images: list) -> list[float]:
        return self.head(self.image_embeddings(images)).squeeze(-1).tolist()  # [N]


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)
