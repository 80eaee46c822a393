"""gRPC plumbing shared by the router and the workers: server start-up with
health and reflection, channel options, and the one mapping from our
exceptions to status codes."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Iterator

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

log = logging.getLogger(__name__)

# A health service name that says SERVING for as long as the server runs (model
# loading and draining included): what a liveness probe asks, where "" (ready
# for work) is what a readiness probe asks.
LIVENESS_SERVICE = "liveness"

# Internal links carry KV pieces; the public API carries small requests.
INTERNAL_MESSAGE_BYTES = 64 * 1024 * 1024
PUBLIC_MESSAGE_BYTES = 4 * 1024 * 1024


def channel_options(max_message_bytes: int = INTERNAL_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        # A worker that restarts on its address is found again within seconds,
        # not after gRPC's default backoff of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


class RequestError(Exception):
    """Bad input from a caller: maps to INVALID_ARGUMENT unless another code is given.

    field: the refused request field's dotted name in the gRPC API
    ("sampling.temperature", "prompt"), so another edge can name it its own way.
    """

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(frozen=True)
class UnparsableMessage:
    """Stands in for a request whose bytes are not the declared message type."""

    type_name: str
    error: str

    def as_error(self) -> RequestError:
        return RequestError(f"request does not parse as {self.type_name}: {self.error}")


LENGTH_DELIMITED = 2  # the protobuf wire type of strings, bytes and messages


def read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ValueError("the message ends inside a varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


@dataclass(frozen=True)
class ProtoField:
    """One top-level field of a serialized message: its tag starts at `start`, its value is data[value_start:end]."""

    number: int
    wire_type: int
    start: int
    value_start: int
    end: int


def proto_fields(data: bytes) -> Iterator[ProtoField]:
    """The top-level fields of a serialized message, in order, unparsed.
    Raises ValueError where the bytes stop being a message."""
    i = 0
    while i < len(data):
        start = i
        key, i = read_varint(data, i)
        wire_type = key & 7
        if wire_type == 0:
            end = read_varint(data, i)[1]
        elif wire_type in (1, 5):
            end = i + (8 if wire_type == 1 else 4)
        elif wire_type == LENGTH_DELIMITED:
            length, i = read_varint(data, i)
            end = i + length
        else:
            raise ValueError(f"wire type {wire_type} is not supported")
        if end > len(data):
            raise ValueError("a field runs past the end of the message")
        yield ProtoField(key >> 3, wire_type, start, i, end)
        i = end


def invalid_utf8_field(descriptor, data: bytes, prefix: str = "") -> str | None:
    """The dotted name of the first string field holding invalid UTF-8, if any."""
    try:
        for wire_field in proto_fields(data):
            field = descriptor.fields_by_number.get(wire_field.number)
            if field is None or wire_field.wire_type != LENGTH_DELIMITED:
                continue
            chunk = data[wire_field.value_start : wire_field.end]
            if field.type == field.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return prefix + field.name
            elif field.type == field.TYPE_MESSAGE:
                found = invalid_utf8_field(field.message_type, chunk, f"{prefix}{field.name}.")
                if found:
                    return found
    except ValueError:
        return None
    return None


def lenient_parser(message_class):
    # gRPC answers INTERNAL when a deserializer raises; parsing here instead lets
    # the servicer answer INVALID_ARGUMENT (bad bytes, invalid UTF-8 in a string).
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            field = invalid_utf8_field(message_class.DESCRIPTOR, data)
            reason = f"field {field} is not valid UTF-8" if field else "the bytes are not a valid message of this type"
            return UnparsableMessage(message_class.DESCRIPTOR.full_name, reason)

    return parse


def register_service(server: grpc.aio.Server, servicer, service_descriptor, deserializers: dict | None = None) -> None:
    """Adds servicer's methods for a service, built from its descriptor.

    deserializers: method path -> a parser of the request bytes to use instead
    of the message class's (it must not raise: see lenient_parser).
    """
    deserializers = deserializers or {}
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service_descriptor.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        make = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=deserializers.get(f"/{service_descriptor.full_name}/{method.name}") or lenient_parser(request_class),
            response_serializer=lambda message: message.SerializeToString(),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))


def check_parsed(message):
    """Raises RequestError for a message that did not parse."""
    if isinstance(message, UnparsableMessage):
        raise message.as_error()
    return message


def refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends any call with code; an interceptor returns it to refuse."""

    async def refuse(request, context):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(refuse)


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Once draining, refuses new calls with UNAVAILABLE while calls in flight go on.

    Health checks always pass (probes must see NOT_SERVING), and so do the
    methods a server names as serving work it already accepted."""

    def __init__(self, exempt_methods: tuple[str, ...] = ()):
        self.draining = False
        self._exempt = ("/grpc.health.v1.Health/", *exempt_methods)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if self.draining and not details.method.startswith(self._exempt):
            return refusal(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        return await continuation(details)


class MethodAwareReflection(reflection.aio.ReflectionServicer):
    """Server reflection that also resolves a method's full name.

    grpcurl's `describe pkg.Service.Method` asks for the file containing that
    symbol; the stock Python servicer finds only top-level symbols (services,
    messages) and answers NOT_FOUND, where grpc-go servers answer. A method
    resolves to the file of its service."""

    def _file_containing_symbol(self, request, fully_qualified_name):
        response = super()._file_containing_symbol(request, fully_qualified_name)
        service = fully_qualified_name.rpartition(".")[0]
        if response.HasField("error_response") and service in self._service_names:
            return super()._file_containing_symbol(request, service)
        return response


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    drain: DrainInterceptor

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)


async def start_server(
    address: str,
    services: list[tuple[object, object]],
    max_message_bytes: int,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: tuple = (),
    drain_exempt: tuple[str, ...] = (),
    deserializers: dict | None = None,
) -> RunningServer:
    """Starts a grpc.aio server on address ("host:port", port 0 picks one).

    services: (servicer, service descriptor) pairs. Health (NOT_SERVING until
    the caller says otherwise) and reflection are added here for every server.
    """
    drain = DrainInterceptor(drain_exempt)
    server = grpc.aio.server(options=channel_options(max_message_bytes), interceptors=(drain, *interceptors))
    for servicer, descriptor in services:
        register_service(server, servicer, descriptor, deserializers)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [descriptor.full_name for _, descriptor in services]
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(MethodAwareReflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME]), server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    running = RunningServer(server, port, health_servicer, drain)
    await running.set_serving(False)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    return running


async def serve_until_signal(server: RunningServer, grace_seconds: float, busy) -> None:
    """Serves until SIGTERM or SIGINT, then drains: health goes NOT_SERVING (and
    keeps answering), new calls are refused with UNAVAILABLE, and the work in
    flight (busy() is true while there is some) gets grace_seconds to finish."""
    freeze_startup_objects()
    await stop_signals().wait()
    log.info("draining: NOT_SERVING; work in flight has %.1fs to finish", grace_seconds)
    await server.set_serving(False)
    server.drain.draining = True
    deadline = asyncio.get_running_loop().time() + grace_seconds
    while busy() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if busy():
        log.warning("grace period over; cutting the work still in flight")
    await server.server.stop(0.5)


def freeze_startup_objects() -> None:
    """Takes what start-up made (modules, transformers' and torch's objects, the model's: some 360,000
    for the tests' tiny model) out of the collector's sight for good (gc.freeze). A full collection
    walks every tracked object, and here it took 0.6 s whenever one ran while serving, a pause of every
    thread, the decode loop's included; at exit, the interpreter's last one took 3 s of a worker's
    3.5 s stop (0.6 s with this). The backends collect before they return (memory.return_freed_memory),
    so little garbage is frozen with them."""
    import gc

    gc.freeze()


async def load_while_not_serving(server: RunningServer, load):
    """Runs load() off the event loop while health says NOT_SERVING; if it fails
    (a model refused at start-up), the server stops before the error goes on."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, load)
    except BaseException:
        await server.server.stop(0)
        raise


async def stop_on_failure(server: RunningServer, step):
    """Runs step() (plain or async) on the event loop; if it fails (a transport
    refused at start-up), the server stops before the error goes on."""
    import inspect

    try:
        result = step()
        return await result if inspect.isawaitable(result) else result
    except BaseException:
        await server.server.stop(0)
        raise


def announce_ports(port_file: str | None, port: int, metrics_port: int, http_port: int | None = None) -> None:
    """Writes the bound ports for whoever started this process with --port 0."""
    if port_file:
        import json
        import os

        ports = {"port": port, "metrics_port": metrics_port, **({"http_port": http_port} if http_port is not None else {})}
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(ports, f)
        os.replace(tmp, port_file)


def stop_signals() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
