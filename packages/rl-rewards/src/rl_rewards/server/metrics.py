"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Exposed at `GET /metrics` in the Prometheus text format:
`rl_rewards_requests_total{route,status}`, `rl_rewards_request_seconds{route}`,
`rl_rewards_samples_total{reward}`, `rl_rewards_sample_errors_total{reward}`,
`rl_rewards_batch_size{reward}`, `rl_rewards_queue_depth{reward}` (samples waiting),
`rl_rewards_batches_in_flight{reward}` (batches being scored), `rl_rewards_max_concurrency{reward}`
(the reward's `max_concurrency`, where it sets one),
`rl_rewards_batch_seconds{reward}` (scoring latency per scorer batch),
`rl_rewards_worker_restarts_total`, `rl_rewards_chunk_retries_total`;
faults: `rl_rewards_workers_healthy`, `rl_rewards_chunk_deadline_misses_total` (a worker marked
unhealthy), `rl_rewards_heartbeat_misses_total` (a worker process marked hung: silent for
`heartbeat_timeout_s`), `rl_rewards_connections` (open now), `rl_rewards_connections_refused_total` (over
`max_connections`), `rl_rewards_read_timeouts_total{phase}` (headers | body: slow clients cut
off), and the limits in force as `rl_rewards_limit{limit}`.

With several server processes (`--http-processes`), `PROMETHEUS_MULTIPROC_DIR` is set: every
process writes its values there and `/metrics` adds them up, whichever process answers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rl_rewards.samples import Sample, ScoreResult
from rl_rewards.server.settings import ServerSettings

CONTENT_TYPE = CONTENT_TYPE_LATEST
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rl_rewards_requests", "HTTP requests", ["route", "status"], registry=r)
        self.request_seconds = Histogram("rl_rewards_request_seconds", "Request latency", ["route"], registry=r)
        self.samples = Counter("rl_rewards_samples", "Samples scored", ["reward"], registry=r)
        self.sample_errors = Counter("rl_rewards_sample_errors", "Samples that failed", ["reward"], registry=r)
        self.batch_size = Histogram(
            "rl_rewards_batch_size", "Samples per scorer batch", ["reward"], buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram("rl_rewards_batch_seconds", "Scoring latency per batch", ["reward"], registry=r)
        self.queue_depth = Gauge("rl_rewards_queue_depth", "Samples waiting to be batched", ["reward"], registry=r,
                                 multiprocess_mode="livesum")
        self.batches_in_flight = Gauge("rl_rewards_batches_in_flight", "Batches being scored", ["reward"],
                                       registry=r, multiprocess_mode="livesum")
        self.max_concurrency = Gauge("rl_rewards_max_concurrency", "Most batches of a reward scored at once",
                                     ["reward"], registry=r, multiprocess_mode="max")
        self.worker_restarts = Counter("rl_rewards_worker_restarts", "Worker processes restarted", registry=r)
        self.chunk_retries = Counter("rl_rewards_chunk_retries", "Chunks retried on another worker", registry=r)
        self.deadline_misses = Counter(
            "rl_rewards_chunk_deadline_misses", "Chunks a worker did not answer within the deadline", registry=r
        )
        self.heartbeat_misses = Counter(
            "rl_rewards_heartbeat_misses", "Worker processes marked hung: no heartbeat within the timeout", registry=r
        )
        self.workers_healthy = Gauge("rl_rewards_workers_healthy", "Workers taking chunks", registry=r,
                                     multiprocess_mode="livesum")
        self.connections = Gauge("rl_rewards_connections", "Open HTTP connections", registry=r,
                                 multiprocess_mode="livesum")
        self.connections_refused = Counter(
            "rl_rewards_connections_refused", "Connections refused over max_connections", registry=r
        )
        self.read_timeouts = Counter(
            "rl_rewards_read_timeouts", "Requests cut off for arriving too slowly", ["phase"], registry=r
        )
        self.limits = Gauge("rl_rewards_limit", "A limit in force (per server process)", ["limit"], registry=r,
                            multiprocess_mode="max")
        # labelled children by label values: `.labels()` takes a lock and builds its key on every
        # call, and these are updated on every request
        self._request_children: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._reward_children: dict[str, tuple[Any, Any, Any, Any]] = {}

    def show_limits(self, settings: ServerSettings) -> None:
        """Publish the fault limits in force, so a dashboard shows what a cut-off was measured against."""
        limits, pool = settings.limits, settings.pool
        shown = {
            "header_timeout_s": limits.header_timeout_s, "body_timeout_s": limits.body_timeout_s,
            "max_connections": limits.max_connections, "max_body_bytes": limits.max_body_bytes,
            "max_metadata_depth": limits.max_metadata_depth, "max_metadata_bytes": limits.max_metadata_bytes,
            "request_timeout_s": pool.request_timeout_s, "chunk_deadline_s": pool.chunk_deadline(),
            "restart_grace_s": pool.restart_grace_s, "heartbeat_timeout_s": pool.heartbeat_timeout_s,
            "shutdown_timeout_s": settings.shutdown_timeout_s,
        }
        for name, value in shown.items():
            self.limits.labels(name).set(value)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        children = self._request_children.get((route, status))
        if children is None:
            children = self._request_children[(route, status)] = (
                self.requests.labels(route, str(status)), self.request_seconds.labels(route),
            )
        children[0].inc()
        children[1].observe(seconds)

    def observe_batch(
        self, reward: str, samples: Sequence[Sample], results: Sequence[ScoreResult], seconds: float
    ) -> None:
        children = self._reward_children.get(reward)
        if children is None:
            children = self._reward_children[reward] = (
                self.samples.labels(reward), self.sample_errors.labels(reward),
                self.batch_size.labels(reward), self.batch_seconds.labels(reward),
            )
        n_samples, n_errors, batch_size, batch_seconds = children
        n_samples.inc(len(samples))
        errors = len(results) - [r.error for r in results].count(None)
        if errors:
            n_errors.inc(errors)
        batch_size.observe(len(samples))
        batch_seconds.observe(seconds)

    def render(self) -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # one server process of several: sum them all
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
