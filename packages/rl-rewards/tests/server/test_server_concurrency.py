"""`max_concurrency` of a `[rewards.NAME]` table on a real `rl-rewards serve --workers 3`: a rule
from a temp file records how many of its calls run at once (one file per call in progress,
counted on entry), across the worker processes."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import metric, server_process

from rl_rewards.server.settings import load_settings

pytestmark = pytest.mark.no_torch

REQUEST_TIMEOUT_S = 1.5

RULE = '''
import os
import time
import uuid


def compute_score(data_source, solution_str, ground_truth, extra_info):
    """Enter (a file in active/), log the number of calls inside, stay `sleep` s (or until the
    file `release` exists when `hang`), leave."""
    here = extra_info["dir"]
    me = os.path.join(here, "active", uuid.uuid4().hex)
    os.close(os.open(me, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    try:
        inside = len(os.listdir(os.path.join(here, "active")))
        with open(os.path.join(here, "entries.log"), "a") as log:
            log.write(f"{solution_str} {inside}\\n")
        until = time.monotonic() + (30.0 if extra_info.get("hang") else extra_info["sleep"])
        while time.monotonic() < until and not os.path.exists(os.path.join(here, "release")):
            time.sleep(0.005)
    finally:
        os.unlink(me)
    return 1.0
'''


def config(tmp: Path, limits: dict[str, str]) -> Path:
    (tmp / "counting_rule.py").write_text(RULE)
    path = tmp / "server.toml"
    path.write_text("".join(
        f"[rewards.{name}]\n{limit}\n[rewards.{name}.components.rule]\n"
        f'scorer = "rule"\noptions = {{ function = "{tmp / "counting_rule.py"}" }}\n'
        for name, limit in limits.items()
    ))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("concurrency")
    (tmp / "active").mkdir()
    limits = {"two_at_a_time": "max_concurrency = 2", "one_at_a_time": "max_concurrency = 1"}
    args = ["--config", str(config(tmp, limits)), "--workers", "3", "--max-batch-size", "2",
            "--request-timeout", str(REQUEST_TIMEOUT_S), "--chunk-deadline", "30", "--restart-grace", "0.5"]
    with server_process(tmp, "server", args) as process:
        process.dir = tmp
        yield process


def body(reward: str, texts: list[str], tmp: Path, **extra: object) -> dict:
    info = {"dir": str(tmp), "sleep": 0.05, **extra}
    return {"reward": reward, "samples": [{"completion": t, "metadata": {"extra_info": info}} for t in texts]}


def entries(tmp: Path) -> list[tuple[str, int]]:
    lines = (tmp / "entries.log").read_text().splitlines() if (tmp / "entries.log").exists() else []
    return [(text, int(inside)) for text, inside in (line.rsplit(" ", 1) for line in lines)]


def test_max_concurrency_holds_across_workers_and_every_request_is_answered(server):
    """8 clients, 3 requests each (one batch of 2 samples per request) on 3 workers: at most 2
    calls of the reward run at once, and 2 do (without the limit 3 would), every request gets
    its 2 scores; `/metrics` shows the limit and never more than 2 batches in flight."""
    url, tmp = server.url, server.dir
    seen_in_flight: list[float] = []

    def client(k: int) -> list[int]:
        with httpx.Client(timeout=30) as http:
            statuses = []
            for i in range(3):
                r = http.post(f"{url}/v1/score", json=body("two_at_a_time", [f"c{k}-{i}a", f"c{k}-{i}b"], tmp))
                ok = r.status_code == 200 and [x["score"] for x in r.json()["results"]] == [1.0, 1.0]
                statuses.append(200 if ok else r.status_code)
                seen_in_flight.append(metric(url, "rl_rewards_batches_in_flight", reward="two_at_a_time"))
            return statuses

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for got in pool.map(client, range(8)) for s in got]
    assert statuses == [200] * 24
    calls = entries(tmp)
    assert len(calls) == 48
    assert max(inside for _, inside in calls) == 2
    assert metric(url, "rl_rewards_max_concurrency", reward="two_at_a_time") == 2
    assert max(seen_in_flight) <= 2
    assert metric(url, "rl_rewards_batches_in_flight", reward="two_at_a_time") == 0


def test_a_request_waiting_for_its_turn_gets_503_at_the_request_timeout(server):
    """`max_concurrency = 1`, its scorer hanging: request A holds the one slot, B and C wait in
    order (2 samples each: one batch each, `--max-batch-size 2`). After the request timeout every
    one is answered 503; C, which never got a slot, left the queue unscored (before, a queued
    request had the whole timeout again once dispatched)."""
    url, tmp = server.url, server.dir

    def post(name: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/score", json=body("one_at_a_time", [f"{name}1", f"{name}2"], tmp, hang=True), timeout=30)

    def wait_for(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    with ThreadPoolExecutor(3) as pool:
        a = pool.submit(post, "A")
        wait_for(lambda: ("A1", 1) in entries(tmp))
        b = pool.submit(post, "B")
        wait_for(lambda: metric(url, "rl_rewards_queue_depth", reward="one_at_a_time") == 2)
        c = pool.submit(post, "C")
        wait_for(lambda: metric(url, "rl_rewards_queue_depth", reward="one_at_a_time") == 4)
        responses = {name: future.result() for name, future in zip("ABC", (a, b, c), strict=True)}
    # A's worker was taken for a hung one when A's time ran out; not the others, which its chunk
    # was not tried on with no time left
    assert metric(url, "rl_rewards_chunk_deadline_misses_total") == 1
    (tmp / "release").touch()
    for name, r in responses.items():
        assert r.status_code == 503, (name, r.text)
        assert f"request_timeout_s={REQUEST_TIMEOUT_S}" in r.json()["error"]
    assert "2 of its 2 sample(s) still waited in the queue" in responses["C"].json()["error"]
    assert not [text for text, _ in entries(tmp) if text.startswith("C")]


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "true", '"2"'])
def test_a_bad_max_concurrency_is_refused_naming_the_field_file_and_line(tmp_path, value):
    path = config(tmp_path, {"judge": f"max_concurrency = {value}"})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2 \[rewards.judge\]: max_concurrency = .* must be an "
                       r"integer >= 1"):  # line 2: under [rewards.judge]
        load_settings(path, environ={})


def test_max_concurrency_below_the_http_processes_is_refused(tmp_path):
    settings = load_settings(config(tmp_path, {"judge": "max_concurrency = 1"}), {"http_processes": 2}, environ={})
    with pytest.raises(ValueError, match=r"^rewards.judge.max_concurrency = 1 cannot hold across http_processes=2"):
        settings.check()
    load_settings(config(tmp_path, {"judge": "max_concurrency = 2"}), {"http_processes": 2}, environ={}).check()
