"""The reward server on uvicorn, hardened against slow clients and stopped cleanly.

uvicorn (0.54) times out a keep-alive connection between requests, but not a client that opens
a connection and trickles its headers or body (slowloris: every such socket stays open for as long
as the client likes); its `limit_concurrency` and its own 400/500 answers are plain text; and on
SIGTERM it closes the listening socket (connections still in the kernel's accept queue are reset),
closes idle keep-alive connections at once (a request its client sent that instant is reset), and
re-raises the signal after its drain (exit status -15). `GuardedProtocol` and `DrainingServer` fix
those, per server process:

- headers must arrive within `header_timeout_s` of a request's first byte (or of the connection's
  opening), the body within `body_timeout_s` of the headers; else 408 (JSON) and the connection
  closes (`rl_rewards_read_timeouts_total{phase}`);
- past `max_connections` open connections, a new one gets 503 (JSON) and is closed
  (`rl_rewards_connections_refused_total`; `rl_rewards_connections` is the open count);
- the drain: connections waiting in the accept queue are taken and served, then the socket
  closes; every request being read or scored is answered, with `Connection: close`; an idle
  keep-alive connection stays open `IDLE_LINGER_S` so a request already on its way is answered too;
  after `shutdown_timeout_s` the requests still waiting for a batch are answered 503 (JSON);
  then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, ClassVar

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from rl_rewards import wire
from rl_rewards.server.metrics import Metrics
from rl_rewards.server.settings import LimitSettings, ServerSettings

log = logging.getLogger("rl_rewards.server")

IDLE_LINGER_S = 2.0
"""How long an idle keep-alive connection stays open once a drain begins: a request its client
sent as the drain began is answered (with `Connection: close`) instead of meeting a closed socket.
Long enough for a client whose thread a busy machine stalls between two requests (0.5 s was not,
on a loaded 2-core CI: one request of ~200 met the close)."""
ABORT_FLUSH_S = 1.0
"""After the grace period, time for the 503 answers to the aborted requests to be written."""


def error_response(status: int, error: str, limit: str | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON `ErrorResponse` body that closes the connection."""
    body = wire.encode_json(wire.ErrorResponse(error=error, limit=limit))
    head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    return STATUS_LINE[status] + head + body


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines, a connection cap and JSON errors.

    `_phase` is where the connection is: `waiting` (no byte of a request yet), `headers`,
    `body` (the client is sending), `app` (the request is complete and being answered). One timer
    guards the two client phases; it is armed lazily at the end of `data_received`, so a request
    that arrives whole costs no timer."""

    limits: ClassVar[LimitSettings]
    metrics: ClassVar[Metrics]
    draining: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "waiting"
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.metrics.connections.inc()
        if len(self.connections) > self.limits.max_connections:
            self.metrics.connections_refused.inc()
            self._refuse(503, f"the server has max_connections={self.limits.max_connections} connections open; "
                         "retry shortly or raise --max-connections", "max_connections")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.metrics.connections.dec()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # refused or timed out: read nothing more
            return
        super().data_received(data)
        if self._read_timer is None and self._phase in ("headers", "body") and not self.transport.is_closing():
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "headers"

    def on_headers_complete(self) -> None:
        self._disarm()
        self._phase = "body"
        super().on_headers_complete()
        if self.draining and self.cycle is not None:
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        self._disarm()
        answered = self.cycle is not None and self.cycle.response_complete  # e.g. 413 before the body
        self._phase = "waiting" if answered else "app"
        super().on_message_complete()
        if answered:
            self._arm()  # uvicorn armed its keep-alive timer before the body ended; bytes since cancelled it

    def on_response_complete(self) -> None:
        if self._phase == "app":
            self._phase = "waiting"
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(error_response(400, f"malformed HTTP request: {msg}"))
        self.transport.close()

    def shutdown(self) -> None:
        """Called when a drain begins: a request being read or answered is finished with
        `Connection: close`; an idle connection closes after `IDLE_LINGER_S` unless a request comes."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            return
        if self._phase in ("headers", "body"):
            return  # on_headers_complete answers it with Connection: close
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(IDLE_LINGER_S, self.timeout_keep_alive_handler)

    def _arm(self) -> None:
        seconds = self.limits.body_timeout_s if self._phase == "body" else self.limits.header_timeout_s
        self._read_timer = self.loop.call_later(seconds, self._read_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self._phase == "app":
            return
        if self._phase == "waiting":  # never sent a request (or nothing after the last): just close
            self.transport.close()
            return
        self.metrics.read_timeouts.labels(self._phase).inc()
        limit = "body_timeout_s" if self._phase == "body" else "header_timeout_s"
        seconds = getattr(self.limits, limit)
        flag = limit.removesuffix("_s").replace("_", "-")
        log.info("cut off a client %s: request %s not received within %s s", self.client, self._phase, seconds)
        self._refuse(408, f"request {self._phase} not received within {limit}={seconds}; send it faster or "
                     f"raise --{flag}", limit)

    def _refuse(self, status: int, error: str, limit: str) -> None:
        """Answer `status` with a JSON error and close; a request the app is reading sees a disconnect."""
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            if self.cycle.response_started:  # cannot answer twice
                self.transport.close()
                return
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(error_response(status, error, limit))
        self.transport.close()


def guarded_protocol(limits: LimitSettings, metrics: Metrics) -> type[GuardedProtocol]:
    """A `GuardedProtocol` class bound to one server's limits and metrics (uvicorn instantiates
    the class it is given, once per connection)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "metrics": metrics, "draining": False})


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound, listening TCP socket (`SO_REUSEPORT` when several processes share the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` whose shutdown is the drain described in the module docstring.

    `on_grace_expired` is called once `timeout_graceful_shutdown` has passed with requests still
    open: it should answer them (`RewardService.abort`)."""

    def __init__(self, config: uvicorn.Config, on_grace_expired: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_grace_expired = on_grace_expired

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        started = time.monotonic()
        protocol = self.config.http_protocol_class
        protocol.draining = True  # type: ignore[attr-defined]
        queued = _take_queued(sockets or [])
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await self._serve_taken(queued)
        for connection in list(self.server_state.connections):
            connection.shutdown()
        log.info("draining: stopped accepting; %d connection(s), %d request(s) open (%d taken from the accept "
                 "queue)", len(self.server_state.connections), len(self.server_state.tasks), len(queued))
        grace = self.config.timeout_graceful_shutdown
        if not await self._drained(grace):
            log.warning("draining: %d request(s) still open after shutdown_timeout_s=%s; answering them 503",
                        len(self.server_state.tasks), grace)
            self._on_grace_expired()
            if not await self._drained(ABORT_FLUSH_S):
                for task in self.server_state.tasks:
                    task.cancel()
                for connection in list(self.server_state.connections):
                    connection.transport.close()
        log.info("drained in %.2f s", time.monotonic() - started)
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _serve_taken(self, queued: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        for conn in queued:
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                await loop.connect_accepted_socket(self._new_protocol, conn)

    def _new_protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )

    async def _drained(self, timeout: float | None) -> bool:
        """True once no connection and no request is open; False after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self.server_state
        while (state.connections or state.tasks) and not self.force_exit:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """SIGINT/SIGTERM start the drain; unlike uvicorn's, the signal is not raised again
        afterwards, so a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _take_queued(sockets: list[socket.socket]) -> list[socket.socket]:
    """Connections the kernel has completed but nobody accepted yet: closing the listening socket
    would reset them, so the drain accepts and answers them."""
    taken = []
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            while True:
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                taken.append(conn)
    return taken


def serve(app: Starlette, settings: ServerSettings, options: dict[str, Any], port: int | None = None,
          reuse_port: bool = False) -> None:
    """Serve `app` (from `build_app`) until SIGINT/SIGTERM, then drain (see the module docstring).
    `options` are further `uvicorn.Config` arguments; `port` overrides `settings.port`."""
    port = settings.port if port is None else port
    service = app.state.service
    sock = listening_socket(settings.host, port, reuse_port)
    protocol = guarded_protocol(settings.limits, service.metrics)
    config = uvicorn.Config(app, host=settings.host, port=port, http=protocol,
                            timeout_graceful_shutdown=settings.shutdown_timeout_s, **options)  # type: ignore[arg-type]
    grace = settings.shutdown_timeout_s
    log.info("listening on http://%s:%d", settings.host, sock.getsockname()[1])
    server = DrainingServer(config, lambda: service.abort(
        f"the server shut down before this request was scored (shutdown_timeout_s={grace}); send it again"
    ))
    service.on_load_failure = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    if service.load_error is not None:  # stopped because the rewards could not be loaded
        raise SystemExit(f"rl-rewards serve: error: {service.load_error}")
