"""Reward server throughput: `rl-rewards serve` vs a CapRL-style master/worker service.

CPU part (default): rule scoring (timestamp format + length counted in whitespace words, no
model) through HTTP, 64 captions per request, 16 concurrent clients, for `--seconds` each.
Baseline, measured in the same run, is built the way CapRL++'s reward service is (docs/reference.md
§1): a master HTTP app whose synchronous handler decodes the JSON with `json`, cuts the batch
into ceil(B/N) chunks (N = 1 worker) and posts each chunk to its worker over HTTP; the worker's
synchronous handler serves one request at a time and scores in Python. Both run under uvicorn
with starlette (a FastAPI `def` endpoint is the same shape: a starlette sync endpoint in the
threadpool). The load generator speaks raw HTTP/1.1 keep-alive on asyncio streams, so the
client costs the same for both and little.

GPU part (`--gpu --model PATH`): caption_qa `exact` through the server (CapRL `/get_reward` qa
requests) vs the same scorer in-process — the server's overhead on judge throughput.

Ray Serve part (`--backend ray-serve`, needs `rl-rewards[ray-serve]`): for each replica count of
`--replicas` (1,2,4,8), the reward on N Ray Serve replicas (`--backend ray-serve`, a local Ray
each) vs the multi-process server with N workers (`--workers N`), `--clients` (64) concurrent
clients: samples/s, p50 and p99. Rules on the CPU by default; with `--gpu --model PATH` the
caption_qa judge, one GPU per replica (`num_gpus = 1`) vs one per worker (`CUDA_VISIBLE_DEVICES`),
CapRL qa requests of `--captions-per-request` captions x 8 questions.

    python benchmarks/reward_server.py            # CPU, appends to RESULTS.md
    python benchmarks/reward_server.py --smoke    # seconds, prints only
    python benchmarks/reward_server.py --gpu --model /models/Qwen3-4B-Instruct-2507
    python benchmarks/reward_server.py --backend ray-serve --replicas 1,2 --smoke      # CPU rules
    python benchmarks/reward_server.py --backend ray-serve --gpu --model /models/Qwen3-4B-Instruct-2507
    python benchmarks/reward_server.py --backend judge-batching --smoke                  # tiny judge, CPU
    python benchmarks/reward_server.py --backend judge-batching --gpu --model /models/Qwen3-4B-Instruct-2507

Judge batching part (`--backend judge-batching`): one judge replica (caption_qa exact; the tiny
random Qwen3 of `rl_models.tiny` on the CPU by default, `--gpu --model PATH` on one GPU) under
Ray Serve, `--clients` clients each sending single samples: replica batching with max_batch_size
`--batch-size` vs max_batch_size 1 (batching off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import append_results

SETUPS = [  # (row label, `rl-rewards serve` flags)
    ("rl-rewards serve (one process, rules scored inline)", ["--workers", "0"]),
    ("rl-rewards serve --workers 2", ["--workers", "2"]),
    ("rl-rewards serve --http-processes 2", ["--http-processes", "2"]),
]
CAPTIONS_PER_REQUEST = 64
CLIENTS = 16
REWARD_TOML = """
[rewards.caption.components.format]
scorer = "timestamp_format"
weight = 0.2
[rewards.caption.components.length]
scorer = "length"
weight = 0.2
options = { tokenizer = "whitespace", l1 = 2048, l2 = 3072 }
"""


def make_captions(n: int, seed: int = 0) -> list[str]:
    words = ["the", "a", "red", "dog", "runs", "across", "green", "field", "while", "person", "waves", "camera", "pans", "left", "slowly"]
    out = []
    for i in range(n):
        parts = []
        for k in range(6):
            second = (seed + 7 * i + 9 * k) % 60
            body = " ".join(words[(i + k + j) % len(words)] for j in range(20))
            parts.append(f"[{k:02d}:{second:02d}] {body}.")
        out.append(" ".join(parts))
    return out


def rule_score(caption: str) -> float:
    """What both servers compute: 0.2*R_fmt + 0.2*R_len (whitespace words, l1=2048, l2=3072)."""
    from rl_rewards.rules import length_reward, timestamp_format

    return 0.2 * timestamp_format(caption) + 0.2 * length_reward(len(caption.split()), 2048, 3072)


# ----------------------------------------------------------------------------- CapRL-style baseline


def fastapi_style(handler):
    """A FastAPI `def` endpoint: JSON parsed in the event loop, the handler run in the threadpool,
    the result serialized with `json`."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import Response

    async def endpoint(request: Request) -> Response:
        payload = json.loads(await request.body())
        result = await run_in_threadpool(handler, payload)
        return Response(json.dumps(result), media_type="application/json")

    return endpoint


