"""`ocr`: Flow-GRPO's OCR reward — does the generated image show the prompt's quoted text?

Text is recognized with rapidocr (its ONNX detection/recognition models ship inside the wheel,
so it runs offline) and compared with `rl_rewards.rules.ocr_similarity`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rl_rewards.rules import ocr_similarity
from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.media import load_image

try:
    from rapidocr import RapidOCR
except ImportError as e:
    raise ImportError(f'the ocr scorer needs rapidocr: pip install "rl-rewards[ocr]"; in a clone of the repository: uv sync --all-packages --extra ocr ({e})') from e


class _NoEmptyDetectionWarning(logging.Filter):
    """Drops rapidocr's "The text detection result is empty" warning, logged for every image
    without text: for this reward that is an ordinary outcome (similarity 0), and a run of
    random images printed one line per image. Every other rapidocr record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "text detection result is empty" not in record.getMessage()


logging.getLogger("RapidOCR").addFilter(_NoEmptyDetectionWarning())


def quoted_target(prompt: str) -> str | None:
    """Text between the first pair of double quotes (Flow-GRPO: `prompt.split('"')[1]`)."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


class OcrScorer:
    """Scores `Sample.metadata["image"]` (path or PIL image) against the target text: the
    prompt's first double-quoted span, else `Sample.reference` (a string). The recognized text
    is the concatenation of rapidocr's lines in reading order."""

    name = "ocr"

    def __init__(self) -> None:
        self.engine = RapidOCR()

    def recognize(self, image) -> str:
        output = self.engine(image)
        # rapidocr types the result of every stage combination; the default det+cls+rec
        # pipeline returns a RapidOCROutput, which has `txts`
        return "".join(output.txts or ())  # type: ignore[union-attr]

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        return [self._one(sample) for sample in samples]

    def _one(self, sample: Sample) -> ScoreResult:
        target = quoted_target(sample.prompt)
        if target is None:
            if not isinstance(sample.reference, str):
                return ScoreResult.failed('ocr: no target text: the prompt has no "quoted" span and Sample.reference is not a string')
            target = sample.reference
        try:
            text = self.recognize(load_image(sample.metadata))
            return ScoreResult(score=ocr_similarity(target, text))
        except (ValueError, OSError) as e:
            return ScoreResult.failed(f"ocr: {e}")
