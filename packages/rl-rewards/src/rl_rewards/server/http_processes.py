"""`--http-processes N`: N server processes on one port, each with its own listening socket.

Why not uvicorn's `workers=N`: its supervisor binds one socket and every process accepts from
it, so a burst of connections goes to whichever process wakes first, which accepts all of them
(keep-alive connections opened together all land on one process, the others idle). Here each
process binds its own `SO_REUSEPORT` socket and the kernel spreads incoming connections over
them by their address hash. The supervisor restarts a process that dies and forwards
SIGINT/SIGTERM, so every process drains its in-flight requests before the port closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
from typing import Any

from rl_rewards.server.serving import listening_socket

log = logging.getLogger("rl_rewards.server")


def serve_processes(host: str, port: int, count: int, uvicorn_options: dict[str, Any]) -> None:
    """Run `count` server processes (`app_from_environment`) on `host:port` until SIGINT/SIGTERM.

    The settings reach the processes through the environment (the caller sets it). Port 0 is
    resolved once here, so every process listens on the same port."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--http-processes needs SO_REUSEPORT (Linux, macOS, BSD); run one process instead")
    holder = listening_socket(host, port, reuse_port=True)  # bound, never listening: fixes the port for the processes
    port = holder.getsockname()[1]
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    context = multiprocessing.get_context("spawn")

    def start() -> multiprocessing.process.BaseProcess:
        process = context.Process(target=_serve_one, args=(host, port, uvicorn_options), daemon=False)
        process.start()
        return process

    processes = [start() for _ in range(count)]
    try:
        while not stop.wait(0.5):
            for i, process in enumerate(processes):
                if not process.is_alive():
                    log.warning("server process %s exited with code %s; starting another", process.pid,
                                process.exitcode)
                    processes[i] = start()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn drains, then exits
        for process in processes:
            process.join()
        holder.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_one(host: str, port: int, uvicorn_options: dict[str, Any]) -> None:
    """One server process: its own SO_REUSEPORT listening socket on the shared port, its own
    rewards, the same read deadlines, connection cap and drain as a single server."""
    from rl_rewards.server.app import app_from_environment
    from rl_rewards.server.serving import serve

    app = app_from_environment()
    serve(app, app.state.service.settings, uvicorn_options, port=port, reuse_port=True)