def baseline_worker_app():
    from starlette.applications import Starlette
    from starlette.routing import Route

    lock = threading.Lock()  # CapRL workers serve one request at a time

    def get_reward(body: dict) -> dict:
        with lock:
            return {"rewards": [rule_score(s["completion"]) for s in body["samples"]]}

    return Starlette(routes=[Route("/get_reward", fastapi_style(get_reward), methods=["POST"])])


def baseline_master_app(worker_urls: list[str]):
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Route

    # a pooled client (kinder to the baseline than a new connection per chunk, as requests.post does)
    http = httpx.Client(timeout=180)

    def get_reward(body: dict) -> dict:
        samples = body["samples"]
        size = math.ceil(len(samples) / len(worker_urls))
        rewards: list[float] = []
        for i, url in enumerate(worker_urls):  # chunk i -> worker i; any failure fails the batch
            chunk = samples[i * size : (i + 1) * size]
            r = http.post(f"{url}/get_reward", content=json.dumps({"samples": chunk}))
            r.raise_for_status()
            rewards += r.json()["rewards"]
        return {"rewards": rewards}

    return Starlette(routes=[Route("/get_reward", fastapi_style(get_reward), methods=["POST"])])


def serve_role(role: str, port: int, worker_url: str) -> None:
    import uvicorn

    app = baseline_worker_app() if role == "worker" else baseline_master_app([worker_url])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ----------------------------------------------------------------------------- load generator


async def _one_client(host: str, port: int, request: bytes, stop_at: float, latencies: list[float]) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    done = 0
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        latencies.append(time.perf_counter() - started)
        done += 1
    writer.close()
    return done


def load(url: str, path: str, body: bytes, seconds: float, clients: int,
         per_request: int = CAPTIONS_PER_REQUEST) -> tuple[float, float, float]:
    """(samples/s, p50 ms, p99 ms) with `clients` keep-alive connections for `seconds`
    (`per_request` samples a request)."""
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    latencies: list[float] = []

    async def main() -> tuple[int, float]:
        warm_until = time.perf_counter() + min(1.0, seconds / 4)
        await asyncio.gather(*(_one_client(host, int(port), request, warm_until, []) for _ in range(clients)))
        # timed from here: the warm-up's last calls can take seconds to drain (a judge's p50 is
        # seconds at 64 clients), which "elapsed minus 1 s of warm-up" counted as measured time
        started = time.perf_counter()
        stop_at = started + seconds
        counts = await asyncio.gather(*(_one_client(host, int(port), request, stop_at, latencies) for _ in range(clients)))
        return sum(counts), time.perf_counter() - started

    requests, elapsed = asyncio.run(main())
    q = statistics.quantiles(latencies, n=100)
    return requests * per_request / elapsed, q[49] * 1000, q[98] * 1000


def _wait(url: str, path: str = "/health", timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code in (200, 405):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def _wait_processes(url: str, count: int, timeout: float = 60) -> None:
    """Until `count` distinct server processes answer /health (each listens once it has loaded;
    connections opened before would all reach the first)."""
    import httpx

    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(seen)} of {count} server processes answered {url}/health")
        seen.add(httpx.get(f"{url}/health", timeout=5).json()["pid"])


