"""`vl_judge`: a VLM grades a caption against its image or video with CapRL++'s four-criterion JSON.

The judge answers JSON with factuality, temporal_alignment, coverage and hallucination_penalty
(1 = no hallucination) in [0, 1]; score = 0.30 F + 0.25 T + 0.25 C + 0.20 H (docs/reference.md §1).
Parsing: strip code fences, `json.loads`, else the text between the first `{` and the last `}`;
each criterion clipped to [0, 1]. Unparseable output scores 0, as in CapRL++, and is flagged by the
`parse_failed` component (also set when a criterion is missing or not a number; it then counts 0).
Videos are decoded here (`rl_data.media.sample_video`: `fps`, capped at `max_frames` frames of at
most `max_pixels` pixels each — CapRL++ had no cap). A sample with no media at all (no `video` or
`image` key, or an empty path: CapRL++'s client sends `video_path=""` for such samples) is judged
on its text alone, as CapRL++ does. A media file that is named but missing fails that sample
(CapRL++ would silently judge it text-only).

A video trainer's samples carry their frames, not a file (`metadata["video"]`: PIL images or an
array `[F, H, W, 3]`): at most `max_frames` of them are taken, evenly spaced with the first and
last kept, each fitted to `max_pixels`. A sample without a completion (a generated image or
video) is graded against its `prompt`, the description it was generated from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.scorers.engines import Engine, SamplingParams, judge_engine

try:
    import numpy as np

    from rl_data.media import fit_image, load_image, sample_video
    from rl_rewards.scorers.video import load_frames, spaced
except ImportError as e:  # pragma: no cover - the [hf] extra installs rl-data
    raise ImportError(f'vl_judge needs rl-data: pip install "rl-rewards[hf]"; in a clone of the repository: uv sync --all-packages --extra hf ({e})') from e

WEIGHTS = {"factuality": 0.30, "temporal_alignment": 0.25, "coverage": 0.25, "hallucination_penalty": 0.20}

PROMPT = """You are grading a caption of the {media} above. Score each criterion from 0 to 1:
- factuality: are the described objects, people, actions and attributes correct?
- temporal_alignment: are events, their [mm:ss] timestamps and their order right? (for an image: is the spatial layout right?)
- coverage: does the caption cover the important content?
- hallucination_penalty: 1 if the caption invents nothing, lower the more it invents.
Answer with JSON only: {{"factuality": x, "temporal_alignment": x, "coverage": x, "hallucination_penalty": x, "reason": "..."}}

Caption:
{caption}"""

_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def parse_judgement(text: str) -> tuple[dict[str, float], bool]:
    """(criteria clipped to [0, 1], parse_failed). Unparseable -> all 0 and failed."""
    body = _FENCE.sub("", text.strip())
    data: Any = None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        start, end = body.find("{"), body.rfind("}")
        if start >= 0 and end > start:
            try:
                data = json.loads(body[start : end + 1])
            except json.JSONDecodeError:
                data = None
    if not isinstance(data, dict):
        return dict.fromkeys(WEIGHTS, 0.0), True
    criteria, failed = {}, False
    for key in WEIGHTS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            criteria[key] = min(max(float(value), 0.0), 1.0)
        else:
            criteria[key], failed = 0.0, True
    return criteria, failed


def judgement_score(criteria: dict[str, float]) -> float:
    return sum(WEIGHTS[k] * criteria[k] for k in WEIGHTS)


class VLJudgeScorer:
    """Grades `Sample.completion` (the caption; without one, `Sample.prompt`) against
    `metadata["video"]` (a path, or the frames) or `metadata["image"]` (a path or PIL image) with
    a VLM `Engine` (e.g. HFEngine over Qwen-VL). Judge decoding is greedy by default."""

    name = "vl_judge"

    def __init__(
        self, engine: Engine, *, fps: float = 2.0, max_frames: int = 32, max_pixels: int | None = 448 * 448,
        temperature: float = 0.0, max_new_tokens: int = 256,
    ) -> None:
        self.engine = engine
        self.fps, self.max_frames, self.max_pixels = fps, max_frames, max_pixels
        self.params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)

    def _messages(self, sample: Sample) -> list[dict[str, Any]]:
        video, image = sample.metadata.get("video"), sample.metadata.get("image")
        parts: list[dict[str, Any]] = []
        if video is not None and not (isinstance(video, str) and not video):
            media, parts = "video", [{"type": "video", "video": self._frames(video)}]
        elif image is not None and image != "":
            media, parts = "image", [{"type": "image", "image": image if not isinstance(image, str) else load_image(image)}]
        else:  # no media: the caption alone, with the video wording of CapRL++'s text-only fallback
            media = "video"
        text = PROMPT.format(media=media, caption=sample.completion or sample.prompt)
        return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]

    def _frames(self, video: Any) -> Any:
        """A video file decoded at `fps` (`sample_video`), or a trainer's frames taken evenly
        (first and last kept), at most `max_frames`, each fitted to `max_pixels`: `[N, H, W, 3]`."""
        if isinstance(video, str):
            return sample_video(video, fps=self.fps, max_frames=self.max_frames, max_pixels=self.max_pixels).frames
        frames = load_frames({"video": video})  # RGB; an empty video raises
        kept = [frames[i] for i in spaced(len(frames), self.max_frames)]
        fitted = [fit_image(f, self.max_pixels) if self.max_pixels else f for f in kept]
        if len({f.size for f in fitted}) > 1:
            raise ValueError(f"the video's frames differ in size: {sorted({f.size for f in fitted})}")
        return np.stack([np.asarray(f) for f in fitted])  # [N, H, W, 3] uint8

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        requests, keep = [], []
        results: list[ScoreResult | None] = [None] * len(samples)
        for i, sample in enumerate(samples):
            try:
                requests.append(self._messages(sample))
                keep.append(i)
            except (ValueError, OSError) as e:
                results[i] = ScoreResult.failed(f"vl_judge: {e}")
        generations = self.engine.generate(requests, self.params) if requests else []
        for i, generation in zip(keep, generations, strict=True):
            criteria, failed = parse_judgement(generation.text)
            results[i] = ScoreResult(score=judgement_score(criteria), components={**criteria, "parse_failed": float(failed)})
        scored = [r for r in results if r is not None]
        if len(scored) != len(samples):  # every sample is scored or failed above
            raise RuntimeError(f"vl_judge: {len(samples) - len(scored)} samples got no result")
        return scored


def build_vl_judge(
    *, model: str, engine: str = "auto", engine_options: dict[str, Any] | None = None, fps: float = 2.0,
    max_frames: int = 32, max_pixels: int | None = 448 * 448, temperature: float = 0.0, max_new_tokens: int = 256,
) -> VLJudgeScorer:
    """`vl_judge` from a config: VLM checkpoint `model` served by `engine`."""
    return VLJudgeScorer(
        judge_engine(engine, model, engine_options, who="vl_judge"), fps=fps, max_frames=max_frames, max_pixels=max_pixels,
        temperature=temperature, max_new_tokens=max_new_tokens,
    )
