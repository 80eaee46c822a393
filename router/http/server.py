"""The HTTP front's server: uvicorn on the router's own event loop.

uvicorn runs as a task beside the grpc.aio server (no extra process or hop);
its signal handlers stay off, since the router's drain (disagg.rpc.server.
serve_until_signal) owns SIGTERM and SIGINT for both servers: once draining,
the routes answer 503 to new requests, and the HTTP server stops after the
work in flight has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from .app import FrontState, create_app
from .limits import BodyLimit

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the router handles signals for both servers


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the port is announced: a port in use is
    an error at start-up, with the port named."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto
    # is IPPROTO_TCP, and a connection accepted here inherits proto 0 otherwise: then
    # each small SSE write after the first waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"could not bind the HTTP port {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpFront:
    def __init__(self, state: FrontState, host: str, port: int, tls=None):
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        tls_files = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key} if tls else {}
        app = BodyLimit(create_app(state), state.max_body_bytes, state.timeout_seconds)
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=2, **tls_files)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