def cpu_benchmark(seconds: float, smoke: bool) -> list[list[object]]:
    import httpx

    from rl_rewards.server.process import ServerProcess, free_port

    captions = make_captions(CAPTIONS_PER_REQUEST)
    expected = [rule_score(c) for c in captions]
    body = json.dumps({"reward": "caption", "samples": [{"completion": c} for c in captions]}).encode()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "rewards.toml"
        config.write_text(REWARD_TOML)
        ours_rows = {}
        for label, extra in SETUPS:
            args = ["--config", str(config), "--max-wait-ms", "1", "--log-level", "warning", *extra]
            with ServerProcess(args) as ours:
                _wait_processes(ours.url, int(extra[1]) if extra[0] == "--http-processes" else 1)
                got = [r["score"] for r in httpx.post(f"{ours.url}/v1/score", content=body).json()["results"]]
                assert all(math.isclose(a, b) for a, b in zip(got, expected, strict=True)), "ours: wrong rewards"
                ours_rows[label] = load(ours.url, "/v1/score", body, seconds, CLIENTS)
        worker_port, master_port = free_port(), free_port()
        worker_url = f"http://127.0.0.1:{worker_port}"
        procs = [
            subprocess.Popen([sys.executable, __file__, "--role", "worker", "--port", str(worker_port)]),
            subprocess.Popen([sys.executable, __file__, "--role", "master", "--port", str(master_port), "--worker-url", worker_url]),
        ]
        try:
            master_url = f"http://127.0.0.1:{master_port}"
            _wait(worker_url, "/get_reward")
            _wait(master_url, "/get_reward")
            got = httpx.post(f"{master_url}/get_reward", content=body, timeout=60).json()["rewards"]
            assert all(math.isclose(a, b) for a, b in zip(got, expected, strict=True)), "baseline: wrong rewards"
            base_row = load(master_url, "/get_reward", body, seconds, CLIENTS)
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    rows.append(["CapRL-style master + 1 worker (baseline)", f"{base_row[0]:.0f}", f"{base_row[1]:.1f}", f"{base_row[2]:.1f}", "1.00x"])
    for label, _ in SETUPS:
        row = ours_rows[label]
        rows.append([label, f"{row[0]:.0f}", f"{row[1]:.1f}", f"{row[2]:.1f}", f"{row[0] / base_row[0]:.2f}x"])
    return rows


