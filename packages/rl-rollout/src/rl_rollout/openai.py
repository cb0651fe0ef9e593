"""`openai` engine: generation through any OpenAI-compatible HTTP server (vLLM, SGLang,
`transformers serve`, OpenAI itself), so a judge can live on a server elsewhere.

Token-id and text prompts go to `/v1/completions`, chat messages to `/v1/chat/completions`.
What a `Generation` holds depends on what the server returns:

- `text`, `finish_reason`: always (the text is also cut at the first stop string client-side).
- `logprobs`: when the server honours `logprobs` (vLLM, SGLang, OpenAI); `transformers serve`
  (5.x) ignores the field, so they come back empty. Servers report them at the sampling
  temperature or raw, depending on the server (vLLM: raw model log-probs by default).
- `completion_ids`: only with `server_token_ids=True`, which asks vLLM for
  `return_tokens_as_token_ids` (tokens come back as `"token_id:123"`); otherwise empty.
- `prompt_ids`: the request's ids for token-id prompts; empty for text and chat prompts.

`n > 1` is sent as the server's `n` (`native_n=True`, vLLM shares the prompt across samples);
servers that ignore `n` (`transformers serve`) need `native_n=False`, which sends `n` requests
with seeds `seed, seed + 1, ...`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import torch

from rl_rollout.protocol import FinishReason, Generation, Prompt, SamplingParams, is_token_ids

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class OpenAIServerError(RuntimeError):
    """The server refused or could not answer a request."""


class _CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []


class _CompletionChoice(msgspec.Struct):
    text: str
    index: int = 0
    finish_reason: str | None = None
    logprobs: _CompletionLogprobs | None = None


class _ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float


class _ChatLogprobs(msgspec.Struct):
    content: list[_ChatTokenLogprob] | None = None


class _ChatMessage(msgspec.Struct):
    content: str | None = None


class _ChatChoice(msgspec.Struct):
    message: _ChatMessage
    index: int = 0
    finish_reason: str | None = None
    logprobs: _ChatLogprobs | None = None


class _CompletionResponse(msgspec.Struct):
    choices: list[_CompletionChoice]


class _ChatResponse(msgspec.Struct):
    choices: list[_ChatChoice]


def _finish_reason(value: str | None, index: int) -> FinishReason:
    if value == "length":
        return "length"
    if value in ("stop", "eos", "tool_calls"):
        return "stop"
    raise OpenAIServerError(f"request {index}: unexpected finish_reason {value!r} from the server")


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cuts = [pos for pos in (text.find(stop) for stop in stops) if pos >= 0]
    return text[: min(cuts)] if cuts else text


def _token_ids(tokens: Sequence[str]) -> list[int]:
    """Parse vLLM's `return_tokens_as_token_ids` tokens (`"token_id:123"`)."""
    ids = []
    for token in tokens:
        head, _, tail = token.partition(":")
        if head != "token_id" or not tail.isdigit():
            raise OpenAIServerError(f"expected tokens like 'token_id:123' (return_tokens_as_token_ids), got {token!r}")
        ids.append(int(tail))
    return ids


