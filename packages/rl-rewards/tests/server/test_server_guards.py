"""A real `rl-rewards serve` against what an adversarial client sends: bytes that are not valid
JSON or HTTP (every error is JSON with a 4xx), clients that trickle their headers or body (cut
off, while normal requests keep their latency), more connections than the cap, and an empty API
key (refused at start). Raw sockets on 127.0.0.1; every loop is bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from conftest import assert_healthy, metric, server_process
from typer.testing import CliRunner

from rl_rewards.cli import app as cli
from rl_rewards.server.app import build_app
from rl_rewards.server.settings import ServerSettings

pytestmark = pytest.mark.no_torch

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 260


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guards")
    args = ["--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
            "--max-connections", str(MAX_CONNECTIONS)]
    with server_process(tmp, "guards", args) as proc:
        yield proc


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(url: str, payload: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send `payload` as is on a fresh socket; the status, headers and body of the answer."""
    with socket.create_connection(address(url), timeout=timeout) as sock:
        sock.sendall(payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and len(body) >= _content_length(head):
                break
    return parse_response(data)


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split(" ")[1]), headers, body


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def post_bytes(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, expect: int) -> dict:
    assert status == expect, body[:300]
    assert headers["content-type"].startswith("application/json"), headers
    return json.loads(body)


# ----------------------------------------------------------------------------- odd bytes: JSON 4xx


def nested(depth: int) -> bytes:
    return b'{"samples": [{"completion": "a", "metadata": {"x": ' + b"[" * depth + b"]" * depth + b"}}]}"


ODD_BODIES = [
    # (request body, status, words the error must contain, limit it names)
    (b'{"samples": [{"completion": "caf\xe9 \xff"}]}', 400, "not valid UTF-8", None),
    (nested(100_000), 422, "nested too deep", "max_metadata_depth"),
    (nested(40), 422, "$.samples[0].metadata nests deeper than max_metadata_depth=16", "max_metadata_depth"),
    (json.dumps({"samples": [{"completion": "a", "metadata": {"x": "y" * 70_000}}]}).encode(), 422,
     "more than max_metadata_bytes=65536", "max_metadata_bytes"),
    (b'{"samples": [{"completion": "\\ud800"}]}', 400, "malformed JSON", None),
    (b"\x00\x01\x02", 400, "malformed JSON", None),
]


@pytest.mark.parametrize(("body", "status", "words", "limit"), ODD_BODIES,
                         ids=["utf8", "depth-100k", "depth-40", "metadata-bytes", "surrogate", "binary"])
def test_odd_bodies_get_a_json_4xx(server, body, status, words, limit):
    error = assert_json_error(*raw_request(server.url, post_bytes("/v1/score", body)), status)
    assert words in error["error"]
    assert error.get("limit") == limit
    ok = httpx.post(f"{server.url}/v1/score", json={"samples": [{"completion": "[00:01] a", "metadata": {"k": [1, {"j": 2}]}}]})
    assert ok.status_code == 200 and ok.json()["results"][0]["score"] == 1.0


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
        (b"DELETE /v1/score HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
        (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, 400),  # a TLS hello on the plain port
    ],
    ids=["route", "method", "content-length", "tls-hello"],
)
def test_errors_uvicorn_and_starlette_answer_are_json(server, payload, status):
    error = assert_json_error(*raw_request(server.url, payload), status)
    assert error["error"]


# ----------------------------------------------------------------------------- slow clients


async def _trickle(host: str, port: int, head: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send `head`, then one byte every 0.1 s, until the server closes the connection or
    `limit_s` passes; (seconds until closed, what the server sent)."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    writer.write(head)
    got = b""
    try:
        while time.monotonic() - started < limit_s:
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.1)
            except TimeoutError:
                writer.write(b"x")
                continue
            if not chunk:
                return time.monotonic() - started, got
            got += chunk
    except ConnectionError:
        return time.monotonic() - started, got
    finally:
        writer.close()
    return float("inf"), got


async def _normal_requests(url: str, until: float) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() < until:
            started = time.monotonic()
            r = await http.post(f"{url}/v1/score", json={"samples": [{"completion": "[00:01] a [00:02] b"}] * 64})
            assert r.status_code == 200, r.text
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.01)
    return latencies


