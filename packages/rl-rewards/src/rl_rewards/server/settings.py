"""Server configuration: defaults < TOML file < CapRL environment variables < CLI flags.

The environment variables are those of the CapRL++ launch script, so its users keep them:

| variable | field | note |
|---|---|---|
| `REWARD_MODEL` | `model` | judge checkpoint for `score_mode` (qa: text LLM, vl_judge: VLM) |
| `REWARD_ENGINE` | `engine` | judge engine: `auto` (default: vLLM on a CUDA machine where it imports, else hf), `hf`, `vllm`; the pick is logged and in `/health` (`judge_engine`); ours |
| `REWARD_PORT` | `port` | default 18889 |
| `REWARD_WORKER_BASE` | `worker_base_port` | not needed, ignored (a startup warning says so): workers use pipes, no ports |
| `REWARD_NUM_WORKERS` | `workers` | worker processes (0 = score in the server process) |
| `REWARD_SCORE_MODE` | `score_mode` | `qa` or `vl_judge`; a request's `score_mode` overrides it |
| `REWARD_TASK` | `task` | `video` adds `FORMAT_REWARD_WEIGHT`·R_fmt to qa rewards |
| `REWARD_QA_NUM` | `qa_num` | questions drawn per caption (CapRL sampling mode) |
| `FORMAT_REWARD_WEIGHT` | `format_reward_weight` | default 0.2 |
| `FORMAT_REWARD_VARIANT` | `format_reward_variant` | `readme` (default: the CapRL++ README formula) or `caprl-server` (what CapRL++'s server computes); ours |
| `FORMAT_MIN_BRACKETS` | `format_min_brackets` | default 3; stamps at which `caprl-server` coverage saturates |
| `REWARD_ANSWER_PARSER` | `answer_parser` | sampled qa answers: `strict` (default) or `caprl` (first capital A-I anywhere); ours |
| `REWARD_QA_PROMPT_FILE` | `qa_prompt_file` | judge prompt template file for qa (see `caption_qa`); ours |
| `REWARD_MEDIA_ROOT` | `media_roots` | directories requests may read media from, `:`-separated (like `--media-root`); ours |
| `CUDA_VISIBLE_DEVICES` | `cuda_visible_devices` | split into one contiguous group per worker |
| `REWARD_API_KEY` | `api_key` | bearer token required on scoring routes |
| `REWARD_HTTP_PROCESSES` | `http_processes` | server processes sharing the port (rule rewards; ours, not CapRL's) |
| `RAY_ADDRESS` | `ray_address` | Ray cluster for `--ray` and `--backend ray-serve` (unset: a Ray of the server's own, on 127.0.0.1) |
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from rl_rewards.server.interpreters import check_python, resolve_python
from rl_rewards.spec import spec_from_dict


class LimitSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Request limits. Exceeding one is a 413 (body) or 422 (batch, text) naming the limit."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_batch_samples: int = 4096
    max_text_chars: int = 200_000
    max_metadata_depth: int = 16
    """Deepest nesting of a sample's `metadata` (a dict inside a list is 2 levels); deeper: 422."""
    max_metadata_bytes: int = 64 * 1024
    """Largest `metadata` of one sample, as JSON; larger: 422. Media travel as paths, not bytes."""
    header_timeout_s: float = 10.0
    """From a connection's first byte (or its opening) to the end of a request's headers; a
    client slower than that gets 408 and is disconnected (slowloris)."""
    body_timeout_s: float = 60.0
    """From the end of the headers to the end of the body: raise it for clients that send
    `max_body_bytes` over a slow link."""
    max_connections: int = 1024
    """Open connections per server process; one more is answered 503 and closed."""


class BatchSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Dynamic batching (mosec-style): a batch closes when it holds `max_batch_size` samples or
    `max_batch_tokens` estimated tokens (whitespace words), or `max_wait_ms` after its first
    sample arrived. Raise `max_wait_ms` for GPU judges (fuller batches), keep it ~1 ms for rules."""

    max_batch_size: int = 256
    max_batch_tokens: int = 262_144
    max_wait_ms: float = 2.0


class DeploymentSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How one reward runs as a Ray Serve deployment (`--backend ray-serve`).

    - Replicas: `num_replicas` copies, or, with both `min_replicas` and `max_replicas`, Ray Serve's
      autoscaler between them, aiming at `target_ongoing_requests` calls in flight per replica.
      Rules scale with CPUs; a judge with replicas, one model copy each.
    - Resources: `num_cpus` and `num_gpus` each replica reserves on the cluster (`ray_actor_options`);
      `num_gpus = 1` gives each judge replica a GPU of its own (Ray sets its `CUDA_VISIBLE_DEVICES`),
      `0.5` packs two replicas on one GPU.
    - Batching (in each replica, the next batch collected once the last one is scored): calls from
      concurrent requests are scored together once they hold `max_batch_size` samples or `max_batch_tokens` estimated tokens, or
      `batch_wait_ms` after the first arrived; unset, `[batching]`'s `max_batch_size`,
      `max_batch_tokens` and `max_wait_ms` apply. Raise `batch_wait_ms` for GPU judges (fuller
      forwards), keep it ~1 ms for rules.
    - `max_ongoing_requests`: calls a replica holds at once, the batch being scored and those
      waiting for the next one (unset: the batch size, so single-sample requests can fill a batch;
      Ray Serve's default, 5, would cap a batch at 5 requests); more wait in the ingress."""

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int | None = None
    max_batch_size: int | None = None
    max_batch_tokens: int | None = None
    batch_wait_ms: float | None = None


class RayServeSettings(DeploymentSettings, kw_only=True, frozen=True):
    """`[ray_serve]`: the deployment settings of every reward, and `[ray_serve.rewards.NAME]`
    tables that change some of them for one reward (e.g. `num_gpus = 1` for the judge only).

    `ingress_replicas`: replicas of the ingress (routes, auth, limits, JSON), each taking a share
    of the connections. One ingress replica parses about as many samples per second as one rule
    replica scores, so rules scale past 2 replicas only with more of them; a judge needs one.
    With more than one, `/metrics` and the connection limit are per ingress replica (a scrape
    reads the replica that answered it)."""

    rewards: dict[str, dict[str, Any]] = {}
    ingress_replicas: int = 1

    def deployment(self, name: str) -> DeploymentSettings:
        """The settings of reward `name`'s deployment: `[ray_serve]`, then its own table.
        ValueError naming the table and the bad key or value."""
        shared = {k: v for k, v in msgspec.structs.asdict(self).items() if k not in ("rewards", "ingress_replicas")}
        try:
            merged = msgspec.convert({**shared, **self.rewards.get(name, {})}, DeploymentSettings)
        except msgspec.ValidationError as e:
            raise ValueError(f"[ray_serve.rewards.{name}]: {e}") from None
        low, high = merged.min_replicas, merged.max_replicas
        if (low is None) != (high is None):
            raise ValueError(f"ray_serve deployment {name!r}: set both min_replicas and max_replicas (autoscaling) "
                             "or neither (num_replicas)")
        if (low is not None and high is not None and not 0 <= low <= high) or high == 0:
            raise ValueError(f"ray_serve deployment {name!r}: need 0 <= min_replicas <= max_replicas and "
                             f"max_replicas >= 1, got {low} and {high}")
        if merged.num_replicas < 1 or (merged.max_ongoing_requests or 1) < 1 or merged.target_ongoing_requests <= 0:
            raise ValueError(f"ray_serve deployment {name!r}: num_replicas and max_ongoing_requests must be >= 1, "
                             "target_ongoing_requests > 0")
        if merged.num_cpus < 0 or merged.num_gpus < 0:
            raise ValueError(f"ray_serve deployment {name!r}: num_cpus and num_gpus must be >= 0")
        return merged


class PoolSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Deadlines of the worker pool (`--workers N`, `--ray`).

    `request_timeout_s` is how long a client waits for a scoring answer (the rl_rewards client
    and OpenRLHF wait 180 s): after it the server answers 503 rather than keep the request.
    Each chunk sent to a worker must come back within `chunk_deadline_s` (default: the request
    timeout split over `max_attempts`, so every retry still fits); a worker that misses it is
    marked unhealthy, its chunks go to another worker, and it is restarted: asked to exit, and
    killed if it has not after `restart_grace_s`. Set the deadline above the slowest batch a
    judge scores, or a busy worker is taken for a hung one.

    A worker process that runs no code at all (SIGSTOPped, or its whole process deadlocked) is
    caught sooner by its heartbeat: the router pings every worker process each
    `heartbeat_interval()` (1 s), a thread of the worker answers even while it scores, and a
    worker silent for `heartbeat_timeout_s` is treated as one that missed its deadline. Raise
    it only for scorers that hold Python's GIL for longer (a C extension that does not release
    it). Ray actors are not pinged (Ray runs an actor's calls one at a time): the deadline covers
    them. Ray Serve replicas (`backend = "ray-serve"`) get Ray Serve's health check as often, and
    one silent for about `heartbeat_timeout_s` is killed and its calls sent to another replica."""

    request_timeout_s: float = 180.0
    chunk_deadline_s: float | None = None
    restart_grace_s: float = 5.0
    heartbeat_timeout_s: float = 5.0
    max_attempts: int = 3

    def chunk_deadline(self) -> float:
        return self.chunk_deadline_s if self.chunk_deadline_s is not None else self.request_timeout_s / self.max_attempts

    def heartbeat_interval(self) -> float:
        """Seconds between pings: 1 s, or less for a short `heartbeat_timeout_s` (a few pings
        fit in it, so one late answer is not taken for a hung worker)."""
        return min(1.0, self.heartbeat_timeout_s / 4)


SERVING_KEYS = ("max_concurrency", "python")
"""Keys of a `[rewards.NAME]` table that say how the server runs the reward, not what it computes:

- `max_concurrency = N`: at most N batches of this reward are scored at once across the server
  (its worker processes or Ray actors included: one router schedules them all); more wait in the
  reward's queue, in order, and are answered when scored, or 503 once `request_timeout_s` has
  passed. For judges behind a rate-limited API. Each server process of `--http-processes` schedules
  its own, so there N must be at least the number of processes (each scores one batch at a time).
- `python = "/path/to/venv/bin/python"`: the reward is scored in worker processes of its own,
  started with that interpreter (`rl_rewards.server.interpreters`): one environment per reward
  where a scorer's dependencies clash with the server's. As many as `workers` (at least 1), the
  same GPU groups; the other rewards are served as without it. A path relative to the config
  file's folder, or a command on PATH; checked at start (it must import rl-rewards, at this
  server's version). Not with `ray`, `backend = "ray-serve"` or `http_processes` > 1."""


def _check_serving_keys(table: Mapping[str, Any], where: str, config: Path | None) -> dict[str, Any]:
    """`table` with its serving keys checked and `python` made an absolute path; ValueError
    naming the file, the line, the reward (`where`: its table) and the field."""
    limit = table.get("max_concurrency")
    if "max_concurrency" in table and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"{_at(config, where, 'max_concurrency')}: max_concurrency = {limit!r} must be an integer >= 1 (the most "
            "batches of this reward scored at once); leave it out for no limit"
        )
    if "python" not in table:
        return dict(table)
    raw = table["python"]
    at = f"{_at(config, where, 'python')}: python = {raw!r}:"
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"{at} must be the path of a Python interpreter, e.g. /opt/venvs/judge/bin/python")
    try:
        python = resolve_python(raw, Path(config).parent if config is not None else Path.cwd())
        check_python(python)
    except ValueError as e:
        raise ValueError(f"{at} {e}") from None
    return {**table, "python": python}


