"""Real `rl-rewards serve` processes on 127.0.0.1 with rule rewards: the three protocols, auth,
every limit, media-root confinement, and a table of malformed requests."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import assert_healthy, metric, server_process

pytestmark = pytest.mark.no_torch

CONFIG = """
default_reward = "timestamp_format"
openrlhf_reward = "caption"

[rewards.timestamp_format.components.format]
scorer = "timestamp_format"

[rewards.length.components.length]
scorer = "length"
options = { tokenizer = "whitespace", l1 = 4, l2 = 8 }

[rewards.caption]
combine = "sum"
[rewards.caption.components.format]
scorer = "timestamp_format"
weight = 0.2
[rewards.caption.components.length]
scorer = "length"
weight = 0.2
options = { tokenizer = "whitespace", l1 = 4, l2 = 8 }
"""
LIMITS = ["--max-body-bytes", "20000", "--max-batch-samples", "50", "--max-text-chars", "2000"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("open")
    (tmp / "media").mkdir()
    (tmp / "media" / "ok.png").write_bytes(b"not really a png")
    (tmp / "server.toml").write_text(CONFIG)
    args = ["--config", str(tmp / "server.toml"), "--media-root", str(tmp / "media"), *LIMITS]
    with server_process(tmp, "open", args) as proc:
        yield proc


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    with server_process(tmp, "auth", [], env={"REWARD_API_KEY": "s3cret"}) as proc:
        yield proc


def post(url: str, path: str, body: object, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=30, **kw)


def test_native_scores_hand_worked_format_rewards(server):
    captions = ["[00:01] a [00:05] b", "[00:05] a [00:01] b", "[00:61] x [00:02] y", "no stamps"]
    r = post(server.url, "/v1/score", {"samples": [{"completion": c} for c in captions]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reward"] == "timestamp_format"
    # R_fmt = 0.5*N_valid/N_all + 0.5*I_chrono
    assert [x["score"] for x in body["results"]] == [1.0, 0.5, 0.75, 0.0]
    assert body["results"][0]["components"] == {"format": 1.0}


def test_native_composed_reward_and_length(server):
    text = "[00:01] one two three four five six"  # 7 words: R_len = 1 - (7-4)/(8-4) = 0.25
    r = post(server.url, "/v1/score", {"reward": "caption", "samples": [{"completion": text}]})
    result = r.json()["results"][0]
    assert result["components"]["length"] == pytest.approx(0.25)
    assert result["components"]["length.n_tokens"] == 7.0
    assert result["score"] == pytest.approx(0.2 * 1.0 + 0.2 * 0.25)


def test_openrlhf_protocol_strips_prompt_and_logs_components(server):
    prompt = "<|im_start|>user\ndescribe<|im_end|>\n<|im_start|>assistant\n"
    query = [prompt + "[00:01] a b", prompt + "a b c d e f g h i j"]
    r = post(server.url, "/openrlhf/get_reward", {"query": query, "prompts": [prompt, prompt], "labels": ["", ""]})
    assert r.status_code == 200, r.text
    body = r.json()
    # sample 0: format 1.0, 3 words -> len 1.0; sample 1: no stamps, 10 words -> len 0.0
    assert body["rewards"] == pytest.approx([0.4, 0.0])
    assert body["scores"] == body["rewards"]
    assert body["extra_logs"]["format"] == [1.0, 0.0]
    assert body["extra_logs"]["length.n_tokens"] == [3.0, 10.0]


def test_caprl_empty_batch_and_no_judge(server):
    assert post(server.url, "/get_reward", {"prompts": [], "query": [], "labels": []}).json() == {"rewards": []}
    r = post(server.url, "/get_reward", {"prompts": [["a caption", [["Q?\n   - A) x\n   - B) y", "A"]]]], "query": [], "labels": []})
    assert r.status_code == 422
    assert "no judge configured" in r.json()["error"]
    r = post(server.url, "/get_reward", {"score_mode": "vl_judge", "samples": [{"caption": "c", "video_path": "v.mp4"}]})
    assert r.status_code == 422 and "no vl_judge configured" in r.json()["error"]
    assert_healthy(server.url)


def test_media_outside_roots_is_that_samples_error(server):
    samples = [
        {"completion": "[00:01] ok", "metadata": {"image": "ok.png"}},
        {"completion": "[00:01] bad", "metadata": {"image": "../../../../etc/passwd"}},
        {"completion": "[00:01] abs", "metadata": {"video": "/etc/hostname"}},
        {"completion": "[00:01] fine"},
    ]
    results = post(server.url, "/v1/score", {"samples": samples}).json()["results"]
    assert [r["score"] for r in results] == [1.0, None, None, 1.0]
    assert "outside the media roots" in results[1]["error"] and "metadata.image" in results[1]["error"]
    assert "metadata.video" in results[2]["error"]


def test_unknown_reward_lists_served(server):
    r = post(server.url, "/v1/score", {"reward": "nope", "samples": [{"completion": "x"}]})
    assert r.status_code == 404
    assert "timestamp_format" in r.json()["error"] and "caption" in r.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "expect"),
    [
        ("/v1/score", b"x" * 30_000, 413, {"limit": "max_body_bytes"}),
        ("/v1/score", {"samples": [{"completion": "a"}] * 51}, 422, {"limit": "max_batch_samples", "field": "$.samples"}),
        ("/v1/score", {"samples": [{"completion": "a"}, {"completion": "a" * 2001}]}, 422,
         {"limit": "max_text_chars", "field": "$.samples[1].completion"}),
        ("/get_reward", {"prompts": [["c" * 2001, [["q", "A"]]]]}, 422, {"limit": "max_text_chars", "field": "$.prompts[0][0]"}),
        ("/openrlhf/get_reward", {"query": ["q"] * 51}, 422, {"limit": "max_batch_samples"}),
    ],
    ids=["body", "batch", "text", "caprl-text", "openrlhf-batch"],
)
def test_limits_name_the_limit(server, path, body, status, expect):
    r = post(server.url, path, body)
    assert r.status_code == status, r.text
    payload = r.json()
    for key, value in expect.items():
        assert payload[key] == value
    assert payload["limit"] in payload["error"]
    assert_healthy(server.url)


MALFORMED = [
    ("/v1/score", b"{not json", 400, None, "malformed JSON"),
    ("/v1/score", b"[]", 422, "$", "Expected `object`"),
    ("/v1/score", {"samples": "x"}, 422, "$.samples", "Expected `array`"),
    ("/v1/score", {"samples": [{"prompt": "p"}]}, 422, "$.samples[0]", "missing required field `completion`"),
    ("/v1/score", {"samples": [{"completion": 5}]}, 422, "$.samples[0].completion", "Expected `str`"),
    ("/v1/score", {"samples": [], "reward": 3}, 422, "$.reward", "Expected `str`"),
    ("/get_reward", {"prompts": [["c"]]}, 422, "$.prompts[0]", "length 2"),
    ("/get_reward", {"prompts": [["c", [["q", 1]]]]}, 422, "$.prompts[0][1][0][1]", "Expected `str`"),
    ("/get_reward", {"score_mode": "bogus"}, 422, "$.score_mode", "Invalid enum value 'bogus'"),
    ("/get_reward", {"score_mode": "vl_judge", "samples": [{"caption": "c"}]}, 422, "$.samples[0]", "video_path"),
    ("/openrlhf/get_reward", {"prompts": ["a"]}, 422, "$", "missing required field `query`"),
    ("/openrlhf/get_reward", {"query": ["a", "b"], "prompts": ["a"]}, 422, "$.prompts", "has 1 items"),
    ("/openrlhf/get_reward", b"", 400, None, "malformed JSON"),
]


@pytest.mark.parametrize(("path", "body", "status", "field", "message"), MALFORMED, ids=[f"{m[0]}:{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_requests_get_the_right_4xx_and_server_keeps_serving(server, path, body, status, field, message):
    r = post(server.url, path, body)
    assert r.status_code == status, r.text
    payload = r.json()
    assert message in payload["error"]
    assert payload.get("field") == field
    assert_healthy(server.url)
    ok = post(server.url, "/v1/score", {"samples": [{"completion": "[00:01] a"}]})
    assert ok.json()["results"][0]["score"] == 1.0


def test_wrong_method_is_405(server):
    assert httpx.get(f"{server.url}/v1/score").status_code == 405


def test_metrics_count_requests_samples_and_batches(server):
    before = metric(server.url, "rl_rewards_samples_total", reward="timestamp_format")
    post(server.url, "/v1/score", {"samples": [{"completion": "x"}] * 7})
    assert metric(server.url, "rl_rewards_samples_total", reward="timestamp_format") == before + 7
    assert metric(server.url, "rl_rewards_requests_total", route="/v1/score", status="200") >= 1
    assert metric(server.url, "rl_rewards_batch_size_count", reward="timestamp_format") >= 1
    assert metric(server.url, "rl_rewards_requests_total", route="/v1/score", status="413") >= 0


def test_auth_on(auth_server):
    body = {"samples": [{"completion": "[00:01] a"}]}
    assert post(auth_server.url, "/v1/score", body).status_code == 401
    assert post(auth_server.url, "/v1/score", body, headers={"authorization": "Bearer wrong"}).status_code == 401
    r = post(auth_server.url, "/get_reward", {"prompts": []})
    assert r.status_code == 401 and "bearer token" in r.json()["error"]
    assert post(auth_server.url, "/openrlhf/get_reward", {"query": ["a"]}).status_code == 401
    ok = post(auth_server.url, "/v1/score", body, headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["results"][0]["score"] == 1.0
    assert_healthy(auth_server.url)  # health and metrics stay open for probes
    assert httpx.get(f"{auth_server.url}/metrics").status_code == 200


def test_auth_off_default_rule_rewards(server, auth_server):
    # no API key configured: scoring routes need no token
    assert post(server.url, "/v1/score", {"samples": [{"completion": "a"}]}).status_code == 200
    # with no [rewards] config the embedded defaults are served
    names = httpx.get(f"{auth_server.url}/health").json()["rewards"]
    assert names[:2] == ["timestamp_format", "length"]


def test_two_http_processes_share_the_port_and_their_metrics(tmp_path):
    """`--http-processes 2`: both processes answer on one port (fresh connections land on
    either), every request is scored, /metrics adds up both, and SIGTERM stops all of them."""
    (tmp_path / "server.toml").write_text(CONFIG)
    server = server_process(tmp_path, "two", ["--config", str(tmp_path / "server.toml"), "--http-processes", "2"])
    with server as proc:
        pids = {httpx.get(f"{proc.url}/health", timeout=5).json()["pid"] for _ in range(40)}
        assert len(pids) == 2 and proc.proc.pid not in pids  # two children, not the supervisor
        for _ in range(20):  # a new connection each time
            r = post(proc.url, "/v1/score", {"reward": "caption", "samples": [{"completion": "[00:01] a b"}] * 3})
            assert [x["score"] for x in r.json()["results"]] == [pytest.approx(0.4)] * 3
        assert metric(proc.url, "rl_rewards_samples_total", reward="caption") == 60
    assert proc.proc.returncode == 0  # SIGTERM drained and exited cleanly, no SIGKILL after the timeout
    children = [p for p in pids if _alive(p)]
    assert not children, children


def test_bursts_of_keep_alive_connections_reach_every_http_process(tmp_path):
    """16 connections opened at once (a trainer's client pool) are spread over the processes by
    the kernel (each process has its own SO_REUSEPORT socket). With uvicorn's one shared socket,
    the first process to wake accepted a whole burst and the other sat idle."""
    (tmp_path / "server.toml").write_text(CONFIG)
    server = server_process(tmp_path, "burst", ["--config", str(tmp_path / "server.toml"), "--http-processes", "2"])
    with server as proc:
        deadline = time.monotonic() + 60
        while len({httpx.get(f"{proc.url}/health", timeout=5).json()["pid"] for _ in range(10)}) < 2:
            assert time.monotonic() < deadline, "the second process never answered"
        host, port = proc.url.removeprefix("http://").split(":")
        for _ in range(3):
            pids = asyncio.run(_pids_of_a_burst(host, int(port), 16))
            assert len(set(pids)) == 2, f"a burst went to one process: {pids}"


async def _pids_of_a_burst(host: str, port: int, count: int) -> list[int]:
    """Open `count` connections together, then ask /health on each: the answering pids."""
    connections = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(count)))
    pids = []
    for reader, writer in connections:
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        pids.append(json.loads(await reader.readexactly(length))["pid"])
    for _, writer in connections:
        writer.close()
    return pids


def test_http_processes_refuse_a_judge():
    from rl_rewards.server.settings import load_settings

    with pytest.raises(ValueError, match="use http_processes=1 with --workers N"):
        load_settings(environ={"REWARD_MODEL": "/models/judge", "REWARD_HTTP_PROCESSES": "2"}).check()
    with pytest.raises(ValueError, match="http_processes must be >= 1"):
        load_settings(flags={"http_processes": 0}).check()


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
