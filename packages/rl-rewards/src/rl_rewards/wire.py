"""The one wire schema of the reward server, imported by both server and client.

Three HTTP protocols share it:

- **CapRL** (`POST /get_reward`): the request/response shapes of the CapRL++ reward service, so a
  CapRL training script works unchanged. A qa request is
  `{"prompts": [[caption, [[question_text, answer_letter], ...]], ...], "query": [], "labels": []}`;
  a vl_judge request is `{"score_mode": "vl_judge", "samples": [{"caption", "video_path"}]}`.
- **OpenRLHF** remote reward model (`POST /openrlhf/get_reward`):
  `{"query", "prompts", "labels"}` -> `{"rewards", "scores", "extra_logs"}`.
- **native** (`POST /v1/score`): samples plus the name of a configured reward -> one
  `ScoreResult` per sample (score, components, error).

Schema evolution follows msgspec's notes: every Struct is `kw_only`, new fields get defaults and
go last, and responses use `omit_defaults` so a field a CapRL client never asked for is absent.
Router <-> worker messages are a tagged union (`WorkRequest`), sent as msgpack.

One encoder and one decoder per type per process: use `encode_json`, `decode_json`,
`encode_msgpack`, `decode_msgpack` rather than building new ones.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from rl_rewards.samples import Sample, ScoreResult

T = TypeVar("T")

# ----------------------------------------------------------------------------- CapRL /get_reward

QAItem = tuple[str, str]
"""CapRL's `[question_text, answer_letter]`: the question then one option per line
(`   - X) option text`), and the gold letter."""

CaptionQA = tuple[str, list[QAItem]]
"""CapRL's `[caption, [[question_text, answer_letter], ...]]`."""


class VLJudgeSample(msgspec.Struct, kw_only=True, frozen=True):
    """One vl_judge sample. `video_path` must resolve inside the server's media roots; an empty
    one means the sample has no video (the judge grades the caption text alone, as in CapRL++)."""

    caption: str
    video_path: str


class GetRewardRequest(msgspec.Struct, kw_only=True):
    """CapRL `POST /get_reward`. A qa request fills `prompts`; a vl_judge request sets
    `score_mode="vl_judge"` and fills `samples`. `score_mode` overrides the server's
    `REWARD_SCORE_MODE`; `query` and `labels` are accepted and unused, as in CapRL."""

    prompts: list[CaptionQA] = []
    query: list[Any] = []
    labels: list[Any] = []
    score_mode: Literal["qa", "vl_judge"] | None = None
    samples: list[VLJudgeSample] = []


class GetRewardResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """CapRL's response: `rewards` always; `qa_rewards`/`format_rewards` (qa) or `judge_rewards`
    (vl_judge) when computed. `errors` (extension) is present only when a sample failed: that
    sample's reward is 0.0 and `errors[i]` says why; the other samples are unaffected."""

    rewards: list[float]
    qa_rewards: list[float] | None = None
    format_rewards: list[float] | None = None
    judge_rewards: list[float] | None = None
    errors: list[str | None] | None = None


# ----------------------------------------------------------------------------- OpenRLHF


class OpenRLHFRequest(msgspec.Struct, kw_only=True):
    """OpenRLHF remote RM request. `query[i]` is prompt + response with template tokens;
    when `prompts[i]` is a prefix of `query[i]` the completion is the rest, else the whole query.
    `labels[i]` becomes the sample's reference."""

    query: list[str]
    prompts: list[str] = []
    labels: list[Any] = []


class OpenRLHFResponse(msgspec.Struct, kw_only=True):
    """`rewards` and `scores` are equal (OpenRLHF uses `rewards` for advantages and logs `scores`);
    `extra_logs` maps `failed` (1.0 for a failed sample, else 0.0) and each of the reward's
    component keys to one value per sample — the same keys in every response, failed samples
    included (0.0), since OpenRLHF sends one query per request and requires every sample of a
    batch to carry every key."""

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]] = {}


# ----------------------------------------------------------------------------- native /v1/score


class ScoreRequest(msgspec.Struct, kw_only=True):
    """Native request: the samples and the name of a reward configured on the server
    (`GET /health` lists them). An empty `reward` means the server's default reward."""

    samples: list[Sample]
    reward: str = ""


class ScoreResponse(msgspec.Struct, kw_only=True):
    reward: str
    results: list[ScoreResult]


# ----------------------------------------------------------------------------- health / errors


class HealthResponse(msgspec.Struct, kw_only=True):
    """`ready` is true only once every configured scorer is loaded on every worker."""

    ready: bool
    rewards: list[str] = []
    score_mode: str = ""
    judge: str | None = None
    workers: int = 0
    workers_alive: int = 0
    pid: int = 0  # the server process that answered (several share the port with --http-processes)
    keys: dict[str, list[str]] = {}
    """Per reward, the component keys every result carries (also for failed samples)."""
    default_reward: str = ""
    error: str | None = None
    """Why the rewards could not be loaded (what was tried); null while loading and once ready.
    `rl-rewards serve` exits with status 1 right after such a failure."""
    judge_engine: str | None = None
    """The CapRL judge's engine (`hf` | `vllm`; `auto` resolved when the server started, or
    `auto` under `--ray`, where each actor resolves it); null without a judge."""


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every 4xx/5xx body, always with all three keys. `field` is the JSON path of the offending
    value (`$.prompts[0][1]`), `limit` names the limit that was exceeded (`max_body_bytes`); each
    is null when the error is not about one (a 503 while loading, an unknown route)."""

    error: str
    field: str | None = None
    limit: str | None = None


# ----------------------------------------------------------------------------- router <-> worker


class ScoreChunk(msgspec.Struct, kw_only=True, tag="score"):
    """Score `samples` with the worker's reward named `reward`."""

    id: int
    reward: str
    samples: list[Sample]


class Ping(msgspec.Struct, kw_only=True, tag="ping"):
    id: int


WorkRequest = ScoreChunk | Ping


class WorkReply(msgspec.Struct, kw_only=True):
    """A worker's answer to one `WorkRequest`. `error` is set when the whole chunk failed
    (the router then retries it elsewhere); per-sample failures live in `results`."""

    id: int
    results: list[ScoreResult] = []
    error: str | None = None
    rewards: list[str] = []


# ----------------------------------------------------------------------------- codecs

_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_JSON_DECODERS: dict[Any, msgspec.json.Decoder] = {}
_MSGPACK_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def encode_json(obj: Any) -> bytes:
    return _JSON_ENCODER.encode(obj)


def decode_json(data: bytes, kind: type[T]) -> T:
    """Decode JSON into `type`; raises msgspec.DecodeError / ValidationError (with the JSON path)."""
    decoder = _JSON_DECODERS.get(kind)
    if decoder is None:
        decoder = _JSON_DECODERS[kind] = msgspec.json.Decoder(kind)
    return decoder.decode(data)


def encode_msgpack(obj: Any) -> bytes:
    return _MSGPACK_ENCODER.encode(obj)


def decode_msgpack(data: bytes, kind: Any) -> Any:
    decoder = _MSGPACK_DECODERS.get(kind)
    if decoder is None:
        decoder = _MSGPACK_DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    return decoder.decode(data)


def validation_path(error: msgspec.ValidationError) -> str:
    """The `$.a[0].b` path msgspec puts at the end of a ValidationError message; `$` (the whole
    document) when it names none."""
    message = str(error)
    marker = " - at `"
    if marker not in message:
        return "$"
    return message.rsplit(marker, 1)[1].rstrip("`")
