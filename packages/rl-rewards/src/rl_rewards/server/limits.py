"""Request safety: bearer-token auth, body/batch/text limits, and media-root confinement.

Every check raises `HTTPProblem`, which the app turns into a JSON `ErrorResponse` naming the
field or the limit. Media paths in a request are resolved (symlinks and `..` included) and must
land inside one of the configured `--media-root`s; with none configured, no request may name a
file at all.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.requests import Request

from rl_rewards import wire
from rl_rewards.samples import Sample
from rl_rewards.server.settings import LimitSettings

MEDIA_KEYS = ("image", "images", "video", "videos", "image_path", "video_path")


class HTTPProblem(Exception):
    def __init__(self, status: int, error: str, field: str | None = None, limit: str | None = None):
        super().__init__(error)
        self.status = status
        self.error = error
        self.field = field
        self.limit = limit


def check_api_key(api_key: str | None) -> None:
    """ValueError for a key that would not protect anything: empty or blank (an empty bearer
    token would match it), or padded with whitespace (a bearer token cannot carry it)."""
    if api_key is None:
        return
    if not api_key.strip():
        raise ValueError(
            "api_key is empty or blank, which would let any request in: set --api-key / REWARD_API_KEY to a "
            "secret (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), or unset it to serve "
            "without auth"
        )
    if api_key != api_key.strip():
        raise ValueError("api_key starts or ends with whitespace, which no bearer token can match: strip it")


def check_auth(request: Request, api_key: str | None) -> None:
    """With an API key configured, require `Authorization: Bearer <key>` (constant-time compare)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise HTTPProblem(401, "missing or wrong bearer token: send 'Authorization: Bearer <api key>'")


async def read_body(request: Request, limits: LimitSettings) -> bytes:
    """The request body, refusing (413) anything over `max_body_bytes` before reading it all."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPProblem(413, f"body of {declared} bytes exceeds max_body_bytes={limit}", limit="max_body_bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPProblem(413, f"body exceeds max_body_bytes={limit}", limit="max_body_bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def check_batch(n: int, field: str, limits: LimitSettings) -> None:
    if n > limits.max_batch_samples:
        raise HTTPProblem(
            422, f"{n} samples exceed max_batch_samples={limits.max_batch_samples}; split the request",
            field=field, limit="max_batch_samples",
        )


def check_texts(texts: Iterable[tuple[str, str]], limits: LimitSettings) -> None:
    """`texts` yields (json path, text); the first one over `max_text_chars` is a 422."""
    limit = limits.max_text_chars
    for path, text in texts:
        if len(text) > limit:
            raise HTTPProblem(
                422, f"{path} has {len(text)} characters, more than max_text_chars={limit}",
                field=path, limit="max_text_chars",
            )


def check_metadata(samples: Sequence[Sample], prefix: str, limits: LimitSettings) -> None:
    """422 naming the sample when its `metadata` is larger than `max_metadata_bytes` as JSON or
    nests deeper than `max_metadata_depth`."""
    for i, sample in enumerate(samples):
        if not sample.metadata:
            continue
        field = f"{prefix}[{i}].metadata"
        size = len(wire.encode_json(sample.metadata))
        if size > limits.max_metadata_bytes:
            raise HTTPProblem(
                422, f"{field} is {size} bytes as JSON, more than max_metadata_bytes={limits.max_metadata_bytes}; "
                "send media as paths under a --media-root", field=field, limit="max_metadata_bytes",
            )
        if _depth(sample.metadata, limits.max_metadata_depth) > limits.max_metadata_depth:
            raise HTTPProblem(
                422, f"{field} nests deeper than max_metadata_depth={limits.max_metadata_depth}",
                field=field, limit="max_metadata_depth",
            )


def _depth(value: Any, stop: int) -> int:
    """Nesting depth of dicts/lists in `value` (a flat dict is 1), counted no further than `stop` + 1."""
    if isinstance(value, dict):
        children: Iterable[Any] = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return 0
    if stop < 0:
        return 1
    return 1 + max((_depth(c, stop - 1) for c in children), default=0)


def resolve_media(path: str, roots: Sequence[str]) -> str:
    """`path` resolved (relative paths against the first root) if it lies inside a media root;
    ValueError otherwise."""
    if not roots:
        raise ValueError(f"media path {path!r} refused: the server has no --media-root configured")
    real_roots = [os.path.realpath(r) for r in roots]
    resolved = os.path.realpath(os.path.join(real_roots[0], path))
    for root in real_roots:
        if os.path.commonpath([root, resolved]) == root:
            return resolved
    raise ValueError(f"media path {path!r} resolves outside the media roots {list(roots)}")


def confine_sample(sample: Sample, roots: Sequence[str]) -> Sample:
    """The sample with every media path in its metadata resolved inside the media roots
    (ValueError naming the key if one is not)."""
    if not sample.metadata or not any(key in sample.metadata for key in MEDIA_KEYS):
        return sample
    metadata: dict[str, Any] = dict(sample.metadata)
    for key in MEDIA_KEYS:
        value = metadata.get(key)
        if value is None:
            continue
        try:
            if isinstance(value, str):
                metadata[key] = resolve_media(value, roots)
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                metadata[key] = [resolve_media(v, roots) for v in value]
            else:
                raise ValueError(f"expected a path or a list of paths, got {type(value).__name__}")
        except ValueError as e:
            raise ValueError(f"metadata.{key}: {e}") from None
    return Sample(completion=sample.completion, prompt=sample.prompt, reference=sample.reference, metadata=metadata)
