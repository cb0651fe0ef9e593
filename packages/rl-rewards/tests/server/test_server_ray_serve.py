"""`--backend ray-serve`: the reward server as a Ray Serve application, through the real CLI.

One `rl-rewards serve --backend ray-serve` for the whole module, on the session's local Ray
cluster (`ray_cluster`, shared with `test_server_ray.py`: Ray's own start is paid once), next to
a default (uvicorn) server with the same config and API key; both answer real HTTP on 127.0.0.1.
The config serves `rules` (a composed rule reward) and `probe`, a scorer of `serve_probes.py` on 2
replicas that scores a sample with the size of the scorer call it came in and logs each call's
process id: 3 reward replicas and the ingress, each a process, which is most of the module's time
on 2 cores. The faults (a replica killed, then one stopped) share one load. The CapRL++ judge (a
tiny random checkpoint: importing torch twice doubles the start on 2 cores) gets its own pair of
servers, the ray-serve one starting and stopping a local Ray of its own as `rl-rewards serve
--backend ray-serve` does by default, in an opt-in `slow` test (the docs session starts that way
too, from the README). Not `no_torch`, except the test of the missing extra: Ray Serve is an
extra (`rl-rewards[ray-serve]`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from conftest import RAY_TEST_ENV, metric, server_process
from typer.testing import CliRunner

from rl_rewards.cli import app as cli
from rl_rewards.rules import timestamp_format
from rl_rewards.server.settings import load_settings

try:
    import ray  # noqa: F401

    with warnings.catch_warnings():  # Ray Serve 2.60 declares its pydantic fields the pre-2.0 way
        warnings.filterwarnings("ignore", "Using extra keyword arguments on `Field`", DeprecationWarning)
        from ray import serve  # noqa: F401  # the extra's own import: skip without it
    HAS_SERVE = True
except ImportError:
    HAS_SERVE = False

needs_serve = pytest.mark.skipif(not HAS_SERVE, reason='needs Ray Serve: pip install "rl-rewards[ray-serve]"')
HAS_JUDGE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("rl_models") is not None

HERE = Path(__file__).resolve().parent  # serve_probes.py
READY_S = 300  # a local Ray, Ray Serve and 4 replica processes on a busy 2-core machine
KEY = "serve-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
CHUNK_DEADLINE_S = 2.0
HEARTBEAT_TIMEOUT_S = 3.0
TRIES = 3  # the default max_attempts
CONFIG = """
[scorers]
call_probe = "serve_probes:CallProbe"

[pool]
chunk_deadline_s = {deadline}       # a call held by a hung replica is sent again after this
heartbeat_timeout_s = {heartbeat}   # Ray Serve replaces a replica silent to its health checks this long
max_attempts = {tries}              # the default: a retry never goes back to the hung replica

[rewards.rules.components.answer]
scorer = "exact_answer"
[rewards.rules.components.format]
scorer = "timestamp_format"
weight = 0.2
[rewards.rules.components.length]
scorer = "length"
weight = 0.2
options = {{ tokenizer = "whitespace", l1 = 8, l2 = 16 }}
[rewards.probe.components.calls]
scorer = "call_probe"
options = {{ log = "{log}", delay_s = 0.2 }}
[rewards.slow.components.calls]
scorer = "call_probe"
options = {{ log = "{log}.slow", delay_s = {slow} }}

