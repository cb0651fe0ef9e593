"""Soak (opt-in, `slow`): 10 minutes of mixed valid and malformed load on `--workers 2` while,
every minute, one worker is SIGSTOPped and, half a minute later, one is SIGKILLed. Asserts that
no request is lost (every valid one scored right, every malformed one its JSON 4xx), none hangs
(all answered within the client's timeout), and the server's memory stays bounded.

`RL_REWARDS_SOAK_S` shortens it (e.g. 60 to try it); the fault period scales with it."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import pytest
from conftest import assert_healthy, metric, server_process
from test_server_faults import resume
from test_server_workers import captions, children

from rl_rewards.rules import timestamp_format

pytestmark = pytest.mark.slow  # not no_torch: the rewards_no_torch session selects by that marker alone

SOAK_S = float(os.environ.get("RL_REWARDS_SOAK_S", "600"))
FAULT_PERIOD_S = SOAK_S / 10
CLIENT_TIMEOUT_S = 10.0
MALFORMED = [  # (body, expected status)
    (b"{not json", 400),
    (b'{"samples": [{"completion": "\xff"}]}', 400),
    (b'{"samples": [{"completion": "a", "metadata": {"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}]}", 422),
    (b'{"samples": [{"completion": 5}]}', 422),
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_soak_mixed_load_with_stopped_and_killed_workers(tmp_path):
    args = ["--workers", "2", "--max-batch-size", "16", "--max-wait-ms", "1", "--chunk-deadline", "1",
            "--restart-grace", "0.5", "--header-timeout", "2", "--body-timeout", "2", "--log-level", "warning"]
    with server_process(tmp_path, "soak", args) as server:
        url = server.url
        started = time.monotonic()
        stop_at = started + SOAK_S
        outcomes: Counter[str] = Counter()
        problems: list[str] = []
        slowest = [0.0]
        rss: list[tuple[float, int]] = []
        stopped: list[int] = []

        def record(ok: bool, kind: str, detail: str, seconds: float) -> None:
            outcomes[kind if ok else "problem"] += 1
            slowest[0] = max(slowest[0], seconds)
            if not ok and len(problems) < 20:
                problems.append(detail)

        def client(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
                i = 0
                while time.monotonic() < stop_at:
                    i += 1
                    t0 = time.monotonic()
                    try:
                        if rng.random() < 0.8:
                            texts = captions(seed * 100_000 + i, rng.randint(1, 48))
                            r = http.post(f"{url}/v1/score", json={"samples": [{"completion": t} for t in texts]})
                            ok = r.status_code == 200 and [x["score"] for x in r.json()["results"]] == [
                                timestamp_format(t) for t in texts]
                            record(ok, "valid", f"{r.status_code} {r.text[:200]}", time.monotonic() - t0)
                        else:
                            body, status = rng.choice(MALFORMED)
                            r = http.post(f"{url}/v1/score", content=body, headers={"content-type": "application/json"})
                            ok = r.status_code == status and "error" in r.json()
                            record(ok, "malformed", f"{r.status_code} {r.text[:200]}", time.monotonic() - t0)
                    except httpx.HTTPError as e:
                        record(False, "", f"{type(e).__name__}: {e}", time.monotonic() - t0)

        def chaos() -> None:
            rng = random.Random(0)
            next_fault = started + FAULT_PERIOD_S / 2
            stop_turn = True
            while time.monotonic() < stop_at - FAULT_PERIOD_S / 4:
                rss.append((time.monotonic() - started, rss_kib(server.proc.pid)))
                if time.monotonic() >= next_fault:
                    pids = [p for p in children(server.proc.pid) if p not in stopped]  # a running worker
                    if pids:
                        victim = rng.choice(pids)
                        if stop_turn:
                            stopped.append(victim)
                        os.kill(victim, signal.SIGSTOP if stop_turn else signal.SIGKILL)
                        stop_turn = not stop_turn
                    next_fault += FAULT_PERIOD_S / 2
                time.sleep(1.0)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)] + [threading.Thread(target=chaos)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for pid in stopped:
                resume(pid)
        print(f"soak {SOAK_S:.0f} s: {dict(outcomes)}, slowest {slowest[0]:.2f} s, "
              f"deadline misses {metric(url, 'rl_rewards_chunk_deadline_misses_total'):.0f}, "
              f"restarts {metric(url, 'rl_rewards_worker_restarts_total'):.0f}, RSS KiB {rss[0][1]}..{rss[-1][1]}")
        assert problems == [], problems
        assert outcomes["valid"] > 100 and outcomes["malformed"] > 20
        assert slowest[0] < CLIENT_TIMEOUT_S
        # faults really happened (a victim may already be on its way out when its turn comes)
        assert metric(url, "rl_rewards_chunk_deadline_misses_total") >= len(stopped) / 2 > 0
        assert metric(url, "rl_rewards_worker_restarts_total") >= len(stopped)
        # memory: the second half may not grow past the first half's peak by more than a margin
        half = SOAK_S / 2
        first = max(kib for t, kib in rss if SOAK_S / 10 <= t < half)
        second = max(kib for t, kib in rss if t >= half)
        assert second <= first * 1.2 + 16 * 1024, f"server RSS grew from {first} to {second} KiB"
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["workers_alive"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert_healthy(url)