def _at(config: Path | None, table: str, key: str) -> str:
    """`FILE:LINE [table]` of `key` in the config file (without the line where it is not found
    as `key = ...` under a `[table]` header)."""
    if config is None:
        return f"[{table}]"
    current, number = None, None
    for i, line in enumerate(Path(config).read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("[") and not stripped.startswith("[["):
            current = stripped.strip("[] ").split("]")[0].strip()
        elif current == table and stripped.split("=")[0].strip() == key:
            number = i
            break
    return f"{config}{f':{number}' if number else ''} [{table}]"


class ServerSettings(msgspec.Struct, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 18889
    api_key: str | None = None
    model: str | None = None
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """The judge's engine: `vllm` (prefix-cached, the CapRL++ setup), `hf` (in-process
    transformers; exact scoring packs each caption's questions into one forward), or `auto`:
    vllm on a CUDA machine where vLLM imports, else hf. `--judge-option engine_options={...}`
    passes more arguments to it (e.g. gpu_memory_utilization)."""
    score_mode: Literal["qa", "vl_judge"] = "qa"
    task: Literal["video", "image"] = "video"
    qa_num: int = 8
    format_reward_weight: float = 0.2
    format_reward_variant: Literal["readme", "caprl-server"] = "readme"
    """`timestamp_format` formula: the CapRL++ README's, or the one CapRL++'s server computes."""
    format_min_brackets: int = 3
    answer_parser: Literal["strict", "caprl"] = "strict"
    """How the qa judge's sampled answers are read (`caption_qa`'s `answer_parser`)."""
    qa_prompt_file: str | None = None
    """A judge prompt template for qa (`caption_qa`'s `prompt_template`); None = ours."""
    judge_options: dict[str, Any] = {}
    worker_base_port: int | None = None  # CapRL's REWARD_WORKER_BASE: accepted, not needed, ignored
    workers: int = 0
    http_processes: int = 1
    """Server processes sharing the port (uvicorn's supervisor), each with its own copy of the
    rewards. For rule/CPU rewards on a multi-core machine: one Python process uses one core.
    Model judges scale with `workers` instead (one copy per GPU group), so a judge (`model`),
    `workers` or `ray` with more than one HTTP process is refused."""
    cuda_visible_devices: str | None = None
    ray: bool = False
    ray_address: str | None = None
    """The Ray cluster `--ray` and `--backend ray-serve` run on, as `ray start --head` prints it
    (`HEAD_IP:6379`); its nodes run the workers with the Python they were started with, so
    rl-rewards and your `[scorers]` must be installed there. None: a Ray of the server's own on
    this machine, listening on 127.0.0.1 only, its workers this interpreter (`ray_driver`)."""
    media_roots: list[str] = []
    rewards: dict[str, dict[str, Any]] = {}
    """`[rewards.NAME]` tables: a `RewardSpec` each, plus the serving keys of `SERVING_KEYS`
    (`max_concurrency`), which are not part of the reward's formula (`reward_spec` drops them)."""
    default_reward: str = ""
    openrlhf_reward: str = ""
    limits: LimitSettings = LimitSettings()
    batching: BatchSettings = BatchSettings()
    pool: PoolSettings = PoolSettings()
    log_format: Literal["text", "json"] = "text"
    log_level: str = "info"
    shutdown_timeout_s: float = 30.0
    backend: Literal["uvicorn", "ray-serve"] = "uvicorn"
    """`uvicorn`: this process serves HTTP and scores (in-process, `workers` processes or `ray`
    actors). `ray-serve` (extra `rl-rewards[ray-serve]`): a Ray Serve application on a local Ray
    or `ray_address`, each reward a deployment with replicas (`ray_serve`), this app its ingress."""
    ray_serve: RayServeSettings = RayServeSettings()
    scorers: dict[str, str] = {}
    """Your own scorers, `NAME = "package.module:Factory"`: registered (`register_scorer`) in every
    process that builds rewards (this one, each worker, actor or replica) before `[rewards]` name
    them; the module must be importable there."""

    def check(self) -> None:
        """Raise ValueError naming the setting when a value or a combination cannot run."""
        if self.backend == "ray-serve" and (self.workers > 0 or self.ray or self.http_processes > 1):
            raise ValueError(
                "backend=ray-serve scales with Ray Serve replicas ([ray_serve] num_replicas, min_replicas/max_replicas, "
                "num_gpus); drop workers/REWARD_NUM_WORKERS, --ray and http_processes"
            )
        for name in self.interpreters():
            how = ("backend=ray-serve" if self.backend == "ray-serve" else "--ray" if self.ray
                   else f"http_processes={self.http_processes}" if self.http_processes > 1 else None)
            if how is not None:
                raise ValueError(
                    f"[rewards.{name}] python: the reward's own worker processes run under the default backend with "
                    f"http_processes=1 (--workers N or none); {how} cannot start them: drop one of the two"
                )
        bad = _non_finite(msgspec.to_builtins(self), "")
        if bad is not None:
            # JSON, which carries the settings to worker processes, turns NaN and inf into null
            raise ValueError(f"{bad[0]} = {bad[1]} is not a finite number; set a finite value")
        if self.pool.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0 seconds, got {self.pool.heartbeat_timeout_s}")
        if self.workers < 0:
            raise ValueError(f"workers = {self.workers}: must be >= 0 (0 scores in the server process, "
                             "N >= 1 starts N worker processes)")
        if self.http_processes < 1:
            raise ValueError(f"http_processes must be >= 1, got {self.http_processes}")
        for name, limit in self.max_concurrency().items():
            if limit < self.http_processes:
                raise ValueError(
                    f"rewards.{name}.max_concurrency = {limit} cannot hold across http_processes={self.http_processes}: "
                    "each server process schedules its own batches (one at a time), so up to "
                    f"{self.http_processes} would be scored at once; use http_processes=1 (with --workers N to score "
                    "several batches at once) or max_concurrency >= http_processes"
                )
        if self.http_processes > 1 and (self.model is not None or self.workers > 0 or self.ray):
            raise ValueError(
                f"http_processes={self.http_processes} would load the judge / start the worker pool once per "
                "process; use http_processes=1 with --workers N to scale model judges (REWARD_MODEL, --workers, --ray)"
            )
        self.gpu_groups()

    def reward_spec(self, name: str) -> dict[str, Any]:
        """The `RewardSpec` part of `[rewards.NAME]` (its serving keys dropped)."""
        return {k: v for k, v in self.rewards[name].items() if k not in SERVING_KEYS}

    def max_concurrency(self) -> dict[str, int]:
        """`max_concurrency` of each `[rewards.NAME]` that sets one."""
        return {name: table["max_concurrency"] for name, table in self.rewards.items() if "max_concurrency" in table}

    def interpreters(self) -> dict[str, str]:
        """`python` of each `[rewards.NAME]` that sets one: scored by worker processes of that interpreter."""
        return {name: table["python"] for name, table in self.rewards.items() if "python" in table}

    def notes(self) -> list[str]:
        """What a user should know at startup about the settings in effect (logged once)."""
        if self.media_roots:
            return []
        return [
            "no media root configured (--media-root or REWARD_MEDIA_ROOT): a sample that names an image or "
            "video file will fail with an error; samples without media (e.g. an empty video_path) are judged "
            "on their text alone"
        ]

    def gpu_groups(self) -> list[str | None]:
        """One `CUDA_VISIBLE_DEVICES` value per worker: the listed devices cut into `workers`
        contiguous groups (CapRL's one-worker-per-GPU-group layout); None = leave unset."""
        if self.workers <= 0 or not self.cuda_visible_devices:
            return [None] * max(self.workers, 0)
        devices = [d.strip() for d in self.cuda_visible_devices.split(",") if d.strip()]
        if len(devices) < self.workers:
            raise ValueError(
                f"workers={self.workers} but CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r} "
                f"lists {len(devices)} device(s); use at most {len(devices)} workers"
            )
        size = len(devices) // self.workers
        return [",".join(devices[i * size : (i + 1) * size]) for i in range(self.workers)]


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The first NaN or infinite float in `value` (builtins: dicts, lists, numbers), with its path."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


def _paths(raw: str) -> list[str]:
    """`REWARD_MEDIA_ROOT`: one directory, or several separated by `:` (as in PATH)."""
    return [part for part in raw.split(os.pathsep) if part.strip()]


_ENV: dict[str, tuple[str, Any]] = {
    "REWARD_MODEL": ("model", str),
    "REWARD_ENGINE": ("engine", str),
    "REWARD_PORT": ("port", int),
    "REWARD_WORKER_BASE": ("worker_base_port", int),
    "REWARD_NUM_WORKERS": ("workers", int),
    "REWARD_SCORE_MODE": ("score_mode", str),
    "REWARD_TASK": ("task", str),
    "REWARD_QA_NUM": ("qa_num", int),
    "FORMAT_REWARD_WEIGHT": ("format_reward_weight", float),
    "FORMAT_REWARD_VARIANT": ("format_reward_variant", str),
    "FORMAT_MIN_BRACKETS": ("format_min_brackets", int),
    "REWARD_ANSWER_PARSER": ("answer_parser", str),
    "REWARD_QA_PROMPT_FILE": ("qa_prompt_file", str),
    "REWARD_MEDIA_ROOT": ("media_roots", _paths),
    "CUDA_VISIBLE_DEVICES": ("cuda_visible_devices", str),
    "REWARD_API_KEY": ("api_key", str),
    "REWARD_HTTP_PROCESSES": ("http_processes", int),
    "RAY_ADDRESS": ("ray_address", str),
}


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings CapRL's environment variables ask for (unset or empty ones are skipped)."""
    out: dict[str, Any] = {}
    for var, (field, kind) in _ENV.items():
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            out[field] = kind(raw)
        except ValueError:
            raise ValueError(f"environment variable {var}={raw!r} is not a valid {kind.__name__}") from None
    return out


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def load_settings(
    config: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerSettings:
    """Build the settings in effect: defaults < `config` (TOML) < CapRL env vars < `flags`.

    `flags` holds only the options given on the command line (None values are dropped); nested
    tables use dicts (`{"limits": {"max_body_bytes": 1024}}`). A bad value raises ValueError
    naming the field and its source."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if config is not None:
        with Path(config).open("rb") as f:
            try:
                layers.append((str(config), tomllib.load(f)))
            except tomllib.TOMLDecodeError as e:  # its message gives the line, not the file
                line = re.search(r"at line (\d+)", str(e))
                raise ValueError(f"{config}{f':{line[1]}' if line else ''}: invalid TOML: {e}") from None
    layers.append(("environment", env_overrides(os.environ if environ is None else environ)))
    layers.append(("flags", _drop_none(flags or {})))
    merged: dict[str, Any] = {}
    for _, layer in layers:
        merged = _merge(merged, layer)
    try:
        settings = msgspec.convert(merged, ServerSettings)
    except msgspec.ValidationError as e:
        sources = ", ".join(name for name, _ in layers)
        raise ValueError(f"invalid server setting: {e} (from {sources})") from None
    rewards: dict[str, dict[str, Any]] = {}
    for name, table in settings.rewards.items():  # only the TOML file configures rewards
        rewards[name] = _check_serving_keys(table, f"rewards.{name}", config)
        spec_from_dict(settings.reward_spec(name), source=f"{config} [rewards.{name}]")
    return msgspec.structs.replace(settings, rewards=rewards)


def _drop_none(flags: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, Mapping):
            nested = _drop_none(value)
            if nested:
                out[key] = nested
        elif value is not None:
            out[key] = value
    return out


def to_json(settings: ServerSettings) -> bytes:
    """Settings as JSON (handed to worker processes and printed in the startup banner)."""
    return msgspec.json.encode(settings)


def from_json(data: bytes | str) -> ServerSettings:
    return msgspec.json.decode(data, type=ServerSettings)