[ray_serve]
num_cpus = 0.25                 # of the local Ray's logical CPUs (one per core)
[ray_serve.rewards.probe]
num_replicas = 2
batch_wait_ms = 300             # concurrent requests' calls wait for each other this long
"""
REWARD_REPLICAS = 4  # rules, probe x2, slow
SLOW_S = 1.5 * CHUNK_DEADLINE_S  # the `slow` reward's one replica scores a call this long


@contextlib.contextmanager
def server_pair(tmp: Path, config: str, env: dict[str, str], args: list[str],
                ray_address: str | None = None) -> Iterator[dict[str, str]]:
    """{"uvicorn": url, "ray-serve": url}: the same config (`--config`), environment and flags,
    both started at once, the ray-serve one on the Ray cluster at `ray_address` (None: a local
    Ray of its own); the ray-serve one must stop with exit 0 (application deleted, and a local
    Ray stopped)."""
    (tmp / "server.toml").write_text(config)
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {"REWARD_API_KEY": KEY, "PYTHONPATH": pythonpath, **RAY_TEST_ENV, **env}  # the replicas inherit it
    args = ["--config", str(tmp / "server.toml"), *args]
    ray_args = ["--backend", "ray-serve", *(["--ray-address", ray_address] if ray_address else [])]
    procs = {
        "uvicorn": server_process(tmp, "uvicorn", args, env, ready_timeout=READY_S),
        "ray-serve": server_process(tmp, "ray-serve", [*args, *ray_args], env, ready_timeout=READY_S),
    }
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        for proc in procs.values():
            stack.callback(proc.stop)
            proc.start(wait=False)
        for proc in procs.values():
            proc.wait_ready()
        print(f"\nboth servers ready in {time.monotonic() - started:.1f} s")
        yield {name: proc.url for name, proc in procs.items()}
        stopping = time.monotonic()
        assert procs["ray-serve"].stop() == 0
        print(f"\nray-serve server stopped in {time.monotonic() - stopping:.1f} s")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, ray_cluster):
    """`server_pair` of CONFIG on the session's Ray cluster, and "calls": the probe's log."""
    tmp = tmp_path_factory.mktemp("ray-serve")
    calls = tmp / "calls.log"
    calls.touch()
    config = CONFIG.format(log=calls, deadline=CHUNK_DEADLINE_S, heartbeat=HEARTBEAT_TIMEOUT_S, tries=TRIES, slow=SLOW_S)
    with server_pair(tmp, config, {}, [], ray_cluster) as urls:
        yield {"calls": calls, **urls}


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH if headers is None else headers, timeout=120)


def concurrently(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST every body to /v1/score at once."""
    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(client.post("/v1/score", json=b) for b in bodies))

    return asyncio.run(main())


def scores(response: httpx.Response) -> list[float]:
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert all(r["error"] is None for r in results), results
    return [r["score"] for r in results]


SAMPLES = [("the answer is 42", "42"), ("it is 41", "42"), ("no number", "7"),
           ("[00:01] a red circle [00:04] it fades", "4"), ("[00:09] a dog [00:02] runs", "2"),
           ("no stamps at all " * 5 + "3.0", "3"), ("5", "five")]  # the last fails: its reference is no number
CAPTIONS = [c for c, _ in SAMPLES[3:6]]
QA = [["What colour is the circle?\n   - A) red\n   - B) blue\n   - C) green", "A"],
      ["Is it moving?\n   - A) yes\n   - B) no", "B"]]