# ----------------------------------------------------------------------------- GPU part


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _free_accelerator_memory() -> None:
    """Give the in-process judge's GPU memory back before the server loads its own copy."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_benchmark(model: str, captions: int, qa_per_caption: int, rounds: int) -> list[list[object]]:
    """caption_qa exact: in-process scorer vs the same scorer behind `rl-rewards serve`."""
    import httpx

    from rl_rewards.registry import build_scorer
    from rl_rewards.samples import Sample
    from rl_rewards.server.process import ServerProcess

    qa = [[f"Question {j}?\n   - A) red\n   - B) blue\n   - C) green\n   - D) none", "A"] for j in range(qa_per_caption)]
    texts = make_captions(captions)
    samples = [Sample(completion=c, reference=qa) for c in texts]
    progress(f"loading the in-process scorer from {model}")
    scorer = build_scorer("caption_qa", model=model, estimator="exact", task="video")
    scorer.score(samples[:8])  # warm-up
    progress("in-process: timing")
    started = time.perf_counter()
    for i in range(rounds):
        scorer.score(samples)
        progress(f"in-process round {i + 1}/{rounds}: {time.perf_counter() - started:.1f} s")
    inproc = rounds * captions / (time.perf_counter() - started)
    del scorer
    _free_accelerator_memory()
    body = {"prompts": [[c, qa] for c in texts], "query": [], "labels": []}
    args = ["--model", model, "--judge-option", "estimator=exact", "--task", "video", "--max-wait-ms", "5"]
    progress("starting rl-rewards serve")
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    progress(f"server log: {log_path}")
    with ServerProcess(args, ready_timeout=900, log_path=log_path) as server, httpx.Client(timeout=900) as http:
        http.post(f"{server.url}/get_reward", json={**body, "prompts": body["prompts"][:8]}).raise_for_status()
        progress("served: timing")
        started = time.perf_counter()
        for i in range(rounds):
            r = http.post(f"{server.url}/get_reward", json=body)
            r.raise_for_status()
            progress(f"served round {i + 1}/{rounds}: {time.perf_counter() - started:.1f} s")
        served = rounds * captions / (time.perf_counter() - started)
    return [
        ["caption_qa exact, in-process", f"{inproc:.1f}", "1.00x"],
        ["caption_qa exact, through rl-rewards serve", f"{served:.1f}", f"{served / inproc:.2f}x"],
    ]


# ----------------------------------------------------------------------------- Ray Serve part


def ray_serve_benchmark(replicas: list[int], clients: int, seconds: float, model: str | None,
                        per_request: int) -> list[list[object]]:
    """For each N of `replicas`: the multi-process server with N workers, then the Ray Serve
    backend with N replicas of the scored reward, under the same load (`clients` connections).
    `model`: the caption_qa judge on one GPU per worker/replica; None: the rules on the CPU."""
    import httpx

    from rl_rewards.server.process import ServerProcess

    if model is None:
        captions = make_captions(per_request)
        reward, path = "caption", "/v1/score"
        body = json.dumps({"reward": reward, "samples": [{"completion": c} for c in captions]}).encode()
        expected: list[float] | None = [rule_score(c) for c in captions]
        base_args, toml, cpus = ["--max-wait-ms", "1"], REWARD_TOML, 0.1  # logical CPUs: N replicas fit any machine
    else:
        qa = [[f"Question {j}?\n   - A) red\n   - B) blue\n   - C) green\n   - D) none", "A"] for j in range(8)]
        reward, path, expected = "caption_qa", "/get_reward", None
        body = json.dumps({"prompts": [[c, qa] for c in make_captions(per_request)], "query": [], "labels": []}).encode()
        base_args = ["--model", model, "--judge-option", "estimator=exact", "--task", "video", "--max-wait-ms", "5"]
        # served: the judge and the video format reward (a configured reward keeps the default rules out)
        toml, cpus = '[rewards.timestamp_format.components.format]\nscorer = "timestamp_format"\n', 1.0
    rows, single = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in replicas:
            figures = {}
            for backend in ("workers", "ray-serve"):
                config = Path(tmp) / f"{backend}-{n}.toml"
                env: dict[str, str] = {}
                if backend == "workers":
                    config.write_text(toml)
                    args = [*base_args, "--config", str(config), "--workers", str(n), "--log-level", "warning"]
                    if model is not None:
                        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
                else:
                    gpus = "\nnum_gpus = 1" if model is not None else ""
                    ingress = n if model is None else 1  # rules: an ingress replica parses as fast as a replica scores
                    config.write_text(f"{toml}\n[ray_serve]\nnum_cpus = {cpus}\nbatch_wait_ms = 5\n"
                                      f"ingress_replicas = {ingress}\n"
                                      f"[ray_serve.rewards.{reward}]\nnum_replicas = {n}{gpus}\n")
                    args = [*base_args, "--config", str(config), "--backend", "ray-serve", "--log-level", "warning"]
                label = f"{backend} x{n}"
                progress(f"{label}: starting")
                log_path = Path(tmp) / f"{backend}-{n}.log"
                mode = {"RL_REWARDS_RAY_SERVE_HIGH_THROUGHPUT": "1"} if backend == "ray-serve" else {}
                with ServerProcess(args, env={**(env or {}), **mode}, ready_timeout=900, log_path=log_path) as server:
                    first = httpx.post(f"{server.url}{path}", content=body, timeout=900)
                    first.raise_for_status()
                    if expected is not None:
                        got = [r["score"] for r in first.json()["results"]]
                        assert all(math.isclose(a, b) for a, b in zip(got, expected, strict=True)), f"{label}: wrong rewards"
                    if backend == "ray-serve":
                        time.sleep(HAPROXY_SETTLE_S)
                    figures[backend] = load(server.url, path, body, seconds, clients, per_request)
                progress(f"{label}: {figures[backend][0]:.0f} samples/s, p50 {figures[backend][1]:.1f} ms, "
                         f"p99 {figures[backend][2]:.1f} ms")
            base = figures["workers"][0]
            for backend, name in (("workers", f"rl-rewards serve --workers {n}"),
                                  ("ray-serve", f"rl-rewards serve --backend ray-serve, {n} replica(s)")):
                rate, p50, p99 = figures[backend]
                first_n, first_rate = single.setdefault(backend, (n, rate))  # the smallest count's row
                rows.append([name, n, f"{rate:.1f}" if model else f"{rate:.0f}", f"{p50:.1f}", f"{p99:.1f}",
                             f"{rate / (n / first_n * first_rate):.2f}", f"{rate / base:.2f}x"])
    return rows


JUDGE_QUESTIONS = 4
HAPROXY_SETTLE_S = 5.0
"""After a Ray Serve server answers: HAProxy reloads its config as the deployments settle, and a
reload closes the keep-alive connections open then (the load generator does not reconnect)."""


def judge_batching_benchmark(model: str, gpu: bool, clients: int, seconds: float,
                             batch_size: int) -> list[list[object]]:
    """One judge replica under Ray Serve, `clients` concurrent clients each sending one sample
    (a caption and its questions) a request: replica batching (`max_batch_size`
    `batch_size`) vs batching off (`max_batch_size = 1`: the replica scores one call at a time)."""
    import httpx

    from rl_rewards.server.process import ServerProcess

    qa = [[f"Question {j}?\n   - A) red\n   - B) blue\n   - C) green\n   - D) none", "A"] for j in range(JUDGE_QUESTIONS)]
    caption = make_captions(1)[0]
    body = json.dumps({"reward": "caption_qa", "samples": [{"completion": caption, "reference": qa}]}).encode()
    device = [] if gpu else ["--judge-option", 'engine_options={"device": "cpu"}']
    args = ["--model", model, "--judge-option", "estimator=exact", *device, "--task", "video",
            "--backend", "ray-serve", "--log-level", "warning"]
    toml = '[rewards.timestamp_format.components.format]\nscorer = "timestamp_format"\n'
    resources = "num_gpus = 1" if gpu else "num_cpus = 1"
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in (batch_size, 1):
            config = Path(tmp) / f"judge-{size}.toml"
            config.write_text(f"{toml}\n[ray_serve]\nnum_cpus = 0.1\n[ray_serve.rewards.caption_qa]\n{resources}\n"
                              f"max_batch_size = {size}\nbatch_wait_ms = {5 if size > 1 else 0}\n"
                              # both hold every client's call: with 1, Ray Serve's router keeps the rest and
                              # retries them with backoff, and the replica idles between calls
                              f"max_ongoing_requests = {batch_size}\n")
            progress(f"judge, max_batch_size {size}: starting")
            with ServerProcess([*args, "--config", str(config)], env={"OMP_NUM_THREADS": "1",
                               "RL_REWARDS_RAY_SERVE_HIGH_THROUGHPUT": "1"}, ready_timeout=900,
                               log_path=Path(tmp) / f"judge-{size}.log") as server:
                first = httpx.post(f"{server.url}/v1/score", content=body, timeout=900)
                first.raise_for_status()
                assert first.json()["results"][0]["error"] is None, first.text
                time.sleep(HAPROXY_SETTLE_S)
                figures[size] = load(server.url, "/v1/score", body, seconds, clients, 1)
                batches = metric_sum(server.url, "rl_rewards_batch_size", "caption_qa")
            progress(f"judge, max_batch_size {size}: {figures[size][0]:.1f} samples/s, p50 {figures[size][1]:.0f} ms, "
                     f"mean batch {batches:.1f}")
            figures[size] = (*figures[size], batches)
    base = figures[1][0]
    return [[f"1 judge replica, max_batch_size {size}" + (" (batching off)" if size == 1 else ""), size,
             f"{figures[size][0]:.1f}", f"{figures[size][1]:.0f}", f"{figures[size][2]:.0f}", f"{figures[size][3]:.1f}",
             f"{figures[size][0] / base:.2f}x"] for size in (1, batch_size)]


def metric_sum(url: str, histogram: str, reward: str) -> float:
    """Mean of a histogram of the server's /metrics for one reward (_sum / _count)."""
    import httpx

    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for part in ("_sum", "_count"):
            if line.startswith(f'{histogram}{part}{{reward="{reward}"}}'):
                values[part] = float(line.rsplit(" ", 1)[1])
    return values["_sum"] / values["_count"] if values.get("_count") else 0.0


