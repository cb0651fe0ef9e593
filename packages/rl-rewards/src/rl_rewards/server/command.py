"""`rl-rewards serve`: start the reward server (uvicorn) with the settings in effect.

Settings come from defaults < `--config` TOML < CapRL environment variables < flags (see
`rl_rewards.server.settings`). A CapRL++ user replaces their reward service with

    REWARD_MODEL=Qwen/Qwen3-4B-Instruct-2507 REWARD_PORT=18889 rl-rewards serve
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from rl_rewards.server.http_processes import serve_processes
from rl_rewards.server.limits import check_api_key
from rl_rewards.server.logs import configure_logging
from rl_rewards.server.rewards import resolve_judge_engine, reward_names
from rl_rewards.server.serving import listening_socket, serve
from rl_rewards.server.settings import ServerSettings, load_settings, to_json
from rl_rewards.server.workers import SETTINGS_ENV


def ignored_settings(settings: ServerSettings) -> list[str]:
    """Notes, in plain words, on CapRL++ settings that are accepted (so launch scripts keep
    working) but change nothing here."""
    if settings.worker_base_port is None:
        return []
    return [
        f"REWARD_WORKER_BASE={settings.worker_base_port} is not needed and is ignored: "
        "reward workers talk to the router over pipes, not ports; unset it to silence this"
    ]


def banner(settings: ServerSettings) -> None:
    """Print the configuration in effect (API key masked) to stderr."""
    table = Table(title=f"rl-rewards server on http://{settings.host}:{settings.port}", show_header=False)
    for key, value in msgspec.structs.asdict(settings).items():
        if key == "api_key" and value is not None:
            value = "set (hidden)"
        if isinstance(value, msgspec.Struct):
            value = msgspec.structs.asdict(value)
        table.add_row(key, str(value))
    table.add_row("served rewards", ", ".join(reward_names(settings)))
    for note in ignored_settings(settings):
        table.add_row("note", note)
    Console(stderr=True).print(table)


def check_port(settings: ServerSettings) -> None:
    """Bind `host:port` once before anything starts, so a port in use (another server) or an
    address this machine lacks is one line and exit 2, not a traceback after the banner. Not with
    `--ray-address`: Ray Serve's proxy listens on the cluster's head node, not necessarily here."""
    if settings.backend == "ray-serve" and settings.ray_address is not None:
        return
    try:
        listening_socket(settings.host, settings.port).close()
    except OSError as e:
        raise OSError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror} (another server on that "
                      "port?); pick another with --port or REWARD_PORT, or stop the one there") from None


def _parse_options(items: list[str] | None) -> dict[str, Any] | None:
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--judge-option")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def serve_command(
    config: Annotated[Path | None, typer.Option(help=(
        "TOML settings file (flags and env override it). Each [rewards.NAME] table is a reward spec, plus "
        "max_concurrency = N: at most N batches of that reward scored at once across the server's workers "
        "(more wait in order, up to the request timeout); with --http-processes P, each process schedules its "
        "own, so N must be >= P."))] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 18889, env REWARD_PORT).")] = None,
    model: Annotated[str | None, typer.Option(help="Judge checkpoint (env REWARD_MODEL).")] = None,
    engine: Annotated[str | None, typer.Option(help="Judge engine: auto (vLLM on a CUDA machine where it imports, else hf) | hf | vllm (env REWARD_ENGINE).")] = None,
    score_mode: Annotated[str | None, typer.Option(help="qa | vl_judge (env REWARD_SCORE_MODE).")] = None,
    task: Annotated[str | None, typer.Option(help="video | image (env REWARD_TASK).")] = None,
    qa_num: Annotated[int | None, typer.Option(help="Questions per caption (env REWARD_QA_NUM).")] = None,
    format_reward_weight: Annotated[float | None, typer.Option(help="Video format weight (env FORMAT_REWARD_WEIGHT).")] = None,
    judge_option: Annotated[list[str] | None, typer.Option(help="Judge scorer option KEY=VALUE (repeatable).")] = None,
    workers: Annotated[int | None, typer.Option(help="Worker processes; 0 scores in the server process (env REWARD_NUM_WORKERS).")] = None,
    http_processes: Annotated[int | None, typer.Option(help="Server processes sharing the port, for rule rewards on several cores (env REWARD_HTTP_PROCESSES; not with a judge).")] = None,
    ray: Annotated[bool | None, typer.Option("--ray/--no-ray", help="Run workers as Ray actors (rl-rewards[ray]).")] = None,
    ray_address: Annotated[str | None, typer.Option(help="Ray cluster address for --ray and --backend ray-serve (env RAY_ADDRESS; unset: a Ray of the server's own, on 127.0.0.1 only).")] = None,
    backend: Annotated[str | None, typer.Option(help=(
        "uvicorn (default) | ray-serve: each reward a Ray Serve deployment with replicas, batching in the replicas "
        "([ray_serve] in --config; pip install \"rl-rewards[ray-serve]\").")
    )] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer token for scoring routes (env REWARD_API_KEY).")] = None,
    media_root: Annotated[list[Path] | None, typer.Option(help="Directory requests may read media from (repeatable).")] = None,
    default_reward: Annotated[str | None, typer.Option(help="Reward used when a request names none.")] = None,
    openrlhf_reward: Annotated[str | None, typer.Option(help="Reward for /openrlhf/get_reward.")] = None,
    max_body_bytes: Annotated[int | None, typer.Option(help="Largest request body.")] = None,
    max_batch_samples: Annotated[int | None, typer.Option(help="Most samples per request.")] = None,
    max_text_chars: Annotated[int | None, typer.Option(help="Longest caption/completion/prompt.")] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="Most samples per scorer batch.")] = None,
    max_batch_tokens: Annotated[int | None, typer.Option(help="Token budget per scorer batch.")] = None,
    max_wait_ms: Annotated[float | None, typer.Option(help="Batching wait window.")] = None,
    max_metadata_depth: Annotated[int | None, typer.Option(help="Deepest nesting of a sample's metadata (16).")] = None,
    max_metadata_bytes: Annotated[int | None, typer.Option(help="Largest metadata of a sample, as JSON (64 KiB).")] = None,
    header_timeout: Annotated[float | None, typer.Option(help="Seconds for a request's headers to arrive (10).")] = None,
    body_timeout: Annotated[float | None, typer.Option(help="Seconds for a request's body to arrive after its headers (60).")] = None,
    max_connections: Annotated[int | None, typer.Option(help="Open connections per server process (1024).")] = None,
    request_timeout: Annotated[float | None, typer.Option(help="Seconds before a request not yet scored by the workers gets 503: your client's timeout (180).")] = None,
    chunk_deadline: Annotated[float | None, typer.Option(help="Seconds a worker has to answer a chunk before it is marked unhealthy and restarted (request timeout / 3).")] = None,
    restart_grace: Annotated[float | None, typer.Option(help="Seconds a worker being restarted has to exit before it is killed (5).")] = None,
    heartbeat_timeout: Annotated[float | None, typer.Option(help=(
        "Seconds a worker process may leave its heartbeat (a ping each second, answered while it scores) "
        "unanswered before it is taken for hung (stopped, deadlocked) and restarted (5)."))] = None,
    shutdown_timeout: Annotated[float | None, typer.Option(help="Seconds SIGTERM waits for open requests before answering them 503 (30).")] = None,
    log_format: Annotated[str | None, typer.Option(help="text | json")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug | info | warning")] = None,
) -> None:
    """Serve rewards over HTTP: CapRL's /get_reward, OpenRLHF's remote RM, native /v1/score."""
    flags = {
        "host": host, "port": port, "model": model, "engine": engine, "score_mode": score_mode, "task": task,
        "qa_num": qa_num, "format_reward_weight": format_reward_weight,
        "judge_options": _parse_options(judge_option), "workers": workers, "ray": ray,
        "http_processes": http_processes,
        "ray_address": ray_address, "backend": backend, "api_key": api_key,
        "media_roots": [str(p) for p in media_root] if media_root else None,
        "default_reward": default_reward, "openrlhf_reward": openrlhf_reward,
        "log_format": log_format, "log_level": log_level,
        "limits": {"max_body_bytes": max_body_bytes, "max_batch_samples": max_batch_samples, "max_text_chars": max_text_chars,
                   "max_metadata_depth": max_metadata_depth, "max_metadata_bytes": max_metadata_bytes,
                   "header_timeout_s": header_timeout, "body_timeout_s": body_timeout, "max_connections": max_connections},
        "pool": {"request_timeout_s": request_timeout, "chunk_deadline_s": chunk_deadline,
                 "restart_grace_s": restart_grace, "heartbeat_timeout_s": heartbeat_timeout},
        "shutdown_timeout_s": shutdown_timeout,
        "batching": {"max_batch_size": max_batch_size, "max_batch_tokens": max_batch_tokens, "max_wait_ms": max_wait_ms},
    }
    try:
        settings = load_settings(config, flags)
        settings.check()
        settings, engine_note = resolve_judge_engine(settings)
        # a blank REWARD_API_KEY reads as unset in the settings: refuse it too, it was meant as a key
        check_api_key(settings.api_key if settings.api_key is not None else os.environ.get("REWARD_API_KEY"))
        if settings.backend == "ray-serve":  # without the extra, the ImportError names it
            from rl_rewards.server.ray_serve import check_ray_serve

            check_ray_serve(settings)
        check_port(settings)
    except (ValueError, OSError, ImportError) as e:  # one line (a launcher's log keeps it whole), exit 2 as a bad option
        typer.echo(f"rl-rewards serve: error: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(2) from None
    configure_logging(settings)
    banner(settings)
    for note in ignored_settings(settings):  # one log line (the banner wraps it), json logs too
        logging.getLogger("rl_rewards.server").warning(note)
    for note in settings.notes():
        logging.getLogger("rl_rewards.server").info(note)
    if engine_note is not None:
        logging.getLogger("rl_rewards.server").info(engine_note)
    run(settings)


def run(settings: ServerSettings) -> None:
    """Serve until SIGINT/SIGTERM, then drain (`rl_rewards.server.serving`): stop accepting,
    answer every open request (up to `shutdown_timeout_s`), exit 0.

    With `http_processes > 1`, that many server processes listen on the same port (see
    `serve_processes`); each builds the settings from the environment and its own rewards, and
    their Prometheus metrics are written to a shared folder so `/metrics` reports all of them.
    With `backend = "ray-serve"`, a Ray Serve application instead (`rl_rewards.server.ray_serve`)."""
    from rl_rewards.server.app import build_app

    started = time.perf_counter()
    common = {"log_config": None, "access_log": False, "lifespan": "on"}
    if settings.backend == "ray-serve":
        from rl_rewards.server.ray_serve import run_ray_serve

        run_ray_serve(settings)
    elif settings.http_processes > 1:
        with tempfile.TemporaryDirectory(prefix="rl-rewards-metrics-") as metrics_dir:
            os.environ[SETTINGS_ENV] = to_json(settings).decode()
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
            serve_processes(settings.host, settings.port, settings.http_processes, common)
    else:
        serve(build_app(settings), settings, common)
    logging.getLogger("rl_rewards.server").info("stopped after %.0fs", time.perf_counter() - started)
    if settings.ray or settings.backend == "ray-serve":  # drained, Ray left, all logged: skip the interpreter's teardown,
        logging.shutdown()  # where Ray's native library can still abort the process (SIGABRT, exit -6)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