@needs_serve
def test_same_requests_get_the_same_answers_as_the_uvicorn_server(servers):
    """/v1/score (a composed rule reward, a failed sample, an unknown reward), OpenRLHF's route,
    and CapRL++'s /get_reward (here without a judge: the same 422) through both backends."""
    requests = [
        ("/v1/score", {"reward": "rules", "samples": [{"completion": c, "reference": r} for c, r in SAMPLES]}),
        ("/openrlhf/get_reward", {"query": ["Q: 6*7? A: 42", "Q: 1+1? A: 3"], "prompts": ["Q: 6*7? A:", "Q: 1+1? A:"],
                                  "labels": ["42", "2"]}),
        ("/v1/score", {"reward": "nope", "samples": [{"completion": "x"}]}),
        ("/get_reward", {"prompts": [[c, QA] for c in CAPTIONS], "query": [], "labels": []}),
    ]
    for path, body in requests:
        ours, theirs = post(servers["ray-serve"], path, body), post(servers["uvicorn"], path, body)
        assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()), path
    rules = post(servers["ray-serve"], *requests[0]).json()["results"]  # so the comparison can fail
    assert [r["components"]["answer"] for r in rules[:6]] == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r["components"]["format"] for r in rules[:6]] == [timestamp_format(c) for c, _ in SAMPLES[:6]]
    assert [r["score"] for r in rules[:6]] == pytest.approx(
        [c["answer"] + 0.2 * c["format"] + 0.2 * c["length"] for c in (r["components"] for r in rules[:6])])
    assert rules[6]["score"] is None and "not a number" in rules[6]["error"]
    openrlhf = post(servers["ray-serve"], *requests[1]).json()["extra_logs"]
    assert openrlhf["answer"] == [1.0, 0.0] and openrlhf["failed"] == [0.0, 0.0]
    assert post(servers["ray-serve"], *requests[2]).status_code == 404
    no_judge = post(servers["ray-serve"], *requests[3])
    assert no_judge.status_code == 422 and "no judge configured" in no_judge.json()["error"]


JUDGE_CONFIG = """
[rewards.length.components.length]
scorer = "length"
options = { tokenizer = "whitespace" }
[ray_serve]
num_cpus = 0.25
"""


@pytest.mark.slow
@needs_serve
@pytest.mark.skipif(not HAS_JUDGE, reason="the CapRL++ judge needs rl-rewards[hf]")
def test_caprl_judge_through_ray_serve_matches_the_uvicorn_server(tmp_path):
    """CapRL++'s /get_reward (video task: the judge's qa rewards plus the format reward, two
    deployments) through both backends, the judge a tiny random checkpoint on the CPU."""
    env = {"REWARD_MODEL": "tiny:qwen3", "REWARD_QA_NUM": "4"}  # each server builds or reuses the cached checkpoint
    args = ["--judge-option", "estimator=exact", "--judge-option", 'engine_options={"device": "cpu"}']
    with server_pair(tmp_path, JUDGE_CONFIG, env, args) as urls:
        body = {"prompts": [[c, QA] for c in CAPTIONS], "query": [], "labels": []}
        ours, theirs = post(urls["ray-serve"], "/get_reward", body), post(urls["uvicorn"], "/get_reward", body)
        health = httpx.get(f"{urls['ray-serve']}/health", timeout=10).json()
    assert ours.status_code == theirs.status_code == 200, ours.text
    ours_json, theirs_json = ours.json(), theirs.json()
    assert set(ours_json) == set(theirs_json) == {"rewards", "qa_rewards", "format_rewards"}
    assert ours_json["format_rewards"] == theirs_json["format_rewards"] == [timestamp_format(c) for c in CAPTIONS]
    for key in ("qa_rewards", "rewards"):  # the judge's float math may batch differently
        assert ours_json[key] == pytest.approx(theirs_json[key], abs=1e-5), key
    assert len(set(ours_json["qa_rewards"])) > 1  # a random judge, but not a constant one
    assert health["rewards"] == ["length", "caption_qa", "timestamp_format"] and health["workers_alive"] == 3


@needs_serve
def test_auth_health_and_metrics(servers):
    url = servers["ray-serve"]
    body = {"reward": "rules", "samples": [{"completion": "[00:01] a dog", "reference": "1"}]}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        ours, theirs = post(url, "/v1/score", body, headers), post(servers["uvicorn"], "/v1/score", body, headers)
        assert ours.status_code == theirs.status_code == 401
        assert ours.json() == theirs.json()
    assert post(url, "/get_reward", {"prompts": []}, {}).status_code == 401
    health = httpx.get(f"{url}/health", timeout=10)  # no key needed
    assert health.status_code == 200, health.text
    info = health.json()
    assert info["ready"] is True and info["error"] is None
    assert info["rewards"] == httpx.get(f"{servers['uvicorn']}/health", timeout=10).json()["rewards"]
    assert info["workers"] == info["workers_alive"] == REWARD_REPLICAS
    before = metric(url, "rl_rewards_samples_total", reward="rules")
    assert scores(post(url, "/v1/score", {**body, "samples": body["samples"] * 3})) == [1.0 + 0.2 * 1.0 + 0.2 * 1.0] * 3
    assert metric(url, "rl_rewards_samples_total", reward="rules") == before + 3
    assert metric(url, "rl_rewards_requests_total", route="/v1/score", status="401") >= 2
    assert metric(url, "rl_rewards_batch_size_count", reward="rules") >= 1


