"""Large JSON bodies are parsed on a thread, not on the event loop the streams share.

FastAPI parses a body with Request.json() on the event loop; a body near the 4 MiB limit
(half a million token ids) then holds every other stream for the whole parse. Bodies over
OFF_LOOP_BYTES are parsed on a thread instead, by the json module's pure-Python scanner:
the C scanner would hold the GIL for the whole parse, and the loop would wait on it just
the same, while the Python scanner runs bytecode and lets the loop in every switch
interval. That parse is slower (about a second for 4 MiB of token ids), which only the
large request itself waits for. Smaller bodies keep the C parser on the loop: a thread
hop would cost them more than it saves. The limits (limits.py) are untouched.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner

from fastapi import Request
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 64 * 1024


class _PythonScannerDecoder(json.JSONDecoder):
    """json's decoder with its pure-Python scanner: the same grammar and errors as the C one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scan_once = json.scanner.py_make_scanner(self)


def parse_large(body: bytes):
    """Runs on a thread (the seam the tests watch)."""
    return json.loads(body, cls=_PythonScannerDecoder)


class OffLoopJsonRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(parse_large, body) if len(body) > OFF_LOOP_BYTES else json.loads(body)
        return self._json


class OffLoopJsonRoute(APIRoute):
    """The routes' class (FastAPI's custom request/route hook): their requests parse large bodies off the loop."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def parsed_off_loop(request: Request):
            return await handler(OffLoopJsonRequest(request.scope, request.receive))

        return parsed_off_loop