def test_slow_clients_are_cut_off_and_normal_requests_keep_their_latency(server):
    """100 clients trickle their headers and 100 their body (one byte per 0.1 s, 4 s at most):
    each gets 408 JSON and is disconnected within the timeout (+ slack for a busy machine),
    while a normal client's 64-sample requests keep answering quickly."""
    host, port = address(server.url)
    slow_headers = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Slow: "
    slow_body = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
    headers_before = metric(server.url, "rl_rewards_read_timeouts_total", phase="headers")
    body_before = metric(server.url, "rl_rewards_read_timeouts_total", phase="body")

    async def scenario():
        slow = [_trickle(host, port, slow_headers, 4.0) for _ in range(100)]
        slow += [_trickle(host, port, slow_body, 4.0) for _ in range(100)]
        normal = _normal_requests(server.url, time.monotonic() + 2.5)
        return await asyncio.gather(asyncio.gather(*slow), normal)

    cut, latencies = asyncio.run(scenario())
    closed_after = [seconds for seconds, _ in cut]
    assert max(closed_after) < HEADER_TIMEOUT_S + 2.0, sorted(closed_after)[-5:]
    for _, answer in cut:
        status, headers, body = parse_response(answer)
        error = assert_json_error(status, headers, body, 408)
        assert error["limit"] in ("header_timeout_s", "body_timeout_s")
    assert metric(server.url, "rl_rewards_read_timeouts_total", phase="headers") - headers_before == 100
    assert metric(server.url, "rl_rewards_read_timeouts_total", phase="body") - body_before == 100
    assert len(latencies) > 20
    print(f"normal requests under 200 slow clients: n={len(latencies)} max {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 0.5, f"max latency {max(latencies):.3f} s"
    assert metric(server.url, "rl_rewards_limit", limit="header_timeout_s") == HEADER_TIMEOUT_S
    assert_healthy(server.url)


def test_idle_connection_that_never_sends_is_closed(server):
    with socket.create_connection(address(server.url), timeout=HEADER_TIMEOUT_S + 3) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed without an answer: it asked nothing
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 2


def test_connections_over_the_cap_get_503_json(server):
    """Open MAX_CONNECTIONS + 20 idle connections at once: the ones past the cap are answered 503
    (JSON naming max_connections) at once; the server keeps serving once they are gone."""
    host, port = address(server.url)
    refused_before = metric(server.url, "rl_rewards_connections_refused_total")

    async def scenario() -> list[bytes]:
        pairs = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(MAX_CONNECTIONS + 20)))

        async def first_bytes(reader: asyncio.StreamReader) -> bytes:
            try:
                return await asyncio.wait_for(reader.read(4096), HEADER_TIMEOUT_S / 2)
            except TimeoutError:
                return b""

        answers = await asyncio.gather(*(first_bytes(r) for r, _ in pairs))
        for _, w in pairs:
            w.close()
        return answers

    answers = [a for a in asyncio.run(scenario()) if a]
    assert len(answers) >= 20
    for answer in answers:
        error = assert_json_error(*parse_response(answer), 503)
        assert error["limit"] == "max_connections"
    assert metric(server.url, "rl_rewards_connections_refused_total") - refused_before == len(answers)
    assert metric(server.url, "rl_rewards_limit", limit="max_connections") == MAX_CONNECTIONS
    r = httpx.post(f"{server.url}/v1/score", json={"samples": [{"completion": "[00:01] a"}]})
    assert r.status_code == 200


# ----------------------------------------------------------------------------- API key


@pytest.mark.parametrize(("args", "env"), [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                           ([], {"REWARD_API_KEY": " "}), (["--api-key", " key "], {})],
                         ids=["empty", "blank", "blank-env", "padded"])
def test_blank_api_key_is_refused_at_start(args, env, monkeypatch, tmp_path):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(cli, ["serve", "--host", "256.0.0.1", *args])  # would fail to bind if it got that far
    assert result.exit_code == 2, result.output
    assert "api_key" in result.output and ("blank" in result.output or "whitespace" in result.output)


def test_build_app_refuses_an_empty_key():
    with pytest.raises(ValueError, match="empty or blank"):
        build_app(ServerSettings(api_key=""))