class Call(NamedTuple):
    pid: int
    samples: int
    at: float
    """`time.monotonic()` in the replica as the call started (the machine's clock, as the test's)."""


class Calls:
    """The probe's log: each scorer call since `Calls(path)` was made (or since the last `read`)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, path.stat().st_size

    def read(self) -> list[Call]:
        with self.path.open() as f:
            f.seek(self.offset)
            text = f.read()
        text = text[: text.rfind("\n") + 1]  # a line being written is read next time
        self.offset += len(text)
        return [Call(int(pid), int(n), float(at)) for pid, n, at in (line.split() for line in text.splitlines())]


def probe(n: int) -> dict:
    return {"reward": "probe", "samples": [{"completion": f"sample {i}"} for i in range(n)]}


@needs_serve
def test_two_replicas_share_the_requests(servers):
    calls = Calls(servers["calls"])
    for response in concurrently(servers["ray-serve"], [probe(4)] * 32):
        scores(response)
    samples = Counter()
    for call in calls.read():
        samples[call.pid] += call.samples
    print(f"\nsamples per replica process: {dict(samples)}")
    assert sum(samples.values()) == 32 * 4
    assert len(samples) == 2 and min(samples.values()) >= 4, samples  # each scored at least a whole request


@needs_serve
def test_concurrent_single_sample_requests_are_batched_in_the_replica(servers):
    """Each request is one call to the deployment (the ingress does not batch); a sample's score
    is the size of the scorer call it came in: more than one, so the replica merged calls."""
    url, calls = servers["ray-serve"], Calls(servers["calls"])
    before = metric(url, "rl_rewards_batch_size_count", reward="probe")
    sizes = [scores(r)[0] for r in concurrently(url, [probe(1)] * 24)]
    batches = [call.samples for call in calls.read()]
    print(f"\n24 single-sample requests were scored in {len(batches)} scorer call(s) of {sorted(batches)} samples")
    assert sum(batches) == 24 and len(batches) < 24
    assert max(sizes) > 1 and sorted(set(sizes)) == sorted(set(batches))
    assert metric(url, "rl_rewards_batch_size_count", reward="probe") - before == len(batches)


class Fault(NamedTuple):
    pid: int
    signal: str
    at: float
    replaced_by: int
    recovery_s: float
    """From the signal to the replacement replica's first scorer call."""


async def fault(calls: Calls, victim: int, sig: signal.Signals, known: set[int], within_s: float = 120) -> Fault:
    """Send `sig` to replica `victim` as it starts a batch (its log line appears), then wait for a
    replica process not in `known` to start one: the replacement Ray Serve started."""
    waiting = time.monotonic()
    while victim not in {call.pid for call in calls.read()}:
        assert time.monotonic() - waiting < within_s, f"replica {victim} took no call within {within_s:.0f} s"
        await asyncio.sleep(0.005)
    os.kill(victim, sig)
    at = time.monotonic()
    while time.monotonic() - at < within_s:
        new = [call for call in calls.read() if call.pid not in known]
        if new:
            return Fault(victim, sig.name, at, new[0].pid, new[0].at - at)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no new replica took a call within {within_s:.0f} s of {sig.name} to replica {victim}")


