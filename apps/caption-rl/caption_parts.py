"""The pieces of the caption-rl recipe that are specific to captioning: records -> chat messages
with decoded media, and the reward backends (in process / a running reward server).

Everything generic (algorithms, checkpoints, logging, engines, scorers) comes from the packages.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rl_core.train import UserError
from rl_data import (
    CaptionQARecord,
    Location,
    format_question_text,
    load_image,
    open_source,
    sample_video,
)
from rl_rewards import Sample, ScoreResult, build_reward
from rl_rewards.client import RetryPolicy, RewardClient
from rl_rollout.prompts import EncodedPrompt, encode_prompt

_PLACEHOLDER = re.compile(r"<(image|video)>\n?")


def resolve_model(path: str, key: str = "model.path / CAPTION_MODEL") -> str:
    """`tiny:<family>` -> a tiny random checkpoint built (and cached) by `rl_models.tiny`;
    anything else must be an existing folder or a hub id (`rl_models.tiny.resolve`)."""
    from rl_models import tiny

    return tiny.resolve(path, key=key)


# ------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class Dataset:
    train: list[CaptionQARecord]
    eval: list[CaptionQARecord]
    skipped: int  # records without QA / malformed, skipped and counted
    train_where: list[Location]  # file and line of each train record (for errors found later)
    eval_where: list[Location]


def load_records(
    train_files: Sequence[str], eval_files: Sequence[str], *, eval_size: int, task: str, seed: int
) -> Dataset:
    """Read every source — a JSONL/parquet file, a `save_to_disk` directory or a Hub id in the
    local cache (bad records skipped and counted, with file and line or dataset and row in the
    log) — keep the rows of `task`, and hold out `eval_size` train records when no eval source is given."""
    if not train_files:
        raise UserError("data.train is empty: name at least one CapRL caption-QA file or dataset (or set DATASET)")
    skipped = 0

    def read(files: Sequence[str]) -> list[tuple[Location, CaptionQARecord]]:
        nonlocal skipped
        out = []
        for file in files:
            try:
                reader = open_source(file, kind="caption_qa", on_error="skip")
            except FileNotFoundError as e:
                detail = "" if str(e).startswith("data file not found") else f": {e}"  # why a dir / Hub id failed
                raise UserError(f"dataset file not found: {file} (data.train / data.eval / DATASET){detail}") from None
            except ValueError as e:  # an unsupported file type, a dataset with several splits
                raise UserError(f"{e} (data.train / data.eval / DATASET)") from None
            for where, r in reader.located():
                if task == "auto" or r.kind == task:
                    # a Hub id has no path: name it, so errors found later (media) still say where
                    out.append((where if where.path is not None else where._replace(path=Path(file)), r))
            skipped += reader.skipped
        return out

    train, held = read(train_files), read(eval_files)
    if not train:
        kind = f"{task} " if task != "auto" else ""
        raise UserError(f"no usable {kind}training records in {list(train_files)} ({skipped} skipped as malformed "
                        "or without QA; data.task selects image or video rows)")
    if not held and eval_size > 0:
        if eval_size >= len(train):
            raise UserError(f"data.eval_size={eval_size} would hold out all {len(train)} training records of "
                            f"{list(train_files)}: lower data.eval_size or give held-out files in data.eval")
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        picked = set(order[:eval_size])
        held = [r for i, r in enumerate(train) if i in picked]
        train = [r for i, r in enumerate(train) if i not in picked]
    return Dataset([r for _, r in train], [r for _, r in held], skipped, [w for w, _ in train], [w for w, _ in held])


def to_messages(record: CaptionQARecord, *, fps: float, max_frames: int, max_pixels: int) -> list[dict[str, Any]]:
    """verl-style `<image>`/`<video>` placeholders -> chat content parts holding the decoded media
    (PIL images, frame arrays at `fps`). Media without a placeholder go first in the first user turn."""
    images = [_fit(load_image(src), max_pixels) for src in record.images]
    videos = [sample_video(path, fps=fps, max_frames=max_frames, max_pixels=max_pixels).frames for path in record.videos]
    media = {"image": iter(images), "video": iter(videos)}
    messages = []
    for message in record.prompt:
        content = message.content
        if not isinstance(content, str):
            messages.append({"role": message.role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(_PLACEHOLDER.split(content)):
            if i % 2:
                item = next(media[piece], None)
                if item is None:
                    raise ValueError(f"more <{piece}> markers than {piece}s in the record")
                parts.append({"type": piece, piece: item})
            elif piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        messages.append({"role": message.role, "content": parts})
    rest = [{"type": kind, kind: item} for kind in ("image", "video") for item in media[kind]]
    user = next((m for m in messages if m["role"] == "user"), None)
    if user is None:
        raise ValueError("the prompt has no user turn")
    user["content"] = rest + user["content"]
    return messages


def _fit(image: Any, max_pixels: int) -> Any:
    if image.width * image.height <= max_pixels:
        return image
    scale = (max_pixels / (image.width * image.height)) ** 0.5
    return image.resize((max(28, int(image.width * scale)), max(28, int(image.height * scale))))


def prompt_text(record: CaptionQARecord) -> str:
    text = " ".join(m.content for m in record.prompt if isinstance(m.content, str))
    return _PLACEHOLDER.sub("", text).strip()


def qa_pairs(record: CaptionQARecord) -> list[tuple[str, str]]:
    """CapRL wire QA: `[(question_text with "   - A) ..." options, gold letter), ...]`."""
    return [(format_question_text(q.question, q.choices), q.answer_letter) for q in record.qa]


def make_sample(record: CaptionQARecord, caption: str) -> Sample:
    media = {"video": record.videos[0]} if record.videos else {"image": record.images[0].path or ""}
    return Sample(completion=caption, prompt=prompt_text(record), reference=qa_pairs(record),
                  metadata={"task": record.kind, "data_source": record.data_source, **media})


# ---------------------------------------------------------------------------------- rewards


class RewardUnavailable(RuntimeError):
    """The reward server failed after every retry: the step is skipped, never scored as zero."""


class LocalReward:
    """CapRL++'s reward in process: `caption_qa` (one shared judge engine, an image and a video
    prompt) + format_weight x `timestamp_format` (video rows) + length_weight x `length`.
    With `spec` (a RewardSpec TOML), that reward scores every row instead. `format_variant`,
    `answer_parser` and `qa_prompt_file` pick CapRL++'s server formulas (see the README)."""

    def __init__(self, *, judge: str | None, spec: str | None, qa_estimator: Literal["exact", "sample"],
                 qa_num: int, format_weight: float, length_tokenizer: str, length_l1: int, length_l2: int,
                 length_weight: float, seed: int, format_variant: str = "readme", format_min_brackets: int = 3,
                 answer_parser: Literal["strict", "caprl"] = "strict", qa_prompt_file: str | None = None) -> None:
        if spec is not None:
            if not Path(spec).is_file():
                raise UserError(f"reward.spec file not found: {spec}")
            self.by_task = dict.fromkeys(("image", "video"), build_reward(spec))
            return
        if judge is None:
            raise ValueError("LocalReward needs judge= (a judge model path) when spec= is None")
        from rl_rewards.scorers.caption_qa import CaptionQAScorer
        from rl_rewards.scorers.engines import load_engine, load_tokenizer

        engine, tokenizer = load_engine(judge), load_tokenizer(judge)
        length = {"scorer": "length", "weight": length_weight,
                  "options": {"tokenizer": length_tokenizer, "l1": length_l1, "l2": length_l2}}
        self.by_task = {}
        for task in ("image", "video"):
            components: dict[str, Any] = {"qa": {"scorer": "caption_qa"}, "length": length}
            if task == "video":
                components["format"] = {"scorer": "timestamp_format", "weight": format_weight, "options": {
                    "variant": format_variant, "min_brackets": format_min_brackets}}
            qa = CaptionQAScorer(engine, tokenizer, task=task, estimator=qa_estimator, qa_num=qa_num, seed=seed,
                                 answer_parser=answer_parser, prompt_template=qa_prompt_file)
            self.by_task[task] = build_reward({"components": components}, scorers={"qa": qa})

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        results: list[ScoreResult | None] = [None] * len(samples)
        for task, reward in self.by_task.items():
            todo = [i for i, s in enumerate(samples) if s.metadata["task"] == task]
            for i, result in zip(todo, reward.score([samples[i] for i in todo]), strict=True):
                results[i] = result
        return [r for r in results if r is not None]


