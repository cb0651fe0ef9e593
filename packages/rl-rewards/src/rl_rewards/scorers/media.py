"""Reading the image a sample refers to (`Sample.metadata["image"]`: a path or a PIL image), and
`brightness`, the image reward that needs nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_rewards.samples import Sample, ScoreResult

try:
    from PIL import Image, ImageStat
except ImportError as e:
    raise ImportError(f'image scorers need pillow: pip install "rl-rewards[ocr]" or "rl-rewards[vision]"; in a clone of the repository: uv sync --all-packages --extra ocr or --extra vision ({e})') from e


def load_image(metadata: dict[str, Any]) -> Image.Image:
    """The sample's image as RGB; a missing key or file is a clear per-sample error."""
    if "image" not in metadata:
        raise ValueError(f"no image: Sample.metadata has no 'image' (keys: {sorted(metadata)})")
    image = metadata["image"]
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    path = Path(image)
    if not path.is_file():
        raise FileNotFoundError(f"image file {str(path)!r} does not exist")
    with Image.open(path) as opened:
        return opened.convert("RGB")


class BrightnessScorer:
    """Mean grey level of `Sample.metadata["image"]` in [0, 1]. Choose it to check that an image
    trainer learns at all (a tiny random model can brighten its images in minutes on a CPU);
    it rewards nothing a person wants."""

    name = "brightness"

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        results = []
        for sample in samples:
            try:
                grey = load_image(sample.metadata).convert("L")
                results.append(ScoreResult(score=ImageStat.Stat(grey).mean[0] / 255))
            except (ValueError, OSError) as e:
                results.append(ScoreResult.failed(f"brightness: {e}"))
        return results