def replica_pids(url: str, calls_log: Path) -> set[int]:
    """The probe's 2 replica processes, from the calls of a few rounds of concurrent requests."""
    calls, pids = Calls(calls_log), set()
    for _ in range(10):
        for response in concurrently(url, [probe(1)] * 16):
            scores(response)
        pids |= {call.pid for call in calls.read()}
        if len(pids) == 2:
            return pids
    raise AssertionError(f"expected 2 probe replicas, saw the calls of {sorted(pids)}")


@needs_serve
def test_a_call_slower_than_the_chunk_deadline_on_a_live_replica_is_still_answered(servers):
    """Tries are hedged: `slow`'s one replica takes 1.5 chunk deadlines a call. The first try
    misses its deadline and the piece is sent again, but the first try stays pending and its late
    answer is taken (a cancelled first try would leave the second queued behind it on the same
    replica: it would miss too, and the third, and the request get 503)."""
    url = servers["ray-serve"]
    misses = metric(url, "rl_rewards_chunk_deadline_misses_total")
    started = time.monotonic()
    response = post(url, "/v1/score", {"reward": "slow", "samples": [{"completion": "late"}]})
    seconds = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert scores(response) == [1.0]
    assert metric(url, "rl_rewards_chunk_deadline_misses_total") == misses + 1
    assert SLOW_S <= seconds < 2 * CHUNK_DEADLINE_S


@needs_serve
def test_a_replica_killed_and_one_stopped_under_load_lose_no_request(servers):
    """8 clients send 8-sample requests to `probe` (2 replicas, busy 0.2 s a batch) the whole time.
    One replica is SIGKILLed as it starts a batch; once its replacement takes calls, the other is
    SIGSTOPped (hung: its process runs no code) as it starts one. Every request is answered 200
    with real scores, with the default 3 tries: the calls lost with the killed replica are sent
    again at once, those held by the stopped one after `chunk_deadline_s` (hedged: a busy replica's
    late answer is still taken, so a loaded machine does not turn slow calls into 503s), to another replica
    (the ingress's router probes the replicas' queues, and the stopped one answers no probe:
    `INGRESS_ENV`); Ray Serve replaces the killed
    one, and kills and replaces the stopped one once it missed its health checks for about
    `heartbeat_timeout_s`.
    Recovery: from the signal to the replacement's first call."""
    url = servers["ray-serve"]
    first, second = sorted(replica_pids(url, servers["calls"]))
    names = ("rl_rewards_chunk_retries_total", "rl_rewards_chunk_deadline_misses_total")
    before = {name: metric(url, name) for name in names}

    async def scenario() -> tuple[list[tuple[httpx.Response, float]], list[Fault]]:
        answered: list[tuple[httpx.Response, float]] = []
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            async def client_loop() -> None:
                while not done.is_set():
                    started = time.monotonic()
                    response = await client.post("/v1/score", json=probe(8))
                    answered.append((response, time.monotonic() - started))

            loops = [asyncio.create_task(client_loop()) for _ in range(8)]
            calls = Calls(servers["calls"])
            try:
                killed = await fault(calls, first, signal.SIGKILL, {first, second})
                stopped = await fault(calls, second, signal.SIGSTOP, {first, second, killed.replaced_by})
            finally:
                done.set()
                await asyncio.gather(*loops)
                with contextlib.suppress(ProcessLookupError):  # Ray Serve would wait shutdown_timeout_s for it
                    os.kill(second, signal.SIGKILL)
        return answered, [killed, stopped]

    answered, faults = asyncio.run(scenario())
    statuses = Counter(response.status_code for response, _ in answered)
    lost = [response.text for response, _ in answered if response.status_code != 200]
    assert statuses == {200: len(answered)}, (statuses, lost)
    served = [s for response, _ in answered for s in scores(response)]
    assert all(s >= 1 for s in served)  # a batch size: never a 0 reward
    slowest = max(seconds for _, seconds in answered)
    for f in faults:
        print(f"\nreplica {f.pid} {f.signal}: replacement {f.replaced_by} took its first call {f.recovery_s:.1f} s after")
    print(f"{len(answered)} requests ({len(served)} samples) under load, 0 lost, the slowest answered in {slowest:.1f} s")
    after = {name: metric(url, name) for name in names}
    assert after[names[0]] >= before[names[0]] + 2  # calls of the killed and of the stopped replica sent again
    assert after[names[1]] > before[names[1]]  # those of the stopped one after the chunk deadline
    # no request hung: the last try waits past its chunk deadline (until request_timeout_s), and
    # one held by the stopped replica is answered at the latest once Ray Serve killed that one
    # (missed health checks, about heartbeat_timeout_s, then killed at once: CONTROLLER_ENV; a
    # graceful stop waited shutdown_timeout_s, 30 s, and 1 run in 7 answered a request in 34.2 s)
    assert slowest < HEARTBEAT_TIMEOUT_S + (TRIES + 1) * CHUNK_DEADLINE_S


