"""Rewards that cannot be loaded: `rl-rewards serve` names what it tried and exits 1 (a real
process on 127.0.0.1), `/health` carries the reason meanwhile, and every error body has the
documented keys `error`, `field` and `limit`."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import httpx
import pytest
from conftest import server_process

from rl_rewards.server.app import build_app
from rl_rewards.server.settings import ServerSettings
from rl_rewards.server.workers import LocalPool

pytestmark = pytest.mark.no_torch

HF = importlib.util.find_spec("torch") is not None  # rl-rewards[hf] installed (else: the no-torch session)


# one case: a missing local folder (the hub-id messages are rl_models.tiny.resolve's, tested there)
@pytest.mark.parametrize(("model", "reason"), [
    ("/no/such/judge", "is no local folder (no such path: /no/such/judge)"),
])
def test_a_judge_that_cannot_load_stops_the_server_with_the_reason(tmp_path, model, reason):
    """REWARD_MODEL naming a missing folder read as a malformed hub id ("Repo id must be in the
    form ..."), and the server stayed up answering 503 forever; now it exits 1 saying why."""
    env = {"REWARD_MODEL": model, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = server_process(tmp_path, "judge", [], env=env, ready_timeout=180)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 1 before ready"):
        proc.start()
    assert time.monotonic() - started < 120  # no retries against an unreachable hub
    log = (tmp_path / "judge.log").read_text()
    assert "rl-rewards serve: error: loading the rewards failed: " in log
    assert (reason if HF else 'pip install "rl-rewards[hf]"') in log, log[-2000:]


class UnloadablePool(LocalPool):
    async def start(self) -> None:
        raise FileNotFoundError("judge folder /models/x: no such folder")


async def _in_process(app, requests):
    """Run the app's lifespan (background loading) and answer `requests(client)` in process."""
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await requests(client)


def test_health_and_scoring_routes_carry_the_load_error():
    settings = ServerSettings()

    async def requests(client):
        for _ in range(1000):
            health = await client.get("/health")
            if health.json()["error"] is not None:
                break
            await asyncio.sleep(0.01)
        return health, await client.post("/v1/score", json={"samples": [{"completion": "[00:01] a"}]})

    health, scored = asyncio.run(_in_process(build_app(settings, pool=UnloadablePool(settings)), requests))
    reason = "loading the rewards failed: FileNotFoundError: judge folder /models/x: no such folder"
    assert health.status_code == 503
    assert health.json()["ready"] is False and health.json()["error"] == reason
    assert scored.status_code == 503
    assert scored.json() == {"error": reason, "field": None, "limit": None}


def test_every_error_body_has_error_field_and_limit():
    """The documented error shape, also where a key does not apply (null): a 422 naming a field,
    a 413 naming a limit, starlette's own 404 and 405, a 400 for malformed JSON."""
    settings = ServerSettings()

    async def requests(client):
        while (await client.get("/health")).status_code != 200:
            await asyncio.sleep(0.01)
        return {
            422: await client.post("/get_reward", json={"prompts": [["a caption", [["Q?\n   - A) x", "A"]]]]}),
            413: await client.post("/v1/score", content=b"x" * (settings.limits.max_body_bytes + 1)),
            404: await client.get("/nowhere"),
            405: await client.get("/v1/score"),
            400: await client.post("/v1/score", content=b"{not json"),
        }

    answers = asyncio.run(_in_process(build_app(settings), requests))
    for status, response in answers.items():
        assert response.status_code == status, (status, response.text)
        assert set(response.json()) == {"error", "field", "limit"}, (status, response.json())
    assert answers[422].json()["field"] == "$.score_mode" and answers[422].json()["limit"] is None
    assert answers[413].json()["limit"] == "max_body_bytes" and answers[413].json()["field"] is None
