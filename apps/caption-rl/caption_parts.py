"""The pieces of the caption-rl recipe that are specific to captioning: records -> chat messages
with decoded media, the reward backends (in process / a running reward server), rollout
micro-batches and their log-probs under the training model, and the output files.

Everything generic (algorithms, checkpoints, logging, engines, scorers) comes from the packages.
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rl_core.logprobs import entropy
from rl_core.logprobs import token_logprobs as rl_token_logprobs
from rl_data import CaptionQARecord, format_question_text, load_image, read_caption_qa, sample_video
from rl_models.logprobs import (
    TokenBatch,
    final_hidden_states,
    token_logprobs_and_entropy,
    unwrap_peft,
)
from rl_rewards import Sample, ScoreResult, build_reward
from rl_rewards.client import RetryPolicy, RewardClient
from rl_rollout.prompts import EncodedPrompt, encode_prompt, pad_batch

_PLACEHOLDER = re.compile(r"<(image|video)>\n?")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model(path: str) -> str:
    """`tiny:<family>` -> a tiny random checkpoint built (and cached) by `rl_models.tiny`;
    anything else must be an existing folder or a hub id."""
    if path.startswith("tiny:"):
        from rl_models import tiny

        return str(tiny.build(path.removeprefix("tiny:")))
    if Path(path).exists() or _HUB_ID.fullmatch(path):
        return path
    raise FileNotFoundError(f"model not found: {path!r} is neither a local folder, a hub id (org/name) nor "
                            f"tiny:<family> (model.path / CAPTION_MODEL, reward.judge)")


# ------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class Dataset:
    train: list[CaptionQARecord]
    eval: list[CaptionQARecord]
    skipped: int  # records without QA / malformed, skipped and counted


def load_records(
    train_files: Sequence[str], eval_files: Sequence[str], *, eval_size: int, task: str, seed: int
) -> Dataset:
    """Read every file (bad records skipped and counted, with file and line in the log), keep the
    rows of `task`, and hold out `eval_size` train records when no eval file is given."""
    if not train_files:
        raise ValueError("data.train is empty: name at least one CapRL caption-QA file (or set DATASET)")
    skipped = 0

    def read(files: Sequence[str]) -> list[CaptionQARecord]:
        nonlocal skipped
        out = []
        for file in files:
            if not Path(file).is_file():
                raise FileNotFoundError(f"dataset file not found: {file} (data.train / data.eval / DATASET)")
            reader = read_caption_qa(file, on_error="skip")
            out += [r for r in reader if task == "auto" or r.kind == task]
            skipped += reader.skipped
        return out

    train, held = read(train_files), read(eval_files)
    if not held and eval_size > 0:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        picked = set(order[:eval_size])
        held = [r for i, r in enumerate(train) if i in picked]
        train = [r for i, r in enumerate(train) if i not in picked]
    if not train:
        raise ValueError(f"no usable {task if task != 'auto' else ''} training records in {list(train_files)} "
                         f"({skipped} skipped as malformed or without QA)")
    return Dataset(train, held, skipped)


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
                parts.append({"type": piece, piece: next(media[piece])})
            elif piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        messages.append({"role": message.role, "content": parts})
    rest = [{"type": kind, kind: item} for kind in ("image", "video") for item in media[kind]]
    user = next(m for m in messages if m["role"] == "user")
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
    With `spec` (a RewardSpec TOML), that reward scores every row instead."""

    def __init__(self, *, judge: str | None, spec: str | None, qa_estimator: str, qa_num: int, format_weight: float,
                 length_tokenizer: str, length_l1: int, length_l2: int, length_weight: float, seed: int) -> None:
        if spec is not None:
            if not Path(spec).is_file():
                raise FileNotFoundError(f"reward.spec file not found: {spec}")
            self.by_task = dict.fromkeys(("image", "video"), build_reward(spec))
            return
        from rl_rewards.scorers.caption_qa import CaptionQAScorer
        from rl_rewards.scorers.engines import load_engine, load_tokenizer

        engine, tokenizer = load_engine(judge), load_tokenizer(judge)
        length = {"scorer": "length", "weight": length_weight,
                  "options": {"tokenizer": length_tokenizer, "l1": length_l1, "l2": length_l2}}
        self.by_task = {}
        for task in ("image", "video"):
            components: dict[str, Any] = {"qa": {"scorer": "caption_qa"}, "length": length}
            if task == "video":
                components["format"] = {"scorer": "timestamp_format", "weight": format_weight}
            qa = CaptionQAScorer(engine, tokenizer, task=task, estimator=qa_estimator, qa_num=qa_num, seed=seed)
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
            raise ConnectionError(f"reward server {base} is not reachable ({type(e).__name__}: {e}); start it with "
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


def batched(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """`items` in consecutive chunks of `size` (itertools.batched is Python 3.12+)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass(frozen=True)
class Rollout:
    """One sampled caption and everything the update needs about it."""

    prompt: EncodedPrompt  # prompt ids + processor media tensors (pixel_values, grids)
    completion_ids: list[int]
    engine_logprobs: list[float]
    valid: bool  # False: the sample failed to score; it stays in the batch with weight 0


def placeholder_ids(config: Any) -> frozenset[int]:
    """Qwen-VL's vision placeholder tokens. A completion that samples one (a random or badly
    drifted policy can) would be read as an image slot by the model's forward: such rollouts
    are dropped from the update and counted (`response/placeholder_rows`)."""
    return frozenset(config.to_dict()[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id")
                     if config.to_dict().get(k) is not None)


def collate(rollouts: Sequence[Rollout], pad_id: int, placeholders: frozenset[int] = frozenset()) -> TokenBatch:
    """Rollouts as one `rl_models` TokenBatch: prompts left-padded (with their processor
    tensors), completions right-padded, every completion starting at column P. Vision
    placeholders sampled into a completion become `pad_id` (those rows are never trained on)."""
    prompts = pad_batch([r.prompt for r in rollouts], pad_id)
    width = max(len(r.completion_ids) for r in rollouts)
    completion = torch.full((len(rollouts), width), pad_id, dtype=torch.long)  # [B, C]
    completion_mask = torch.zeros(len(rollouts), width, dtype=torch.long)  # [B, C]
    for i, r in enumerate(rollouts):
        completion[i, : len(r.completion_ids)] = torch.tensor(
            [pad_id if tok in placeholders else tok for tok in r.completion_ids])
        completion_mask[i, : len(r.completion_ids)] = 1
    return TokenBatch.from_prompt_completion(prompts.input_ids, prompts.attention_mask, completion, completion_mask,
                                             **prompts.media)


class Policy(torch.nn.Module):
    """The trained model behind one forward that returns completion log-probs and entropies
    `[B, C]` (`rl_models.token_logprobs_and_entropy`: hidden states, then the LM head in chunks;
    the entropy carries no gradient). Handing this module to `accelerator.prepare` makes DDP/FSDP
    wrap the whole log-prob computation, so gradients are synchronized even though the logits
    never go through `model.forward`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_and_entropy(self.model, batch, temperature=temperature)  # [B, C] x2


@torch.no_grad()
def replay_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float,
                    rows_per_chunk: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs `[B, C]` and entropies `[B, C]` of softmax(logits / temperature),
    from the hidden states a few rows at a time (the full `[B, C, V]` never exists)."""
    hidden = final_hidden_states(model, batch)[:, batch.prompt_length - 1 : -1]  # [B, C, H]
    weight = unwrap_peft(model).get_output_embeddings().weight  # [V, H]
    logps, ents = [], []
    for start in range(0, hidden.shape[0], rows_per_chunk):
        logits = hidden[start : start + rows_per_chunk] @ weight.T / temperature  # [b, C, V]
        logps.append(rl_token_logprobs(logits, batch.completion_ids[start : start + rows_per_chunk]))  # [b, C]
        ents.append(entropy(logits))  # [b, C]
    mask = batch.completion_mask.float()  # [B, C]
    return torch.cat(logps) * mask, torch.cat(ents) * mask


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Right-pad 1-D per-token tensors into `[B, width]` (zeros)."""
    out = torch.zeros(len(rows), width)  # [B, C]
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def to_device(batch: TokenBatch, device: torch.device) -> TokenBatch:
    return replace(batch, **{k: v.to(device) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)})


def encode_rollout_prompt(messages: list[dict[str, Any]], processor: Any, index: int) -> EncodedPrompt:
    """The prompt exactly as the `hf` engine encodes it (same chat template and processor)."""
    return encode_prompt(messages, processor.tokenizer, processor, index)


# ----------------------------------------------------------------------------------- outputs


def append_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def plot_reward_curve(metrics_csv: Path, out: Path) -> None:
    """`reward_curve.png`: train reward per step and eval reward per eval, from metrics.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with metrics_csv.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("reward/mean", "-"), ("eval/reward/mean", "o--")):
        points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