@needs_serve
def test_ray_serve_settings_that_cannot_run_are_refused(tmp_path):
    """Through the CLI (in this process: it stops before starting anything): exit 2 and one line
    naming the table; and the checks behind it."""
    from rl_rewards.server.ray_serve import check_ray_serve

    config = tmp_path / "server.toml"
    config.write_text("[ray_serve.rewards.judge]\nnum_gpus = 1\n")
    run = CliRunner().invoke(cli, ["serve", "--backend", "ray-serve", "--config", str(config)])
    assert run.exit_code == 2, run.output
    assert run.stderr.strip().splitlines() == [(
        "rl-rewards serve: error: [ray_serve.rewards.judge] names no served reward; served rewards: "
        + ", ".join(["timestamp_format", "length", *(["ocr"] if importlib.util.find_spec("rapidocr") else [])])
    )]
    for toml, error in [
        ("[ray_serve]\nmin_replicas = 1\n", "set both min_replicas and max_replicas"),
        ("[ray_serve.rewards.length]\nmin_replicas = 3\nmax_replicas = 2\n", "0 <= min_replicas <= max_replicas"),
        ("[ray_serve.rewards.length]\nnum_gpu = 1\n", "[ray_serve.rewards.length]: Object contains unknown field `num_gpu`"),
        ("[ray_serve.rewards.length]\nbatch_wait_ms = -1\n", "batch_wait_ms >= 0"),
        ('[rewards.judge]\nmax_concurrency = 2\n[rewards.judge.components.n]\nscorer = "length"\n'
         "[ray_serve.rewards.judge]\nmin_replicas = 1\nmax_replicas = 4\n",
         "[rewards.judge] max_concurrency = 2 but its deployment may run 4 replicas"),
    ]:
        config.write_text(toml)
        with pytest.raises(ValueError) as caught:
            check_ray_serve(load_settings(config, {"backend": "ray-serve"}, environ={}))
        assert error in str(caught.value)
    with pytest.raises(ValueError, match="scales with Ray Serve replicas"):
        load_settings(None, {"backend": "ray-serve", "workers": 2}, environ={}).check()


@pytest.mark.no_torch
def test_backend_ray_serve_without_the_extra_names_it(monkeypatch):
    """Where Ray Serve is not installed (`ray` made unimportable in this process, as without the
    extra), `rl-rewards serve --backend ray-serve` says what to install: exit 2, one line."""
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "rl_rewards.server.ray_serve", raising=False)
    run = CliRunner().invoke(cli, ["serve", "--backend", "ray-serve"])
    assert run.exit_code == 2, run.output
    assert run.stderr.strip().splitlines() == [
        'rl-rewards serve: error: --backend ray-serve needs Ray Serve: pip install "rl-rewards[ray-serve]"; in a clone '
        "of the repository: uv sync --all-packages --extra ray-serve"
    ]