class OpenAIEngine:
    """Engine over an OpenAI-compatible server (see the module docstring for what is filled).

    base_url: server root, e.g. `http://127.0.0.1:8000` (the `/v1/...` paths are appended).
    model: the `model` field sent with every request.
    max_retries: retries on connection errors and 408/429/5xx, with exponential backoff.
    max_concurrency: requests in flight at once.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        max_retries: int = 3,
        max_concurrency: int = 16,
        native_n: bool = True,
        server_token_ids: bool = False,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.max_retries = max_retries
        self.native_n = native_n
        self.server_token_ids = server_token_ids
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency)

    # ------------------------------------------------------------------ HTTP
    def _post(self, path: str, body: dict[str, Any], index: int) -> bytes:
        for attempt in range(self.max_retries + 1):
            try:
                response = self._client.post(path, content=msgspec.json.encode(body), headers={"content-type": "application/json"})
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise OpenAIServerError(f"request {index}: POST {path} failed: {exc!r}") from exc
            else:
                if response.status_code == 200:
                    return response.content
                if response.status_code not in _RETRY_STATUS or attempt == self.max_retries:
                    raise OpenAIServerError(
                        f"request {index}: POST {path} returned {response.status_code}: {response.text[:500]}"
                    )
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ generate
    def _body(self, prompt: Prompt, params: SamplingParams, n: int, seed: int | None) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "n": n,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k  # vLLM/SGLang extension
        if seed is not None:
            body["seed"] = seed
        if params.stop:
            body["stop"] = list(params.stop)
        if self.server_token_ids:
            body["return_tokens_as_token_ids"] = True
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return "/v1/chat/completions", body | {"messages": prompt, "logprobs": True}
        return "/v1/completions", body | {"prompt": prompt, "logprobs": 0}

    def _request(self, index: int, prompt: Prompt, params: SamplingParams, n: int, seed: int | None) -> list[Generation]:
        path, body = self._body(prompt, params, n, seed)
        raw = self._post(path, body, index)
        prompt_ids = list(prompt) if is_token_ids(prompt) else []
        out = []
        if path == "/v1/completions":
            for c in sorted(msgspec.json.decode(raw, type=_CompletionResponse).choices, key=lambda c: c.index):
                lp = c.logprobs or _CompletionLogprobs()
                out.append(self._generation(index, prompt_ids, c.text, lp.tokens, [x or 0.0 for x in lp.token_logprobs], c.finish_reason, params))
        else:
            for chat in sorted(msgspec.json.decode(raw, type=_ChatResponse).choices, key=lambda c: c.index):
                content = (chat.logprobs.content if chat.logprobs else None) or []
                out.append(self._generation(
                    index, prompt_ids, chat.message.content or "", [t.token for t in content], [t.logprob for t in content],
                    chat.finish_reason, params,
                ))
        if len(out) != n:
            raise OpenAIServerError(
                f"request {index}: asked for n={n} but the server returned {len(out)} choices; "
                "this server ignores `n`, build the engine with native_n=False"
            )
        return out

    def _generation(
        self, index: int, prompt_ids: list[int], text: str, tokens: list[str], logprobs: list[float],
        finish: str | None, params: SamplingParams,
    ) -> Generation:
        return Generation(
            request_index=index,
            prompt_ids=prompt_ids,
            completion_ids=_token_ids(tokens) if self.server_token_ids else [],
            text=_cut_at_stop(text, params.stop),
            logprobs=logprobs,
            finish_reason=_finish_reason(finish, index),
        )

    def generate(self, requests: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        """Send every request (concurrently) and return `len(requests) * n` generations,
        request-major."""
        if self.native_n:
            jobs = [(i, prompt, params.n, params.seed) for i, prompt in enumerate(requests)]
        else:
            jobs = [
                (i, prompt, 1, None if params.seed is None else params.seed + j)
                for i, prompt in enumerate(requests)
                for j in range(params.n)
            ]
        results = self._pool.map(lambda job: self._request(job[0], job[1], params, job[2], job[3]), jobs)
        return [gen for batch in results for gen in batch]

    # ------------------------------------------------------------------ scoring
    def _score_one(self, index: int, sequence: list[int], candidates: Sequence[int]) -> list[float]:
        prompts = [[*sequence, c] for c in candidates]
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0.0}
        try:
            raw = self._post("/v1/completions", body, index)
        except OpenAIServerError as exc:
            raise OpenAIServerError(
                f"score_next_tokens needs /v1/completions with token-id prompts, echo and logprobs "
                f"(vLLM supports them; transformers serve does not): {exc}"
            ) from exc
        choices = sorted(msgspec.json.decode(raw, type=_CompletionResponse).choices, key=lambda c: c.index)
        scores = []
        for c in choices:
            lps = c.logprobs.token_logprobs if c.logprobs else []
            lp = lps[len(sequence)] if len(lps) > len(sequence) else None  # the candidate token's
            if len(choices) != len(prompts) or lp is None:
                raise OpenAIServerError(
                    f"suffix {index}: the server did not return echoed prompt log-probs; score_next_tokens needs "
                    "a server that supports echo+logprobs on /v1/completions (vLLM does)"
                )
            scores.append(float(lp))
        return scores

    def score_next_tokens(
        self,
        shared_prefix: list[int],
        suffixes: Sequence[list[int]],
        candidates: Sequence[int],
        *,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Log-probs `[S, C]` via echoed prompt log-probs of `prefix + suffix + [candidate]`.

        The server's prefix cache (vLLM `enable_prefix_caching`) is what computes the shared
        prefix once. Echoed log-probs are raw model log-probs, so only `temperature=1.0`.
        """
        if temperature != 1.0:
            raise ValueError(f"OpenAIEngine scores with raw prompt log-probs; temperature must be 1.0, got {temperature}")
        if not suffixes:
            return torch.empty(0, len(candidates))
        rows = self._pool.map(lambda item: self._score_one(item[0], shared_prefix + list(item[1]), candidates), enumerate(suffixes))
        return torch.tensor(list(rows), dtype=torch.float32)

    # ------------------------------------------------------------------ lifecycle
    state = "remote"  # nothing local to wake or put to sleep: the server owns its memory

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """Not possible over the OpenAI API: the weights live in another process."""
        raise TypeError("OpenAIEngine cannot load weights: the model lives on a remote server; update it there")

    def sleep(self) -> None:
        """Nothing to release locally (the server owns its memory)."""

    def wake(self) -> None:
        """Nothing to restore locally."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
