"""The `openai` engine against a real `transformers serve` process on 127.0.0.1 (tiny checkpoint)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl_rollout import SamplingParams
from rl_rollout.hf import HFEngine
from rl_rollout.openai import OpenAIEngine, OpenAIServerError

pytest.importorskip("fastapi", reason="needs transformers[serving] (rl-rollout's test group)")



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(transformers_serve_url: str) -> str:
    return transformers_serve_url


@pytest.fixture(scope="module")
def engine(server: str, qwen3_path: Path) -> Iterator[OpenAIEngine]:
    eng = OpenAIEngine(server, str(qwen3_path), native_n=False, max_retries=0)
    yield eng
    eng.close()


def test_text_completion_matches_local_greedy(engine: OpenAIEngine, qwen3_engine: HFEngine) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    remote = engine.generate(["the cat sat on", "a b c"], params)
    local = qwen3_engine.generate(["the cat sat on", "a b c"], params)
    assert [g.text for g in remote] == [g.text for g in local]
    assert [g.finish_reason for g in remote] == [g.finish_reason for g in local]
    assert [g.request_index for g in remote] == [0, 1]
    # transformers serve ignores `logprobs` and returns no token ids (documented in the README)
    assert remote[0].logprobs == [] and remote[0].completion_ids == [] and remote[0].prompt_ids == []


def test_chat_completion_matches_local_greedy(engine: OpenAIEngine, qwen3_engine: HFEngine) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    remote = engine.generate([CHAT], params)[0]
    local = qwen3_engine.generate([CHAT], params)[0]
    # the server parses the assistant message with the Qwen response template, which strips it
    assert (remote.text, remote.finish_reason) == (local.text.strip(), local.finish_reason)


def test_stop_string(engine: OpenAIEngine, qwen3_engine: HFEngine) -> None:
    full = qwen3_engine.generate(["the cat sat on"], SamplingParams(temperature=0.0, max_new_tokens=12))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    got = engine.generate(["the cat sat on"], SamplingParams(temperature=0.0, max_new_tokens=12, stop=(stop,)))[0]
    assert got.text == full[: full.find(stop)]
    assert got.finish_reason == "stop"


def test_n_samples_without_native_n(engine: OpenAIEngine) -> None:
    gens = engine.generate(["x y", "z"], SamplingParams(n=3, temperature=0.0, max_new_tokens=4))
    assert [g.request_index for g in gens] == [0, 0, 0, 1, 1, 1]


def test_native_n_on_a_server_that_ignores_n_is_a_clear_error(server: str, qwen3_path: Path) -> None:
    eng = OpenAIEngine(server, str(qwen3_path), max_retries=0)
    with pytest.raises(OpenAIServerError, match="native_n=False"):
        eng.generate(["x"], SamplingParams(n=2, max_new_tokens=2))
    eng.close()


def test_unsupported_requests_name_the_problem(engine: OpenAIEngine) -> None:
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(OpenAIServerError, match=r"request 1: .*400.*prompt must be a string"):
        engine.generate(["ok", [1, 2, 3]], SamplingParams(max_new_tokens=2))
    with pytest.raises(OpenAIServerError, match="echo"):
        engine.score_next_tokens([1, 2, 3], [[4]], [5, 6])
    with pytest.raises(ValueError, match=r"temperature must be 1\.0"):
        engine.score_next_tokens([1], [[2]], [3], temperature=0.5)
    with pytest.raises(TypeError, match="remote server"):
        engine.load_weights([("w", torch.zeros(1))])


def test_unreachable_server_fails_after_retries() -> None:
    eng = OpenAIEngine(f"http://127.0.0.1:{free_port()}", "m", max_retries=1, timeout=2)
    start = time.monotonic()
    with pytest.raises(OpenAIServerError, match="request 0: POST /v1/completions failed"):
        eng.generate(["x"], SamplingParams(max_new_tokens=1))
    assert time.monotonic() - start >= 0.5  # one backoff happened
    eng.close()