@needs_serve
@pytest.mark.skipif(sys.platform != "linux", reason="Ray Serve's HAProxy comes with Ray on Linux only")
def test_a_haproxy_that_outlived_its_ray_is_stopped_and_frees_its_port(tmp_path):
    """`serve` stops a local Ray's HAProxy after `ray.shutdown()` (`stop_haproxy`): in a CI run
    one outlived its manager actor and held the server's port. The real binary Ray Serve runs,
    orphaned as it was (its parent gone), its config in a folder named after the node as Ray
    Serve lays it out; another node's HAProxy is left alone."""
    from ray.serve._private.haproxy import get_haproxy_binary

    from rl_rewards.server.process import free_port
    from rl_rewards.server.ray_serve import stop_haproxy

    def orphaned_haproxy(node_id: str, port: int) -> int:
        folder = tmp_path / "haproxy-serve" / node_id
        folder.mkdir(parents=True)
        (folder / "haproxy.cfg").write_text(
            f"defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\n"
            f"frontend f\n  bind 127.0.0.1:{port}\n  http-request return status 200\n")
        # the shell starts HAProxy in the background and exits: HAProxy's parent is gone
        shell = subprocess.run(["sh", "-c", f'"{get_haproxy_binary()}" -db -f "{folder}/haproxy.cfg" '
                                f'>/dev/null 2>&1 & echo $!'], capture_output=True, text=True, check=True)
        pid = int(shell.stdout)
        deadline = time.monotonic() + 10
        while not answers(port):  # it took the port
            assert time.monotonic() < deadline, f"HAProxy {pid} did not open port {port}"
            time.sleep(0.05)
        return pid

    def answers(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    ours, theirs = "a" * 56, "b" * 56  # node ids: 56 hex digits
    port, other_port = free_port(), free_port()
    pid, other = orphaned_haproxy(ours, port), orphaned_haproxy(theirs, other_port)
    try:
        assert stop_haproxy(ours) == [pid]
        with socket.socket() as s:  # a server can listen on the port again (as servers do, past the
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections' TIME_WAIT)
            s.bind(("127.0.0.1", port))
            s.listen()
        assert answers(other_port)
    finally:
        assert stop_haproxy(theirs) == [other]
    assert stop_haproxy(ours) == stop_haproxy(theirs) == []


@needs_serve
def test_haproxy_ports_are_outside_the_ranges_the_os_and_ray_hand_out():
    """`throughput_env`'s listener ports come from 20000-32767: Linux gives `bind(0)` and outgoing
    connections ports from its ephemeral range and Ray its workers 10002-19999, and a port taken
    from those between the check and HAProxy's bind stopped a CI run ("Address already in use").
    A taken port is passed over."""
    from rl_rewards.server import ray_serve

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    env = ray_serve.throughput_env()
    ports = [int(env[k]) for k in env if k.endswith("_PORT")]
    assert len(ports) == 6 and all(20000 <= p < 32768 and not low <= p <= high for p in ports), ports
    assert int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) - int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]) == 63
    with _taken_beside_a_free_port() as taken:
        busy = taken.getsockname()[1]  # taken here; busy + 1 was free a moment ago
        ray_serve.LISTENER_PORTS, saved = range(busy, busy + 3), ray_serve.LISTENER_PORTS
        try:
            assert ray_serve.listener_port() == busy + 1
            with pytest.raises(RuntimeError, match="no 2 free port"):
                ray_serve.listener_port(span=2)
        finally:
            ray_serve.LISTENER_PORTS = saved


def _taken_beside_a_free_port() -> socket.socket:
    """A socket bound to a port whose next port binds too (checked, then released)."""
    for _ in range(50):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        with socket.socket() as neighbour:
            try:
                neighbour.bind(("127.0.0.1", taken.getsockname()[1] + 1))
            except OSError:
                taken.close()
                continue
        return taken
    raise AssertionError("no port with a free neighbour in 50 tries")