def _fast_http() -> str:
    import importlib.util

    found = [m for m in ("uvloop", "httptools") if importlib.util.find_spec(m) is not None]
    return ", ".join(found) + " installed" if found else "neither installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny run, print only")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--gpu", action="store_true", help="caption_qa through the server vs in-process")
    parser.add_argument("--model", help="judge checkpoint for --gpu")
    parser.add_argument("--captions", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", choices=["uvicorn", "ray-serve", "judge-batching"], default="uvicorn",
                        help="ray-serve: Ray Serve replicas vs --workers, for each of --replicas; judge-batching: "
                             "a judge replica batching vs max_batch_size 1 (--model, default tiny:qwen3)")
    parser.add_argument("--batch-size", type=int, default=64, help="judge-batching: max_batch_size when batching")
    parser.add_argument("--replicas", default="1,2,4,8", help="replica/worker counts for --backend ray-serve")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients for --backend ray-serve")
    parser.add_argument("--captions-per-request", type=int, default=None,
                        help="--backend ray-serve: samples per request (64 rules, 8 judge captions)")
    parser.add_argument("--role", choices=["worker", "master"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        serve_role(args.role, args.port, args.worker_url)
        return
    if args.gpu and not args.model and args.backend != "judge-batching":
        parser.error("--gpu needs --model PATH (the judge checkpoint)")
    if args.backend == "ray-serve":
        replicas = [int(n) for n in args.replicas.split(",")]
        per_request = args.captions_per_request or (8 if args.gpu else CAPTIONS_PER_REQUEST)
        seconds = 3.0 if args.smoke else args.seconds
        rows = ray_serve_benchmark(replicas, args.clients, seconds, args.model if args.gpu else None, per_request)
        unit = "captions/s" if args.gpu else "samples/s"
        header = ["setup", "replicas/workers", unit, "p50 ms", "p99 ms", "scaling efficiency", "vs --workers N"]
        what = (f"caption_qa exact (one GPU per worker/replica), CapRL qa requests of {per_request} captions x 8 questions"
                if args.gpu else f"rules (format + length), {per_request} captions/request")
        title = f"Reward server: Ray Serve replicas vs worker processes, {what}, {args.clients} clients"
        notes = (f"{seconds:.0f} s per setup after 1 s warm-up; the multi-process server (`--workers N`) and the Ray "
                 f"Serve backend (N replicas of the reward, a local Ray each, Ray Serve's HAProxy mode"
                 f"{', N ingress replicas' if not args.gpu else ''}) in the same run, on this machine's "
                 f"{os.cpu_count()} cores. Scaling efficiency: samples/s / (N / N0 x samples/s at the smallest "
                 f"count N0 = {replicas[0]}) of the same backend (goal for Ray Serve: >= 0.85 at 8); the ratio is "
                 "against --workers N.")
    elif args.backend == "judge-batching":
        model = args.model or "tiny:qwen3"
        seconds = 3.0 if args.smoke else args.seconds
        rows = judge_batching_benchmark(model, args.gpu, args.clients, seconds, args.batch_size)
        header = ["setup", "max_batch_size", "samples/s", "p50 ms", "p99 ms", "mean batch", "vs batching off"]
        where = "one GPU" if args.gpu else "the CPU (1 logical CPU, OMP_NUM_THREADS=1)"
        title = (f"Reward server: Ray Serve dynamic batching of a judge ({model} on {where}), "
                 f"{args.clients} clients x 1 sample")
        notes = (f"caption_qa exact, {JUDGE_QUESTIONS} questions per caption, one sample per request (`/v1/score`), "
                 f"{seconds:.0f} s per setup after 1 s warm-up; one judge replica, `[ray_serve.rewards.caption_qa]` "
                 f"max_batch_size {args.batch_size} (batch_wait_ms 5) vs 1 (batch_wait_ms 0), both max_ongoing_requests "
                 f"{args.batch_size}, each in its own local Ray; mean batch from `rl_rewards_batch_size`. Goal: batching >= 4x batching off.")
    elif args.gpu:
        n = 8 if args.smoke else args.captions
        rows = gpu_benchmark(args.model, n, 8, 1 if args.smoke else args.rounds)
        header = ["setup", "captions/s", "vs in-process"]
        title = "Reward server: caption_qa exact through the server vs in-process"
        notes = f"{n} captions x 8 questions per request, {args.rounds} rounds. Goal: server >= 0.90x in-process."
    else:
        rows = cpu_benchmark(2.0 if args.smoke else args.seconds, args.smoke)
        header = ["setup", "samples/s", "p50 ms", "p99 ms", "speedup"]
        title = "Reward server: rule scoring over HTTP (format + length, 64 captions/request, 16 clients)"
        notes = (
            f"{args.seconds:.0f} s per system after 1 s warm-up; raw HTTP/1.1 keep-alive load generator. "
            "Baseline: starlette sync handlers (FastAPI `def` shape), master posts ceil(B/N) chunks to 1 worker "
            "that serves one request at a time (pooled httpx client master->worker). Both sides run in the same "
            f"environment (uvicorn picks uvloop/httptools when installed: {_fast_http()}). Load generator, servers and "
            f"baseline share this machine's {os.cpu_count()} cores. Goal: >= 5x samples/s at lower p99."
        )
    if args.smoke:
        from benchmarks.results import markdown_table

        print(markdown_table(header, rows))
    else:
        append_results(title, header, rows, notes)


if __name__ == "__main__":
    main()
