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
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .app import FrontState, create_app
from .limits import BodyLimit

log = logging.getLogger(__name__)

HEADER_SECONDS = 30.0  # at most this long for a request's head (as nginx's client_header_timeout, 60 s)


class HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline for each request's line and headers.

    uvicorn times a connection only between requests (timeout_keep_alive) and the body
    is bounded by BodyLimit, which runs once the head is complete; a client that opens
    connections and sends their heads a byte at a time (or nothing) would hold them, and
    their memory, for ever. The head must be complete within head_seconds of the
    connection opening or the request beginning, or the connection is closed unanswered.
    """

    head_seconds = HEADER_SECONDS
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_head_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_seconds, self._head_too_slow)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def head_deadline_protocol(seconds: float) -> type[HeadDeadlineProtocol]:
    return type("HeadDeadline", (HeadDeadlineProtocol,), {"head_seconds": seconds})


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
        # The head's deadline: HEADER_SECONDS, or the whole request's if that is shorter.
        protocol = head_deadline_protocol(min(HEADER_SECONDS, state.timeout_seconds))
        config = uvicorn.Config(
            app, http=protocol, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=2, **tls_files
        )
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