class RemoteReward:
    """A running CapRL-protocol server (`rl-rewards serve`, or CapRL's own): POST /get_reward
    with `[caption, [[question_text, letter], ...]]`; it returns QA (+ weighted format, when the
    server runs with REWARD_TASK=video). The length reward is added here, as CapRL++ does on the
    training side. A server that is down at start is an error; one that fails mid-run is retried
    `retries` times, then `RewardUnavailable` skips the step."""

    def __init__(self, url: str, *, retries: int, timeout: float, length_tokenizer: str, length_l1: int,
                 length_l2: int, length_weight: float) -> None:
        self.url = url
        base = url.removesuffix("/").removesuffix("/get_reward")
        self.client = RewardClient(base, timeout=timeout, retry=RetryPolicy(attempts=retries))
        try:
            self.client.health()
        except Exception as e:  # httpx connection errors, bad JSON from a non-reward server
            raise UserError(f"reward server {base} is not reachable ({type(e).__name__}: {e}); start it with "
                                  f"`rl-rewards serve` or fix reward.url / REWARD_REMOTE_URL") from None
        spec = {"components": {"length": {"scorer": "length", "options": {
            "tokenizer": length_tokenizer, "l1": length_l1, "l2": length_l2}}}}
        self.length, self.length_weight = build_reward(spec), length_weight

    def score(self, samples: Sequence[Sample]) -> list[ScoreResult]:
        from rl_rewards.client import RewardClientError

        try:
            response = self.client.get_reward([(s.completion, list(s.reference)) for s in samples])
        except RewardClientError as e:
            raise RewardUnavailable(str(e)) from e
        errors = response.errors or [None] * len(samples)
        out = []
        for i, length in enumerate(self.length.score(samples)):
            if errors[i] is not None or length.score is None:
                out.append(ScoreResult.failed(errors[i] or length.error or "length failed"))
                continue
            components = {"qa": response.qa_rewards[i] if response.qa_rewards else response.rewards[i],
                          "length": length.score}
            if response.format_rewards:
                components["format"] = response.format_rewards[i]
            out.append(ScoreResult(score=response.rewards[i] + self.length_weight * length.score,
                                   components=components))
        return out


# --------------------------------------------------------------------------- rollout batches


def placeholder_ids(config: Any) -> frozenset[int]:
    """Qwen-VL's vision placeholder tokens. A completion that samples one (a random or badly
    drifted policy can) would be read as an image slot by the model's forward: such rollouts
    are dropped from the update and counted (`response/placeholder_rows`)."""
    return frozenset(config.to_dict()[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id")
                     if config.to_dict().get(k) is not None)


def encode_rollout_prompt(messages: list[dict[str, Any]], processor: Any, index: int) -> EncodedPrompt:
    """The prompt exactly as the `hf` engine encodes it (same chat template and processor)."""
    return encode_prompt(messages, processor.tokenizer, processor, index)
