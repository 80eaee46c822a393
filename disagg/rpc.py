"""gRPC plumbing shared by the router and the workers: server start-up with
health and reflection, channel options, and the one mapping from our
exceptions to status codes."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Internal links carry KV pieces; the public API carries small requests.
INTERNAL_MESSAGE_BYTES = 64 * 1024 * 1024
PUBLIC_MESSAGE_BYTES = 4 * 1024 * 1024


def channel_options(max_message_bytes: int = INTERNAL_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
    ]


class RequestError(Exception):
    """Bad input from a caller: maps to INVALID_ARGUMENT unless another code is given."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)


async def start_server(address: str, register, service_names: list[str], max_message_bytes: int) -> RunningServer:
    """Starts a grpc.aio server on address ("host:port", port 0 picks one).

    register(server) adds the servicers; health (NOT_SERVING until the caller
    says otherwise) and reflection are added here for every server.
    """
    server = grpc.aio.server(options=channel_options(max_message_bytes))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    running = RunningServer(server, port, health_servicer)
    await running.set_serving(False)
    return running


def stop_signals() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def host_port(address: str, port: int) -> str:
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"
