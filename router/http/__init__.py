"""The router's OpenAI-compatible HTTP API (`--http-port`): FastAPI on uvicorn,
on the same event loop as the gRPC server.

    schema.py     OpenAI's request bodies (pydantic)
    convert.py    request -> GenerateParams; refused gRPC field -> OpenAI parameter
    app.py        the routes, auth, server-sent events, disconnect = cancel
    streams.py    one request's generations (a batch of prompts) merged into one stream
    responses.py  OpenAI's response and chunk objects, usage, logprobs
    errors.py     OpenAI's error shape and the HTTP status of each refusal
    limits.py     the body's size, bounded before anything reads it whole
    server.py     uvicorn as a task beside grpc.aio
"""

from __future__ import annotations


async def start_http_front(config, router, draining):
    """The running HTTP front, or None when config.http_port is None.
    router: returns the Router once its workers are ready (None before);
    draining: true once the router drains."""
    import logging

    if config.http_port is None:
        return None
    from .app import FrontState
    from .server import HttpFront

    host = config.address.rsplit(":", 1)[0]
    state = FrontState(router=router, draining=draining, auth_token=config.auth_token, model_path=config.model,
                       max_body_bytes=config.http_max_body_bytes, timeout_seconds=config.http_timeout_seconds)
    front = HttpFront(state, host, config.http_port, config.public_tls)
    await front.start()
    scheme = "https" if config.public_tls else "http"
    logging.getLogger(__name__).info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, host, front.port)
    return front
