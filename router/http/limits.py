"""The request body's size, bounded before any route, token check or parser sees it.

FastAPI reads a body whole into memory and then parses it, so an unbounded body
is unbounded memory (a 100 MiB JSON body once took the router to 14 GB). This
ASGI layer reads the body itself, counting bytes as the server hands them over
(uvicorn stops reading the socket while a chunk waits unread), and answers 413
the moment the count passes the limit: at once when Content-Length already says
so, mid-body for a chunked one. The body it read is handed to the app unchanged;
later receive() calls (the disconnect the routes watch for) reach the server as
before. The refusal closes the connection: the rest of the body is never read.
A body still incomplete after the request's deadline (a client that trickles
it) gets 408 the same way: no connection waits forever on its body.
"""

from __future__ import annotations

import asyncio

from .errors import HttpError, bad_request, body_too_large, body_too_slow


class _BodyTooLarge(Exception):
    pass


class _ClientLeft(Exception):
    pass


def _declared_length(scope) -> int | None:
    """The Content-Length header's value; None when absent (a chunked body)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise bad_request("the Content-Length header is not a number", None) from None
    return None


async def _read_body(receive, max_bytes: int) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientLeft()
        body += message.get("body", b"")
        if len(body) > max_bytes:
            raise _BodyTooLarge()
        if not message.get("more_body", False):
            return bytes(body)


def _replaying(body: bytes, receive):
    """receive() for the app: the body read here first, then the server's own messages."""
    delivered = False

    async def replayed():
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _refuse(error: HttpError, scope, receive, send) -> None:
    response = error.response()
    response.headers["connection"] = "close"  # uvicorn then closes the socket: the unread rest of the body is dropped
    await response(scope, receive, send)


class BodyLimit:
    """ASGI middleware: the app only ever sees bodies of at most max_bytes."""

    def __init__(self, app, max_bytes: int, read_seconds: float):
        self.app, self.max_bytes, self.read_seconds = app, max_bytes, read_seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = _declared_length(scope)
            if declared is not None and declared > self.max_bytes:
                raise _BodyTooLarge()
            body = await asyncio.wait_for(_read_body(receive, self.max_bytes), self.read_seconds)
        except asyncio.TimeoutError:
            await _refuse(body_too_slow(self.read_seconds), scope, receive, send)
            return
        except _BodyTooLarge:
            await _refuse(body_too_large(self.max_bytes), scope, receive, send)
            return
        except HttpError as exc:
            await _refuse(exc, scope, receive, send)
            return
        except _ClientLeft:
            return  # no one to answer
        await self.app(scope, _replaying(body, receive), send)
